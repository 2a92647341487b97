"""Run the Triton kernel tests under Triton's CPU interpreter in fresh interpreters.

``TRITON_INTERPRET=1`` only takes effect if it is set before ``triton`` is first
imported (``torch`` imports it), so the tests of ``test_kernels_triton.py`` are run
in subprocesses with the variable in their environment. The interpreter runs on one
core, so the tests are split into one shard per core (every other test of the
collected list), run side by side.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # the Triton kernels under the interpreter: minutes of CPU

HERE = Path(__file__).resolve().parent
MODULE = HERE / "test_kernels_triton.py"


def _shards() -> int:
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU test_kernels_triton.py runs the kernels directly")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already interpreting: runs directly")
def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    listed = subprocess.run([*base, "--collect-only", str(MODULE)], capture_output=True, text=True, env=env,
                            cwd=HERE.parent, timeout=300)
    ids = [ln.strip() for ln in listed.stdout.splitlines() if "::" in ln]
    assert listed.returncode == 0 and ids, (listed.stdout + listed.stderr)[-3000:]
    n = _shards()
    procs = [subprocess.Popen([*base, "-x", *ids[i::n]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=HERE.parent) for i in range(n)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs):
        tail = out[-6000:]
        assert p.returncode == 0, tail
        assert " passed" in tail and "skipped" not in tail.splitlines()[-1], tail
    assert sum(int(out.strip().splitlines()[-1].split(" passed")[0].split()[-1]) for out in outs) == len(ids)

"""Run the Triton kernel tests under Triton's CPU interpreter in a fresh interpreter.

``TRITON_INTERPRET=1`` only takes effect if it is set before ``triton`` is first
imported (``torch`` imports it), so the tests of ``test_kernels_triton.py`` are run
in a subprocess with the variable in its environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU test_kernels_triton.py runs the kernels directly")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already interpreting: runs directly")
def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(HERE / "test_kernels_triton.py")],
        capture_output=True, text=True, env=env, cwd=HERE.parent, timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail.splitlines()[-1], tail

"""Run the Triton kernel tests under Triton's CPU interpreter in fresh interpreters.

``TRITON_INTERPRET=1`` only takes effect if it is set before ``triton`` is first
imported (``torch`` imports it), so the tests of ``test_kernels_triton.py`` are run
in subprocesses with the variable in their environment, one shard per core side by
side (``conftest.run_under_interpreter``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import run_under_interpreter

pytestmark = pytest.mark.slow  # the Triton kernels under the interpreter: minutes of CPU

HERE = Path(__file__).resolve().parent
MODULE = HERE / "test_kernels_triton.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU test_kernels_triton.py runs the kernels directly")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already interpreting: runs directly")
def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter(MODULE)

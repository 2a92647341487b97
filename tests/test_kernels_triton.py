"""Triton kernels vs the float64 reference: outputs, final states, all gradients, decode steps.

On a GPU these run directly. Without one they need Triton's CPU interpreter, which
must be switched on (``TRITON_INTERPRET=1``) before ``triton`` is first imported --
and ``torch`` imports it -- so ``test_triton_kernels_under_interpreter`` (in
``test_kernels_triton_cpu.py``) re-runs this module in a fresh interpreter with the
variable set; collected in a plain CPU run, the tests here skip. Shapes stay small.
Outputs are poisoned with NaN before every launch, so an element a kernel forgets
to write fails the test.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    not (ON_GPU or INTERPRET), reason="needs a GPU or TRITON_INTERPRET=1 (run via test_kernels_triton_cpu.py)"
)

from linearize.kernels import (  # noqa: E402
    empty_window_state,
    linear_attention,
    linear_attention_step,
    window_linear_attention,
    window_linear_attention_step,
    window_state_from_prefill,
)
from linearize.kernels import triton_common  # noqa: E402
from linearize.kernels.testing import check_linear, check_window, linear_inputs, rel_err, window_inputs  # noqa: E402

DEV = "cuda" if ON_GPU else "cpu"


@pytest.fixture(autouse=True)
def _poison():
    triton_common.set_poison(True)
    yield
    triton_common.set_poison(False)


LIN_SHAPES = [
    # B, T, H, Hk, K, V
    (1, 1, 2, 2, 16, 16),
    (1, 63, 4, 2, 16, 32),
    (2, 65, 2, 1, 32, 16),
    (1, 130, 2, 2, 16, 16),
]


@pytest.mark.parametrize("shape", LIN_SHAPES, ids=lambda s: "B{}T{}H{}Hk{}K{}V{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "num"])
def test_linear_triton_vs_reference(shape, dtype, normalize):
    check_linear("triton", *shape, dtype, normalize=normalize, state=shape[1] % 2 == 1, device=DEV)


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "num"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_triton_normaliser_as_products(dtype, normalize, monkeypatch):
    """The forward variant whose normaliser reductions are tensor-core products (CONFIG fwd_norm_mma)."""
    from linearize.kernels import triton_linear

    monkeypatch.setitem(triton_linear.CONFIG, "fwd_norm_mma", True)
    check_linear("triton", 2, 65, 4, 2, 16, 32, dtype, normalize=normalize, state=True, device=DEV)
    monkeypatch.setitem(triton_linear.CONFIG, "force_segments", 3)
    check_linear("triton", 1, 300, 2, 1, 32, 16, dtype, normalize=normalize, state=True, device=DEV)


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "num"])
def test_linear_triton_128_token_chunks(normalize, monkeypatch):
    """Forward and backward with 128-token chunks (CONFIG fwd_bt / bwd_bt), plain and segmented."""
    from linearize.kernels import triton_linear

    monkeypatch.setitem(triton_linear.CONFIG, "fwd_bt", 128)
    monkeypatch.setitem(triton_linear.CONFIG, "bwd_bt", 128)
    check_linear("triton", 2, 200, 4, 2, 16, 32, torch.bfloat16, normalize=normalize, state=True, device=DEV)
    monkeypatch.setitem(triton_linear.CONFIG, "force_segments", 3)
    check_linear("triton", 1, 700, 2, 1, 16, 16, torch.bfloat16, normalize=normalize, state=True, device=DEV)


def test_window_triton_128_token_chunks_for_w64(monkeypatch):
    """W <= 64 with 128-token chunks (CONFIG win_bt): the linear part then also lies inside the chunk."""
    from linearize.kernels import triton_window

    monkeypatch.setitem(triton_window.CONFIG, "win_bt", 128)
    for dtype in (torch.float32, torch.bfloat16):
        check_window("triton", 1, 300, 2, 1, 16, 16, 16, 64, dtype, state=True, device=DEV)
    monkeypatch.setitem(triton_window.CONFIG, "force_segments", 3)
    check_window("triton", 1, 700, 2, 2, 16, 16, 16, 48, torch.bfloat16, state=True, device=DEV)


WIN_SHAPES = [
    # B, T, H, Hk, D, K, V, W
    (1, 1, 2, 2, 16, 16, 16, 64),
    (1, 63, 4, 2, 16, 32, 16, 64),
    (2, 130, 2, 1, 32, 16, 32, 64),
    (1, 150, 4, 2, 16, 16, 16, 16),
    (1, 150, 2, 1, 16, 16, 16, 100),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_triton_normaliser_as_products(dtype, monkeypatch):
    """The window forward variant whose denominator reductions are tensor-core products (fwd_norm_mma)."""
    from linearize.kernels import triton_window

    monkeypatch.setitem(triton_window.CONFIG, "fwd_norm_mma", True)
    check_window("triton", 1, 150, 4, 2, 16, 16, 16, 16, dtype, state=True, device=DEV)
    check_window("triton", 2, 130, 2, 1, 32, 16, 32, 64, dtype, state=True, device=DEV)


@pytest.mark.parametrize("shape", WIN_SHAPES, ids=lambda s: "B{}T{}H{}Hk{}D{}K{}V{}W{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_triton_vs_reference(shape, dtype):
    check_window("triton", *shape, dtype, state=shape[1] % 2 == 0, device=DEV)


def test_linear_triton_continuation_two_halves():
    inp = linear_inputs(1, 140, 4, 2, 16, 16, device=DEV)
    q, k, v = inp["q"], inp["k"], inp["v"]
    o, st = linear_attention(q, k, v, output_final_state=True, backend="triton")
    o1, st1 = linear_attention(q[:, :70], k[:, :70], v[:, :70], output_final_state=True, backend="triton")
    o2, st2 = linear_attention(q[:, 70:], k[:, 70:], v[:, 70:], initial_state=st1, output_final_state=True,
                               backend="triton")
    assert rel_err(torch.cat([o1, o2], 1), o) < 1e-5
    assert rel_err(st2[0], st[0]) < 1e-5 and rel_err(st2[1], st[1]) < 1e-5


def test_window_triton_continuation_prepend():
    W, split = 16, 70
    inp = window_inputs(1, 140, 2, 1, 16, 16, 16, device=DEV)
    xs = [inp[n] for n in ("q", "k", "fq", "fk", "v")]
    wf = inp["window_factor"]
    o, st = window_linear_attention(*xs, wf, window=W, output_final_state=True, backend="triton")
    _, st1 = window_linear_attention(*(x[:, :split] for x in xs), wf, window=W, output_final_state=True,
                                     backend="triton")
    o2, st2 = window_linear_attention(*(x[:, split - W:] for x in xs), wf, window=W, initial_state=st1,
                                      output_final_state=True, backend="triton")
    assert rel_err(o2[:, W:], o[:, split:]) < 1e-5
    assert rel_err(st2[0], st[0]) < 1e-5


@pytest.mark.parametrize("normalize", [True, False])
def test_linear_step_triton(normalize):
    B, T, H, Hk, K, V = 2, 20, 4, 2, 16, 32
    inp = linear_inputs(B, T, H, Hk, K, V, device=DEV)
    q, k, v = inp["q"], inp["k"], inp["v"]
    o_full, st_full = linear_attention(q, k, v, normalize=normalize, output_final_state=True, backend="reference")
    _, state = linear_attention(q[:, :7], k[:, :7], v[:, :7], normalize=normalize, output_final_state=True,
                                backend="triton")
    out = torch.full((B, H, V), float("nan"), device=DEV)
    outs = []
    for t in range(7, T):
        outs.append(linear_attention_step(q[:, t], k[:, t], v[:, t], state, normalize=normalize, out=out,
                                          backend="triton").clone())
    assert rel_err(torch.stack(outs, 1), o_full[:, 7:]) < 1e-5
    assert rel_err(state[0], st_full[0]) < 1e-5 and rel_err(state[1], st_full[1]) < 1e-5


@pytest.mark.parametrize("prefill,W", [(0, 8), (5, 8), (13, 8), (3, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_step_triton(prefill, W, dtype):
    B, T, H, Hk, D, K, V = 2, 24, 4, 2, 16, 16, 32
    inp = window_inputs(B, T, H, Hk, D, K, V, dtype=dtype, device=DEV)
    q, k, fq, fk, v = (inp[n] for n in ("q", "k", "fq", "fk", "v"))
    wf = inp["window_factor"]
    o_full, st_full = window_linear_attention(q, k, fq, fk, v, wf, window=W, output_final_state=True,
                                              backend="reference")
    if prefill:
        _, st = window_linear_attention(*(x[:, :prefill] for x in (q, k, fq, fk, v)), wf, window=W,
                                        output_final_state=True, backend="triton")
        state = window_state_from_prefill(k[:, :prefill], fk[:, :prefill], v[:, :prefill], st, W)
    else:
        state = empty_window_state(B, Hk, D, K, V, W, dtype=dtype, device=DEV)
    out = torch.full((B, H, V), float("nan"), dtype=dtype, device=DEV)
    outs = []
    for t in range(prefill, T):
        outs.append(window_linear_attention_step(q[:, t], k[:, t], fq[:, t], fk[:, t], v[:, t], wf, state,
                                                 out=out, backend="triton").clone())
    assert int(state.seen) == T
    assert rel_err(torch.stack(outs, 1), o_full[:, prefill:]) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(state.S, st_full[0]) < 1e-5 and rel_err(state.z, st_full[1]) < 1e-5


@pytest.mark.parametrize("kind", ["linear", "window"])
def test_segment_sums_with_whole_state_tiles(kind, monkeypatch):
    """Segment sums with [128, 128] state tiles (CONFIG seg_block; K = 128 takes two 64-tiles otherwise)."""
    from linearize.kernels import triton_linear, triton_window

    mod = triton_linear if kind == "linear" else triton_window
    monkeypatch.setitem(mod.CONFIG, "force_segments", 3)
    monkeypatch.setitem(mod.CONFIG, "seg_block", 128)
    monkeypatch.setitem(mod.CONFIG, "seg_warps", 8)
    if kind == "linear":
        check_linear("triton", 1, 300, 2, 1, 128, 32, torch.bfloat16, state=True, device=DEV)
    else:
        check_window("triton", 1, 300, 2, 1, 16, 128, 32, 64, torch.bfloat16, state=True, device=DEV)


@pytest.mark.parametrize("kind", ["linear", "window"])
def test_sequence_parallel_segments(kind, monkeypatch):
    """The segment split (used when few heads leave the GPU idle) gives the same result."""
    from linearize.kernels import triton_linear, triton_window

    mod = triton_linear if kind == "linear" else triton_window
    monkeypatch.setitem(mod.CONFIG, "force_segments", 3)
    if kind == "linear":
        check_linear("triton", 1, 300, 2, 1, 16, 16, torch.bfloat16, state=True, device=DEV)
        check_linear("triton", 1, 300, 2, 2, 16, 16, torch.float32, state=False, device=DEV)
    else:
        check_window("triton", 1, 300, 2, 1, 16, 16, 16, 64, torch.bfloat16, state=True, device=DEV)
        check_window("triton", 1, 300, 2, 2, 16, 16, 16, 16, torch.float32, state=False, device=DEV)

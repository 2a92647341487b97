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
    WindowState,
    empty_window_state,
    hedgehog_feature_map,
    hedgehog_features,
    linear_attention_hedgehog,
    linear_attention_reference,
    linear_attention,
    linear_attention_step,
    linear_attention_step_hedgehog,
    rotary_embedding,
    window_linear_attention,
    window_linear_attention_hedgehog,
    window_linear_attention_reference,
    window_linear_attention_step,
    window_linear_attention_step_hedgehog,
    window_state_from_prefill,
)
from linearize.kernels import chunked, triton_common  # noqa: E402
from linearize.kernels.reference import rotary_reference  # noqa: E402
from linearize.kernels.testing import check_left_padding  # noqa: E402
from linearize.kernels.testing import check_linear, check_window, linear_inputs, rel_err, window_inputs  # noqa: E402
from linearize.kernels.testing import check_sink_steps, leaves as leaf_copies  # noqa: E402
from test_kernels_gated import F64 as REF, assert_matches, run_window as run_gated_window, with_decay  # noqa: E402

DEV = "cuda" if ON_GPU else "cpu"


def _dtype_id(v):
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(v) if isinstance(v, torch.dtype) else None


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
def test_linear_triton_normaliser_as_lane_reductions(dtype, normalize, monkeypatch):
    """The forward variant whose normaliser reductions are lane sums (CONFIG fwd_norm_mma off; the default
    computes them as tensor-core products)."""
    from linearize.kernels import triton_linear

    monkeypatch.setitem(triton_linear.CONFIG, "fwd_norm_mma", False)
    check_linear("triton", 2, 65, 4, 2, 16, 32, dtype, normalize=normalize, state=True, device=DEV)
    monkeypatch.setitem(triton_linear.CONFIG, "force_segments", 3)
    check_linear("triton", 1, 300, 2, 1, 32, 16, dtype, normalize=normalize, state=True, device=DEV)


@pytest.mark.parametrize("option,value", [("fwd_norm_split", True), ("fwd_rowsum_lanes", False)])
def test_linear_triton_normaliser_options(option, value, monkeypatch):
    """The tensor-core normaliser's CONFIG options away from their defaults: fwd_norm_split on (q.z also adds q
    times z's 16-bit rounding residual), fwd_rowsum_lanes off (rowsum(A) as a product with ones instead of a
    lane reduction of the accumulator)."""
    from linearize.kernels import triton_linear

    monkeypatch.setitem(triton_linear.CONFIG, option, value)
    check_linear("triton", 2, 130, 4, 2, 32, 32, torch.bfloat16, state=True, device=DEV)
    check_linear("triton", 1, 70, 2, 1, 32, 32, torch.float32, normalize=True, state=True, device=DEV)


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("bv", [64, 128])
def test_linear_forward_launch_shapes_the_tune_sweeps(bv, warps, monkeypatch):
    """Every fwd_bv x fwd_warps the tune sweep tries gives the reference's forward at K = V = 128, plain and
    segmented (on an H200, 4 warps with the tensor-core normaliser gave wrong outputs or an illegal address)."""
    from linearize.kernels import triton_linear

    monkeypatch.setitem(triton_linear.CONFIG, "fwd_bv", bv)
    monkeypatch.setitem(triton_linear.CONFIG, "fwd_warps", warps)
    check_linear("triton", 1, 130, 2, 1, 128, 128, torch.bfloat16, state=True, device=DEV)
    monkeypatch.setitem(triton_linear.CONFIG, "force_segments", 3)
    check_linear("triton", 1, 300, 2, 1, 128, 128, torch.bfloat16, state=True, device=DEV)


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "num"])
def test_linear_triton_64_token_backward_chunks(normalize, monkeypatch):
    """The backward with 64-token chunks (CONFIG bwd_bt; the default is 128), plain and segmented."""
    from linearize.kernels import triton_linear

    monkeypatch.setitem(triton_linear.CONFIG, "bwd_bt", 64)
    check_linear("triton", 2, 200, 4, 2, 16, 32, torch.bfloat16, normalize=normalize, state=True, device=DEV)
    monkeypatch.setitem(triton_linear.CONFIG, "force_segments", 3)
    check_linear("triton", 1, 700, 2, 1, 16, 16, torch.bfloat16, normalize=normalize, state=True, device=DEV)


WIN_SHAPES = [
    # B, T, H, Hk, D, K, V, W
    (1, 1, 2, 2, 16, 16, 16, 64),
    (1, 63, 4, 2, 16, 32, 16, 64),
    (2, 130, 2, 1, 32, 16, 32, 64),
    (1, 150, 4, 2, 16, 16, 16, 16),
    (1, 150, 2, 1, 16, 16, 16, 100),
    (1, 300, 2, 1, 16, 16, 16, 192),  # wide: three 64-token key blocks back, the state lagging three chunks
    (1, 200, 4, 2, 16, 32, 16, 150),  # wide, W not a multiple of the chunk: linear pairs in two key blocks
    (1, 600, 2, 1, 16, 16, 16, 512),  # the default recipe's serving width: eight key blocks back
    (1, 1100, 2, 1, 16, 16, 16, 700),  # past 512 (as a 2K serving window): eleven key blocks back
]


# under the interpreter the two widest shapes (its two slowest cases, 18 and 11 s on one core) run in one dtype
# apiece: the serving default (W = 512) in bf16, where the wide forward rounds its softmax weights, and W = 700 in
# fp32; a GPU runs both in both
WIN_CASES = [(s, d) for s in WIN_SHAPES for d in (torch.float32, torch.bfloat16)
             if ON_GPU or s[-1] < 512 or (d == torch.bfloat16) == (s[-1] == 512)]


@pytest.mark.parametrize("shape,dtype", WIN_CASES,
                         ids=lambda c: _dtype_id(c) or "B{}T{}H{}Hk{}D{}K{}V{}W{}".format(*c))
def test_window_triton_vs_reference(shape, dtype):
    check_window("triton", *shape, dtype, state=shape[1] % 2 == 0, device=DEV)


@pytest.mark.parametrize("W,dtype,kernel", [
    (100, torch.bfloat16, "_win_fwd_kernel"),  # 128-token chunks
    (100, torch.float32, "_win_softmax_wide_kernel"),  # fp32 128-token chunks are not built: 64-token key blocks
    (300, torch.bfloat16, "_win_softmax_wide_kernel"),
    (2048, torch.float32, "_win_softmax_wide_kernel"),  # a window wider than the sequence: key blocks masked off
    (4100, torch.float32, None),  # wider than MAX_WINDOW (4096, the widest a recipe allows): chunked PyTorch
], ids=["bf16-100", "fp32-100", "bf16-300", "fp32-2048", "fp32-4100"])
def test_window_over_64_kernel_choice(W, dtype, kernel, monkeypatch):
    """Which kernel a window wider than one 64-token chunk launches (none: the chunked PyTorch path), and that
    its forward matches the float64 reference."""
    from linearize.kernels import triton_window
    from linearize.kernels.testing import F64, TOL

    launched = []
    real = triton_window.launch
    monkeypatch.setattr(triton_window, "launch",
                        lambda fn, *a, **kw: launched.append(fn.__name__) or real(fn, *a, **kw))
    inp = window_inputs(1, 150, 2, 1, 16, 16, 16, dtype=dtype, device=DEV)
    args = [inp[n] for n in ("q", "k", "fq", "fk", "v", "window_factor")]
    with torch.no_grad():
        o, _ = window_linear_attention(*args, window=W, backend="triton")
    ro, _ = window_linear_attention(*(a.to(F64) for a in args), window=W, backend="reference")
    assert (kernel in launched) if kernel else not launched, launched
    assert rel_err(o, ro) <= TOL[dtype]


# bf16 on a GPU only: under the interpreter test_window_triton_vs_reference covers both dtypes of these shapes
@pytest.mark.parametrize("shape", WIN_SHAPES[:4], ids=lambda s: "B{}T{}H{}Hk{}D{}K{}V{}W{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32], ids=_dtype_id)
@pytest.mark.parametrize("two_pass", [False, True], ids=["one-pass", "two-pass"])
def test_window_forward_passes(shape, dtype, two_pass, monkeypatch):
    """Both window forwards, whichever CONFIG fwd_two_pass picks: the single fused pass, and the two-pass one
    (the default for W <= 64: the plain forward on keys and values shifted by W, then the chunk-parallel
    softmax-window kernel); outputs, final state and every gradient as the reference, segmented launches too."""
    from linearize.kernels import triton_linear, triton_window

    launched = []
    real = triton_window._fwd_two_pass
    monkeypatch.setattr(triton_window, "_fwd_two_pass", lambda *a: launched.append(1) or real(*a))
    monkeypatch.setitem(triton_window.CONFIG, "fwd_two_pass", two_pass)
    check_window("triton", *shape, dtype, state=True, device=DEV)
    assert bool(launched) == two_pass
    if shape[-1] == 64:  # W = one chunk: segmented launches too (the shifted forward's segment sums lag a chunk)
        monkeypatch.setitem(triton_window.CONFIG, "force_segments", 3)
        monkeypatch.setitem(triton_linear.CONFIG, "force_segments", 3)
        n = len(launched)
        check_window("triton", 1, 300, 2, 1, 16, 32, 16, 64, dtype, state=True, device=DEV)
        assert len(launched) == n + two_pass
        # a wide window (always two-pass): the shifted forward's segment sums lag W / 64 chunks
        check_window("triton", 1, 400, 2, 1, 16, 32, 16, 128 if dtype == torch.float32 else 192, dtype, state=True,
                     device=DEV)
        assert len(launched) == n + two_pass + 1
        monkeypatch.setitem(triton_window.CONFIG, "force_segments", None)
        monkeypatch.setitem(triton_linear.CONFIG, "force_segments", None)
    if not two_pass:
        return
    # the shifted plain forward alone: query t sees keys j <= t - W and the initial state
    inp = linear_inputs(2, 150, 4, 2, 16, 32, dtype=dtype, device=DEV, state=True)
    W = 40
    o, den, S, z = triton_linear._fwd(inp["q"], inp["k"], inp["v"], *inp["initial_state"], True, 1e-30, True, True,
                                      shift=W)
    pad = lambda x: torch.cat([torch.zeros_like(x[:, :W]), x[:, :-W]], 1)  # noqa: E731
    d = lambda x: x.double()  # noqa: E731
    ro, (rS, rz) = linear_attention_reference(d(inp["q"]), pad(d(inp["k"])), pad(d(inp["v"])), eps=1e-30,
                                              initial_state=tuple(map(d, inp["initial_state"])),
                                              output_final_state=True)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(o, ro) <= tol and rel_err(S, rS) <= tol and rel_err(z, rz) <= tol


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


# gated window hybrid (log_decay): the single-pass forward and the backward with decays; the real shapes (head
# size 128, long sequences, W = 128 in 128-token chunks) only on a GPU (minutes each under the interpreter)
GATED_WIN_SHAPES = [
    # B, T, H, Hk, D, K, V, W
    (1, 1, 2, 2, 16, 16, 16, 64),
    (1, 63, 4, 2, 16, 16, 32, 64),
    (2, 65, 4, 2, 16, 32, 16, 16),
    (1, 130, 2, 1, 16, 16, 16, 64),
] + ([(2, 2048, 8, 2, 128, 128, 128, 64), (1, 4096, 4, 4, 128, 128, 128, 128)] if ON_GPU else [])


@pytest.mark.parametrize("shape", GATED_WIN_SHAPES, ids=lambda s: "B{}T{}H{}Hk{}D{}K{}V{}W{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_gated_triton_vs_reference(shape, dtype, monkeypatch):
    """Outputs, final state and every gradient (``log_decay``'s too) against the float64 reference; the chunked
    path must not run (fp32 with W = 128 is the chunked path's by design)."""
    B, T, H, Hk, D, K, V, W = shape
    if not (dtype == torch.float32 and W > 64):
        monkeypatch.setattr(chunked, "window_linear_attention_chunked", None)  # a fallback would fail loudly
    inp = with_decay(window_inputs(B, T, H, Hk, D, K, V, dtype=dtype, state=T % 2 == 1, seed=T, device=DEV), B, T,
                     Hk, seed=T, low=-2.0 / W)  # the part older than the window keeps a visible weight
    skip = ("window_factor",) if T <= W and T % 2 == 0 else ()  # ~0 without a linear term (rounding only)
    # the interpreter truncates fp32 -> bf16 casts, a bias that adds up over the rows of the window factor's
    # gradient: at T = 130 its error is 0.36 with or without decay (ungated: of a gradient twice as large)
    tol_wf = 0.1 if INTERPRET and dtype == torch.bfloat16 else None
    assert_matches(run_gated_window("triton", inp, window=W), run_gated_window("reference", inp, window=W, dtype=REF),
                   dtype, skip=skip, tol_g={torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype], tol_wf=tol_wf)


def test_window_gated_triton_continuation_and_strong_decay():
    """The second part with the previous W tokens prepended and the first part's state == one whole; log decays
    around -5 stay finite and match the chunked path."""
    W, split, T = 16, 70, 140
    inp = with_decay(window_inputs(1, T, 2, 1, 16, 16, 16, device=DEV), 1, T, 1, seed=1, low=-0.1)
    xs = [inp[n] for n in ("q", "k", "fq", "fk", "v", "log_decay")]
    wf = inp["window_factor"]

    def call(lo, hi, state, backend="triton", ld=None):
        *args, lg = (x[:, lo:hi] for x in xs)
        return window_linear_attention(*args, wf, window=W, initial_state=state, output_final_state=True,
                                       backend=backend, log_decay=lg if ld is None else ld[:, lo:hi])

    o, st = call(0, T, None)
    _, st1 = call(0, split, None)
    o2, st2 = call(split - W, T, st1)
    assert rel_err(o2[:, W:], o[:, split:]) < 1e-5
    assert rel_err(st2[0], st[0]) < 1e-5 and rel_err(st2[1], st[1]) < 1e-5
    strong = xs[-1] * 50 - 2.5  # log decays in [-7.5, -2.5]
    o, st = call(0, T, None, ld=strong)
    o_ref, st_ref = call(0, T, None, backend="torch", ld=strong)
    assert torch.isfinite(o).all() and rel_err(o, o_ref) < 1e-5 and rel_err(st[0], st_ref[0]) < 1e-5


def _launch(monkeypatch, **config):
    """Set decode-step launch choices for one test; the batch-1 rule is off, so a GPU runs the heads asked for."""
    from linearize.kernels import triton_step

    for key, value in {"small_grid_heads_per_sm": 0, **config}.items():
        monkeypatch.setitem(triton_step.CONFIG, key, value)


@pytest.mark.parametrize("normalize,bv,heads,H", [(True, 0, 0, 4), (False, 0, 0, 4), (True, 16, 0, 4),
                                                   (True, 0, 1, 4), (False, 16, 2, 6)])
def test_linear_step_triton(normalize, bv, heads, H, monkeypatch):
    """Decode steps after a prefill as the reference; bv = 16: two value blocks per (batch, KV head), z added by
    the second kernel; heads = 1: the KV group's two query heads in two programs, the second kernel adding k v^T
    to S; heads = 2 with H = 6: groups of three in programs of two and one."""
    _launch(monkeypatch, step_bv=bv, linear_step_heads=heads, unfused_linear_step_split_min_group=0)
    B, T, Hk, K, V = 2, 20, 2, 16, 32
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


WINDOW_STEP_CASES = [(0, 8, 0, 0, 4), (5, 8, 16, 0, 4), (13, 8, 0, 0, 4), (3, 16, 16, 0, 4), (5, 8, 16, 1, 4),
                     (13, 8, 0, 1, 4), (5, 8, 16, 2, 6), (13, 8, 0, 2, 6)]


def step_matrix(cases: list[tuple], bf16_keep: list[tuple]) -> list[tuple]:
    """Decode-step test cases: on a GPU every case in fp32 and bf16; under the interpreter (each decode step a
    launch of seconds) every case in fp32 and only ``bf16_keep`` in bf16. ``cases`` without their dtype."""
    keep = cases if ON_GPU else bf16_keep
    return [c + (torch.float32,) for c in cases] + [c + (torch.bfloat16,) for c in keep]


# every launch shape with both ring walks (the whole ring at once, or ring blocks as 512-row rings run); under the
# interpreter every shape with ring blocks and one case per head split with the whole ring, and in bf16 one case per
# head split with ring blocks
@pytest.mark.parametrize("prefill,W,bv,heads,H,ring,dtype", step_matrix(
    [c + (ring,) for c in WINDOW_STEP_CASES for ring in (0, 4)
     if ON_GPU or ring or c in [WINDOW_STEP_CASES[i] for i in (0, 5, 7)]],
    [WINDOW_STEP_CASES[i] + (4,) for i in (1, 5, 7)]), ids=_dtype_id)
def test_window_step_triton(prefill, W, bv, heads, H, ring, dtype, monkeypatch):
    """Decode steps after a prefill (or none) as the reference's full forward; bv = 16: two value blocks per
    (batch, KV head), whose programs share z and the key rings; heads = 1: each of the KV group's two query heads
    in its own program, the commit kernel folding S and writing the value ring; heads = 2 with H = 6: groups of
    three heads in two programs, the second answering one head; ring = 4: each head walks the rings four rows at
    a time (two or four blocks), as 512-row rings do by default."""
    _launch(monkeypatch, step_bv=bv, step_heads=heads, step_ring_block=ring, step_ring_block_from=ring and 8)
    # under the interpreter (each step a launch of a second) four steps once the ring has wrapped
    _check_window_steps(24 if ON_GPU else min(24, prefill + W + 4), H, W, prefill, dtype)


def _check_window_steps(T: int, H: int, W: int, prefill: int, dtype, seed: int = 0) -> None:
    """Triton decode steps from ``prefill`` (a Triton prefill's state, or an empty one) to ``T`` equal the
    reference's full forward (outputs, S, z); B = 2, two KV heads, D = K = 16, V = 32."""
    B, Hk, D, K, V = 2, 2, 16, 16, 32
    inp = window_inputs(B, T, H, Hk, D, K, V, dtype=dtype, device=DEV, seed=seed)
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
    outs = [window_linear_attention_step(q[:, t], k[:, t], fq[:, t], fk[:, t], v[:, t], wf, state, out=out,
                                         backend="triton").clone() for t in range(prefill, T)]
    assert int(state.seen) == T
    assert rel_err(torch.stack(outs, 1), o_full[:, prefill:]) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(state.S, st_full[0]) < 1e-5 and rel_err(state.z, st_full[1]) < 1e-5


@pytest.mark.parametrize("prefill,heads,H,part16,dtype",
                         step_matrix([(0, 0, 4, 1), (42, 0, 4, 1), (45, 1, 6, 1)], [(42, 0, 4, 1), (42, 0, 4, 0)]),
                         ids=_dtype_id)
def test_window_step_ring_split_triton(prefill, heads, H, part16, dtype, monkeypatch):
    """A 40-token ring walked in parts of 16 rows (the last one 8, then padding), each part once for all of a KV
    group's query heads, the step kernel merging the parts' softmax sums: decode steps as the reference's full
    forward before the ring fills (prefill 0) and after it wraps, the state too; heads = 1 with H = 6: each of a
    group's three heads in its own program (the commit kernel folding S), merging the same parts. bf16 rings: the
    parts' products on 16-bit operands (``part16``) and in exact fp32."""
    from linearize.kernels import triton_step

    _launch(monkeypatch, step_ring_split=16, step_ring_split_from=8, step_heads=heads,
            step_ring_part_16bit=part16)
    assert triton_step.ring_split(64) == 16 and triton_step.ring_split(4) == 0
    _check_window_steps(prefill + 6, H, 40, prefill, dtype, seed=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_step_at_the_default_width(dtype):
    """The default recipe's 512-token window: a prefill longer than the window, then decode steps whose ring (eight
    64-row blocks) hands its oldest token to the linear state each step, as the reference's full forward."""
    B, T, H, Hk, D, K, V, W, prefill = 1, 530, 2, 1, 16, 16, 16, 512, 520
    inp = window_inputs(B, T, H, Hk, D, K, V, dtype=dtype, device=DEV)
    q, k, fq, fk, v = (inp[n] for n in ("q", "k", "fq", "fk", "v"))
    wf = inp["window_factor"]
    o_full, st_full = window_linear_attention(q, k, fq, fk, v, wf, window=W, output_final_state=True,
                                              backend="reference")
    _, st = window_linear_attention(*(x[:, :prefill] for x in (q, k, fq, fk, v)), wf, window=W,
                                    output_final_state=True, backend="triton")
    state = window_state_from_prefill(k[:, :prefill], fk[:, :prefill], v[:, :prefill], st, W)
    out = torch.full((B, H, V), float("nan"), dtype=dtype, device=DEV)
    outs = [window_linear_attention_step(q[:, t], k[:, t], fq[:, t], fk[:, t], v[:, t], wf, state, out=out,
                                         backend="triton").clone() for t in range(prefill, T)]
    assert int(state.seen) == T
    assert rel_err(torch.stack(outs, 1), o_full[:, prefill:]) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(state.S, st_full[0]) < 1e-5 and rel_err(state.z, st_full[1]) < 1e-5


@pytest.mark.parametrize("kind", ["linear", "window"])
@pytest.mark.parametrize("T,pad,W,dtype", [(40, 13, 8, torch.float32), (12, 7, 8, torch.float32),
                                           (20, 9, 16, torch.bfloat16), (200, 21, 130, torch.float32)])
def test_left_padding_triton(kind, T, pad, W, dtype):
    """Left padding on the Triton backend (a window key mask runs the chunked path) and the Triton decode steps,
    whose window kernels leave ring slots that hold padding out: each row as its unpadded sequence."""
    check_left_padding(kind, "triton", step_backend="triton", T=T, pad=pad, W=W, dtype=dtype, device=DEV)


@pytest.mark.parametrize("T,W,dtype,state", [(150, 8, torch.float32, True), (130, 64, torch.bfloat16, False),
                                              (1, 64, torch.float32, False), (70, 16, torch.bfloat16, True),
                                              (260, 150, torch.bfloat16, True)])
def test_window_key_mask_triton_forward(T, W, dtype, state):
    """Any padding pattern, no gradient: the Triton two-pass forward with the mask in its window kernel matches
    the float64 reference (outputs and final state); with a gradient the chunked path answers (same check)."""
    from linearize.kernels.testing import F64, TOL, random_key_mask

    inp = window_inputs(2, T, 4, 2, 16, 16, 32, dtype=dtype, device=DEV, state=state, seed=T)
    km = random_key_mask(2, T, seed=T, device=DEV)
    args = [inp[n] for n in ("q", "k", "fq", "fk", "v", "window_factor")]
    init = inp.get("initial_state")
    ref, ref_st = window_linear_attention(*(a.to(F64) for a in args), window=W, initial_state=init,
                                          output_final_state=True, backend="reference", key_mask=km)
    with torch.no_grad():
        o, st = window_linear_attention(*args, window=W, initial_state=init, output_final_state=True,
                                        backend="triton", key_mask=km)
    assert rel_err(o, ref) <= TOL[dtype] and rel_err(st[0], ref_st[0]) <= TOL[dtype]
    check_window("triton", 2, T, 4, 2, 16, 16, 32, W, dtype, state=state, masked=True, device=DEV)


@pytest.mark.parametrize("kind", ["linear", "window"])
@pytest.mark.parametrize("tile", [64, 128])
def test_segment_sums_over_several_state_tiles(kind, tile, monkeypatch):
    """Segment sums where K = 128 spans two [64, 64] state tiles of a summing program (or one [128, 128]
    tile: CONFIG seg_bk / seg_bv) and V = 32 part of one."""
    from linearize.kernels import triton_linear, triton_window

    mod = triton_linear if kind == "linear" else triton_window
    monkeypatch.setitem(mod.CONFIG, "force_segments", 3)
    monkeypatch.setitem(mod.CONFIG, "seg_warps", 8)
    monkeypatch.setitem(mod.CONFIG, "seg_bk", tile)
    monkeypatch.setitem(mod.CONFIG, "seg_bv", tile)
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


HH_SHAPES = [
    # B, T, H, Hk, D, f, V, W
    (1, 1, 2, 2, 16, 8, 16, 64),
    (1, 65, 2, 1, 16, 8, 16, 64),  # GQA, T just past one chunk
    (2, 130, 4, 2, 32, 16, 32, 16),  # W < chunk: the linear part also inside the chunk
    (1, 100, 2, 2, 16, 12, 16, 100),  # f = 12: 24 features padded to a 32-wide tile; 128-token chunks
    (1, 230, 2, 1, 16, 8, 16, 192),  # wide: the two-pass forward whatever CONFIG says
]


def test_window_step_launch_shape():
    """Value blocks and warps of the window step at the Llama-3-8B shape on an H200-sized GPU (132 SMs): 64
    (batch, KV head) pairs split into blocks of 64 with 4 warps; 128 pairs stay whole, with 16 warps (4 would
    spill there); with query heads split, the blocks that were fastest at batch 8, and one head per program at
    batch 1 (H200, 2026-12-01)."""
    from unittest import mock

    from linearize.kernels import triton_step

    cuda = torch.device("cuda", 0)
    with mock.patch.object(triton_step, "num_sms", lambda device: 132):
        assert triton_step.step_value_block(64, 128, cuda, triton_step.CONFIG["step_waves"]) == 64
        assert triton_step.step_value_block(128, 128, cuda, triton_step.CONFIG["step_waves"]) == 128
        assert triton_step.step_value_block(8, 128, cuda, triton_step.CONFIG["step_waves"]) == 16
        assert triton_step.step_value_block(64, 128, cuda, 0.0) == 128  # 0 waves: one program per pair
        # query heads split two per program (the default): blocks chosen for pairs x head groups, at most 64
        for pairs, G in ((64, 4), (32, 8), (32, 7)):  # Llama-3-8B, Qwen3-30B-A3B, Qwen2.5-7B at batch 8
            assert triton_step.window_step_tiles(pairs, G, 128, cuda) == (2, 64)
        # batch 1 (32 query heads on 132 SMs): one head per program, value blocks of 32 (128 programs)
        assert triton_step.window_step_tiles(8, 4, 128, cuda) == (1, 32)
        assert triton_step.linear_step_tiles(4, 8, 128, cuda, fuse=True) == (1, 32)
        assert triton_step.linear_step_tiles(32, 8, 128, cuda, fuse=True) == (2, 64)  # Qwen3-30B-A3B, batch 8
        # fed precomputed features (elu): groups of 4 stay whole (Llama-3-8B, batch 8 and 1), groups of 8 split
        assert triton_step.linear_step_tiles(64, 4, 128, cuda, fuse=False) == (4, 64)
        assert triton_step.linear_step_tiles(8, 4, 128, cuda, fuse=False) == (4, 16)
        assert triton_step.linear_step_tiles(32, 8, 128, cuda, fuse=False) == (2, 64)
        assert triton_step.linear_step_tiles(4, 8, 128, cuda, fuse=False) == (1, 32)
        with mock.patch.dict(triton_step.CONFIG, small_grid_heads_per_sm=0):
            assert triton_step.window_step_tiles(8, 4, 128, cuda) == (2, 16)
    assert triton_step.step_value_block(64, 128, torch.device("cpu"), 1.0) == 128
    assert triton_step.window_step_warps(128, 128, 64, 64, True) == 4
    assert triton_step.window_step_warps(128, 128, 128, 64, True) == 16


@pytest.mark.parametrize("Hk,bv,heads,dtype", step_matrix([(2, 0, 0), (1, 16, 0), (1, 16, 2), (1, 0, 3)],
                                                           [(1, 16, 2)]), ids=_dtype_id)
def test_window_step_with_hedgehog_features_in_the_kernel(Hk, bv, heads, dtype, monkeypatch):
    """The decode step that computes the Hedgehog features itself matches the step fed the layer's features
    (outputs, S, z, rings), across the fold of tokens leaving the window, and one forward over the sequence;
    bv = 16: two value blocks per (batch, KV head); heads = 2: the four query heads of a KV group in two
    programs (both steps); heads = 3: in programs of three and one."""
    _launch(monkeypatch, step_bv=bv, step_heads=heads)
    B, T, H, D, f, V, W, prefill = 2, 18, 4, 32, 16, 32, 8, 5  # 13 steps, 10 past the window's fold
    q, k, v, wf, wq, wk, _ = _hedgehog_case(B, T, H, Hk, D, f, V, W, dtype, state=False, seed=3)
    fq, fk = (hedgehog_features(x.float(), w.float()).to(dtype) for x, w in ((q, wq), (k, wk)))
    o_full = window_linear_attention(q, k, fq, fk, v, wf, window=W, backend="reference")[0]
    _, st = window_linear_attention(q[:, :prefill], k[:, :prefill], fq[:, :prefill], fk[:, :prefill], v[:, :prefill],
                                    wf, window=W, output_final_state=True, backend="triton")
    fused = window_state_from_prefill(k[:, :prefill], fk[:, :prefill], v[:, :prefill], st, W)
    plain = WindowState(*(x.clone() for x in fused))
    signed = triton_common.signed_projections(wq, wk, dtype)
    outs, ref = [], []
    for t in range(prefill, T):
        outs.append(window_linear_attention_step_hedgehog(q[:, t], k[:, t], v[:, t], wf, wq, wk, fused,
                                                          backend="triton", signed=signed if t % 2 else None).clone())
        ref.append(window_linear_attention_step(q[:, t], k[:, t], fq[:, t], fk[:, t], v[:, t], wf, plain,
                                                backend="triton").clone())
    # bf16: the interpreter truncates fp32 -> bf16 casts (README), so in-kernel features are ~0.2% off there
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(torch.stack(outs, 1), torch.stack(ref, 1)) < tol
    assert rel_err(torch.stack(outs, 1), o_full[:, prefill:]) < (2e-5 if dtype == torch.float32 else 2e-2)
    for name, a, b in zip(WindowState._fields, fused, plain):
        assert rel_err(a.float(), b.float()) < tol, name
    # the other backends compute the features first: the same step as the plain one
    again = WindowState(*(x.clone() for x in window_state_from_prefill(k[:, :prefill], fk[:, :prefill],
                                                                     v[:, :prefill], st, W)))
    o = window_linear_attention_step_hedgehog(q[:, prefill], k[:, prefill], v[:, prefill], wf, wq, wk, again,
                                              backend="torch")
    assert rel_err(o, ref[0]) < tol


@pytest.mark.parametrize("normalize,bv,heads", [(True, 0, 0), (False, 0, 0), (True, 16, 0), (True, 0, 1)],
                         ids=["norm", "num", "norm-split", "norm-heads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_step_with_hedgehog_features_in_the_kernel(dtype, normalize, bv, heads, monkeypatch):
    """The plain linear decode step computing the Hedgehog features itself: as the step fed the layer's features
    (outputs and state) and as one forward over the sequence; GQA; split: two value blocks per (batch, KV head)
    (the second kernel computes the key features again for z); heads: one query head per program (the second
    kernel adds k v^T to S with its own key features)."""
    _launch(monkeypatch, step_bv=bv, linear_step_heads=heads)
    B, T, H, Hk, D, f, V, prefill = 2, 12, 4, 2, 32, 16, 32, 3
    q, k, v, _, wq, wk, _ = _hedgehog_case(B, T, H, Hk, D, f, V, 64, dtype, state=False, seed=4)
    fq, fk = (hedgehog_features(x.float(), w.float()).to(dtype) for x, w in ((q, wq), (k, wk)))
    o_full = linear_attention(fq, fk, v, normalize=normalize, backend="reference")[0]
    _, st = linear_attention(fq[:, :prefill], fk[:, :prefill], v[:, :prefill], normalize=normalize,
                             output_final_state=True, backend="triton")
    fused, plain = (tuple(x.clone() for x in st) for _ in range(2))
    outs, ref = [], []
    for t in range(prefill, T):
        outs.append(linear_attention_step_hedgehog(q[:, t], k[:, t], v[:, t], wq, wk, fused, normalize=normalize,
                                                   backend="triton").clone())
        ref.append(linear_attention_step(fq[:, t], fk[:, t], v[:, t], plain, normalize=normalize,
                                         backend="triton").clone())
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the interpreter truncates in-kernel casts (README)
    assert rel_err(torch.stack(outs, 1), torch.stack(ref, 1)) < tol
    assert rel_err(torch.stack(outs, 1), o_full[:, prefill:]) < tol
    assert rel_err(fused[0], plain[0]) < tol and rel_err(fused[1], plain[1]) < tol


@pytest.mark.parametrize("bv", [0, 128], ids=["auto", "whole"])
def test_linear_step_hedgehog_full_width(bv, monkeypatch):
    """Llama-sized heads (D 128, f 64 so K 128, V 128), bf16: the step computing the features matches the step
    fed them. On an H200 one 128-wide value block with 8+ warps was 8e-3 off (the q features), so the fused step
    never takes a block wider than ``FUSED_LINEAR_STEP_MAX_BV`` (``whole`` asks for 128)."""
    from linearize.kernels import triton_step

    monkeypatch.setitem(triton_step.CONFIG, "step_bv", bv)
    B, T, H, Hk, D, f, V = 1, 3, 2, 1, 128, 64, 128
    q, k, v, _, wq, wk, init = _hedgehog_case(B, T, H, Hk, D, f, V, 64, torch.bfloat16, state=True, seed=5)
    wq, wk = 0.25 * wq, 0.25 * wk
    fq, fk = (hedgehog_features(x.float(), w.float()).bfloat16() for x, w in ((q, wq), (k, wk)))
    fused, plain = (tuple(x.clone() for x in init) for _ in range(2))
    tol = 2e-2 if DEV == "cpu" else 1e-3  # the interpreter truncates in-kernel casts (README)
    for t in range(T):
        a = linear_attention_step_hedgehog(q[:, t], k[:, t], v[:, t], wq, wk, fused, backend="triton")
        b = linear_attention_step(fq[:, t], fk[:, t], v[:, t], plain, backend="triton")
        assert rel_err(a, b) < tol, t
    assert rel_err(fused[0], plain[0]) < tol and rel_err(fused[1], plain[1]) < tol


def _hedgehog_case(B, T, H, Hk, D, f, V, W, dtype, *, state, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, h, D, generator=g).to(DEV, dtype) for h in (H, Hk))
    v = torch.randn(B, T, Hk, V, generator=g).to(DEV, dtype)
    wq, wk = (0.4 * torch.randn(h, D, f, generator=g).to(DEV, dtype) for h in (H, Hk))
    wf = torch.rand(H, generator=g).to(DEV)
    init = None
    if state:
        init = (torch.rand(B, Hk, 2 * f, V, generator=g).to(DEV) - 0.3, torch.rand(B, Hk, 2 * f, generator=g).to(DEV) + 1)
    return q, k, v, wf, wq, wk, init


def _hedgehog_expected(q, k, v, wf, wq, wk, init, W):
    """float64 reference on the features the unfused layer would compute (fp32, rounded to the input dtype)."""
    fq = hedgehog_features(q.float(), wq.float()).to(q.dtype)
    fk = hedgehog_features(k.float(), wk.float()).to(k.dtype)
    d = lambda x: x.double()  # noqa: E731
    return fk, window_linear_attention_reference(
        d(q), d(k), d(fq), d(fk), d(v), d(wf), window=W, output_final_state=True,
        initial_state=None if init is None else (d(init[0]), d(init[1])))


def _linear_hedgehog_expected(q, k, v, wq, wk, init, normalize=True):
    """float64 reference of plain linear attention on the features the unfused layer would compute, with its final
    state."""
    fq, fk = (hedgehog_features(x.float(), w.float()).to(x.dtype).double() for x, w in ((q, wq), (k, wk)))
    init64 = None if init is None else (init[0].double(), init[1].double())
    return linear_attention_reference(fq, fk, v.double(), normalize=normalize, initial_state=init64,
                                      output_final_state=True)


HH_CASES = [(shape, two) for shape in HH_SHAPES for two in (False, True) if shape[-1] <= 64 or not two]


@pytest.mark.parametrize("shape,two_pass", HH_CASES, ids=lambda c: "B{}T{}H{}Hk{}D{}f{}V{}W{}".format(*c)
                         if isinstance(c, tuple) else ("two-pass" if c else "one-pass"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_hedgehog_fused_forward_vs_reference(shape, dtype, two_pass, monkeypatch):
    """Hedgehog maps computed inside the window forward kernel (or, two-pass, inside its shifted linear forward):
    outputs and final state as the float64 reference on the layer's own features, with key features fused or
    given, with and without a state."""
    from linearize.kernels import triton_window

    W = shape[-1]  # the two-pass forward covers W <= 64 and the wide windows
    monkeypatch.setitem(triton_window.CONFIG, "fwd_two_pass", two_pass)
    launched = []
    real = triton_window._fwd_two_pass
    monkeypatch.setattr(triton_window, "_fwd_two_pass", lambda *a: launched.append(1) or real(*a))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for state, give_fk in ((False, False), (True, False), (True, True)):
        q, k, v, wf, wq, wk, init = _hedgehog_case(*shape, dtype, state=state)
        fk, (ro, (rS, rz)) = _hedgehog_expected(q, k, v, wf, wq, wk, init, W)
        with torch.no_grad():
            o, (S, z) = window_linear_attention_hedgehog(q, k, v, wf, wq, wk, fk=fk if give_fk else None, window=W,
                                                         initial_state=init, output_final_state=True,
                                                         backend="triton")
        assert o.dtype == dtype and o.shape == ro.shape
        assert rel_err(o, ro) <= tol, (state, give_fk, rel_err(o, ro))
        if shape[1] > W or state:
            assert rel_err(S, rS) <= tol and rel_err(z, rz) <= tol
    assert bool(launched) == (two_pass or triton_window.wide(W, dtype))


def test_window_hedgehog_fused_forward_segmented(monkeypatch):
    """A segmented launch (long T, few heads) materialises the key features for its segment sums."""
    from linearize.kernels import triton_window

    monkeypatch.setitem(triton_window.CONFIG, "force_segments", 3)
    for shape in [(1, 300, 2, 1, 16, 8, 16, 64), (1, 300, 2, 2, 16, 8, 16, 16)]:
        q, k, v, wf, wq, wk, init = _hedgehog_case(*shape, torch.bfloat16, state=True)
        _, (ro, (rS, _)) = _hedgehog_expected(q, k, v, wf, wq, wk, init, shape[-1])
        o, (S, _) = window_linear_attention_hedgehog(q, k, v, wf, wq, wk, window=shape[-1], initial_state=init,
                                                     output_final_state=True, backend="triton")
        assert rel_err(o, ro) <= 1e-2 and rel_err(S, rS) <= 1e-2


def test_window_hedgehog_with_gradients_runs_unfused():
    """When autograd needs the graph, the call computes the features first: gradients reach q, k and both maps."""
    q, k, v, wf, wq, wk, _ = _hedgehog_case(1, 70, 2, 1, 16, 8, 16, 64, torch.float32, state=False)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, wq, wk)]
    o, _ = window_linear_attention_hedgehog(leaves[0], leaves[1], leaves[2], wf, leaves[3], leaves[4], window=64,
                                            backend="triton")
    o.square().sum().backward()
    ref = [x.clone().requires_grad_() for x in (q, k, v, wq, wk)]
    fq, fk = hedgehog_features(ref[0], ref[3]), hedgehog_features(ref[1], ref[4])
    ro, _ = window_linear_attention(ref[0], ref[1], fq, fk, ref[2], wf, window=64, backend="torch")
    ro.square().sum().backward()
    assert rel_err(o, ro) <= 1e-5
    for a, b in zip(leaves, ref):
        assert rel_err(a.grad, b.grad) <= 1e-4


# under the interpreter "all" and the window's "maps" cover every kernel the other cases launch (their decode steps
# are the fused steps that "decode" runs alone)
@pytest.mark.parametrize("window,mode", [(w, m) for w in (8, 0) for m in ("all", "maps", "decode")
                                         if ON_GPU or m == "all" or (w, m) == (8, "maps")])
def test_hybrid_layers_with_fused_features_match_unfused(monkeypatch, window, mode):
    """Layers whose Triton kernels compute the Hedgehog features (GPU inference; window and plain linear, prefill
    and decode steps, or decode steps only after a prefill whose features come from the standalone map kernel
    or from PyTorch: the default) give the logits of the unfused path: a full forward, prefill + decode through
    the cache, a two-part prefill."""
    import functools

    from conftest import tiny_model

    from linearize.model import attention
    from linearize import recipe as R
    from linearize.convert.selection import select_layout
    from linearize.convert.surgery import linearize_model

    hybrid = linearize_model(tiny_model("llama"), select_layout(4, ratio="1:1"),
                             R.load("lolcats", {"attention.window": window})).to(DEV)
    with torch.no_grad():
        for m in hybrid.linear_modules():
            for p in (m.feature_map_q.weight, m.feature_map_k.weight, m.window_logit):
                if p is not None:
                    p.add_(0.2 * torch.randn_like(p))
    n_steps = 12 if ON_GPU else 4  # under the interpreter each step is two launches of a second
    ids = torch.randint(0, 128, (2, 24 + n_steps), device=DEV)  # a prefill past the window of 8, then the steps

    def run():
        with torch.no_grad():
            full = hybrid(ids, use_cache=False).logits
            out = hybrid(ids[:, :24], use_cache=True)
            steps = [out.logits]
            for t in range(24, 24 + n_steps):
                out = hybrid(ids[:, t: t + 1], cache=out.past_key_values, use_cache=True)
                steps.append(out.logits)
            a = hybrid(ids[:, :15], use_cache=True)
            b = hybrid(ids[:, 15:], cache=a.past_key_values, use_cache=True)
        return full, torch.cat(steps, 1), torch.cat([a.logits, b.logits], 1)

    unfused = run()
    calls = []

    def fused_triton(fn):
        def call(*args, **kw):
            calls.append(kw.get("fk") is None)
            return fn(*args, **kw, backend="triton")
        return call

    monkeypatch.setattr(attention, "window_linear_attention_hedgehog", fused_triton(window_linear_attention_hedgehog))
    monkeypatch.setattr(attention, "linear_attention_hedgehog", fused_triton(linear_attention_hedgehog))
    steps = []

    def fused_step(fn):
        def call(*args, **kw):
            steps.append(kw.get("signed") is not None)
            return fn(*args, **kw, backend="triton")
        return call

    monkeypatch.setattr(attention, "window_linear_attention_step_hedgehog", fused_step(
        window_linear_attention_step_hedgehog))
    monkeypatch.setattr(attention, "linear_attention_step_hedgehog", fused_step(linear_attention_step_hedgehog))
    maps = []

    def map_kernel(x, weight, **kw):
        maps.append(x.shape[1])
        return hedgehog_feature_map(x, weight, **kw)

    monkeypatch.setattr(attention, "hedgehog_feature_map", map_kernel)
    hybrid.set_kernel_options(fused_feature_maps=mode)
    monkeypatch.setattr(attention.LinearAttention, "fused_features",  # as on a GPU, for any device
                        functools.partialmethod(lambda self, q, k, decode: mode == "all" or decode))
    monkeypatch.setattr(attention.LinearAttention, "map_in_kernel",
                        functools.partialmethod(lambda self, fm, x: mode in ("maps", "all")))
    fused = run()
    # the standalone map kernel: every prefill's features with "maps"; with "all", only the window ring's keys
    assert (maps and all(n > 1 for n in maps)) if mode == "maps" else (bool(maps) == (mode == "all" and window > 0))
    if mode != "all":
        assert not calls  # prefill computed the features first
    else:  # window layers: both the fused-key and the given-key (cache ring) launches ran; plain: always fused
        assert (True in calls and False in calls) if window else (calls and all(calls))
    # decode steps compute the features in the step kernel (signed weights kept by the layer)
    assert len(steps) == n_steps * 2 and all(steps)
    for x, ref in zip(fused, unfused):
        assert (x - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1, 2, 2, 16, 8, 16), (2, 65, 4, 2, 16, 8, 32), (1, 130, 2, 1, 32, 12, 16)],
                         ids=lambda s: "B{}T{}H{}Hk{}D{}f{}V{}".format(*s))
def test_linear_hedgehog_fused_forward_vs_reference(shape, dtype):
    """Plain linear attention with the Hedgehog features computed in the kernel: outputs and final state as
    the float64 reference on the layer's own features, with and without an initial state, both normalisations."""
    B, T, H, Hk, D, f, V = shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    if dtype == torch.bfloat16 and INTERPRET:
        # the interpreter truncates fp32 -> bf16 casts (round-to-nearest on GPUs): features computed in the
        # kernel come out ~0.2% low each, which the unnormalised output shows as a ~1% bias
        tol = 2e-2
    for state in (False, True):
        q, k, v, _, wq, wk, init = _hedgehog_case(B, T, H, Hk, D, f, V, 64, dtype, state=state)
        for normalize in (True, False):
            ro, (rS, rz) = _linear_hedgehog_expected(q, k, v, wq, wk, init, normalize)
            with torch.no_grad():
                o, (S, z) = linear_attention_hedgehog(q, k, v, wq, wk, normalize=normalize, initial_state=init,
                                                      output_final_state=True, backend="triton")
            assert o.dtype == dtype and rel_err(o, ro) <= tol, (state, normalize, rel_err(o, ro))
            assert rel_err(S, rS) <= tol and rel_err(z, rz) <= tol


def test_linear_hedgehog_fused_forward_segmented_and_with_gradients(monkeypatch):
    """A segmented launch reads materialised key features; with gradients the call computes features first."""
    from linearize.kernels import triton_linear

    monkeypatch.setitem(triton_linear.CONFIG, "force_segments", 3)
    q, k, v, _, wq, wk, init = _hedgehog_case(1, 300, 2, 1, 16, 8, 16, 64, torch.bfloat16, state=True)
    ro, (rS, _) = _linear_hedgehog_expected(q, k, v, wq, wk, init)
    o, (S, _) = linear_attention_hedgehog(q, k, v, wq, wk, initial_state=init, output_final_state=True,
                                          backend="triton")
    assert rel_err(o, ro) <= 1e-2 and rel_err(S, rS) <= 1e-2
    monkeypatch.setitem(triton_linear.CONFIG, "force_segments", None)
    q, k, v, _, wq, wk, _ = _hedgehog_case(1, 70, 2, 1, 16, 8, 16, 64, torch.float32, state=False)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, wq, wk)]
    o, _ = linear_attention_hedgehog(*leaves, backend="triton")
    o.square().sum().backward()
    ref = [x.clone().requires_grad_() for x in (q, k, v, wq, wk)]
    ro, _ = linear_attention(hedgehog_features(ref[0], ref[3]), hedgehog_features(ref[1], ref[4]), ref[2],
                             backend="torch")
    ro.square().sum().backward()
    assert rel_err(o, ro) <= 1e-5
    for a, b in zip(leaves, ref):
        assert rel_err(a.grad, b.grad) <= 1e-4


@pytest.mark.parametrize("bt", [16])
def test_forwards_with_narrower_chunks(bt, monkeypatch):
    """CONFIG fwd_bt / fused_bt (the forward's chunk; the fused forwards' default, 32, runs in the other tests):
    the plain and fused forwards, whole and in segments, and the window's two-pass forward, whose shift of W = 64
    is then several chunks (the segment sums lag by as many)."""
    from linearize.kernels import triton_linear, triton_window

    monkeypatch.setitem(triton_linear.CONFIG, "fwd_bt", bt)
    monkeypatch.setitem(triton_linear.CONFIG, "fused_bt", bt)
    monkeypatch.setitem(triton_window.CONFIG, "fwd_two_pass", True)
    for segments in (None, 3):
        monkeypatch.setitem(triton_linear.CONFIG, "force_segments", segments)
        monkeypatch.setitem(triton_window.CONFIG, "force_segments", segments)
        check_linear("triton", 1, 150, 2, 1, 16, 32, torch.bfloat16, state=True, device=DEV)
        check_window("triton", 1, 300, 2, 1, 16, 32, 16, 64, torch.bfloat16, state=True, device=DEV)
        for W in (64, 40):  # a whole number of chunks, and not
            q, k, v, wf, wq, wk, init = _hedgehog_case(1, 200, 2, 1, 16, 8, 16, W, torch.bfloat16, state=True)
            _, (ro, (rS, _)) = _hedgehog_expected(q, k, v, wf, wq, wk, init, W)
            o, (S, _) = window_linear_attention_hedgehog(q, k, v, wf, wq, wk, window=W, initial_state=init,
                                                         output_final_state=True, backend="triton")
            assert rel_err(o, ro) <= 1e-2 and rel_err(S, rS) <= 1e-2, (segments, W)
        ro, (rS, _) = _linear_hedgehog_expected(q, k, v, wq, wk, init)
        o, (S, _) = linear_attention_hedgehog(q, k, v, wq, wk, initial_state=init, output_final_state=True,
                                              backend="triton")
        assert rel_err(o, ro) <= 2e-2 and rel_err(S, rS) <= 2e-2, segments


@pytest.mark.parametrize("kind", ["window", "linear"])
def test_fused_hedgehog_launch_with_its_own_value_block(kind, monkeypatch):
    """CONFIG fused_bv / fused_warps (swept by --tune for the fused forwards): a value block narrower than V
    makes several programs per head, each computing the features itself; the result is the reference's."""
    from linearize.kernels import triton_linear, triton_window

    mod = triton_window if kind == "window" else triton_linear
    monkeypatch.setitem(mod.CONFIG, "fused_bv", 32)
    monkeypatch.setitem(mod.CONFIG, "fused_warps", 2)
    q, k, v, wf, wq, wk, init = _hedgehog_case(2, 130, 4, 2, 32, 16, 64, 16, torch.float32, state=True)
    with torch.no_grad():
        if kind == "window":
            _, (ro, (rS, _)) = _hedgehog_expected(q, k, v, wf, wq, wk, init, 16)
            o, (S, _) = window_linear_attention_hedgehog(q, k, v, wf, wq, wk, window=16, initial_state=init,
                                                         output_final_state=True, backend="triton")
        else:
            fq, fk = (hedgehog_features(x.double(), w.double()) for x, w in ((q, wq), (k, wk)))
            ro, (rS, _) = linear_attention_reference(fq, fk, v.double(), initial_state=tuple(x.double() for x in init),
                                                     output_final_state=True)
            o, (S, _) = linear_attention_hedgehog(q, k, v, wq, wk, initial_state=init, output_final_state=True,
                                                  backend="triton")
    assert rel_err(o, ro) <= 1e-5 and rel_err(S, rS) <= 1e-5


@pytest.mark.parametrize("B,T", [(0, 64), (1, 0)])
def test_empty_inputs(B, T):
    """An empty batch or sequence gives empty outputs and passes an initial state through unchanged."""
    q = torch.rand(B, T, 2, 16, device=DEV)
    init = (torch.rand(B, 2, 16, 16, device=DEV), torch.rand(B, 2, 16, device=DEV))
    o, (S, z) = linear_attention(q, q, q, initial_state=init, output_final_state=True, backend="triton")
    assert o.shape == q.shape and torch.equal(S, init[0]) and torch.equal(z, init[1])
    o, (S, z) = window_linear_attention(q, q, q, q, q, torch.rand(2, device=DEV), window=8, initial_state=init,
                                        output_final_state=True, backend="triton")
    assert o.shape == q.shape and torch.equal(S, init[0]) and torch.equal(z, init[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1, 2, 16, 8), (2, 65, 4, 16, 12), (1, 130, 2, 32, 16), (0, 5, 2, 16, 8)],
                         ids=lambda s: "B{}T{}H{}D{}f{}".format(*s))
def test_hedgehog_feature_map_kernel(shape, dtype):
    """The standalone Hedgehog feature-map kernel: the float64 map's features (outputs poisoned before the
    launch), in the input dtype; with a gradient needed it is the PyTorch map (autograd works)."""
    B, T, H, D, f = shape
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, H, D, generator=g).to(DEV, dtype)
    w = (0.4 * torch.randn(H, D, f, generator=g)).to(DEV, dtype)
    ref = hedgehog_features(x.double(), w.double())
    with torch.no_grad():
        out = hedgehog_feature_map(x, w, backend="triton")
    assert out.dtype == dtype and out.shape == (B, T, H, 2 * f) and not out.isnan().any()
    if B * T:
        # bf16: one rounding of the features (the interpreter truncates instead: ~2x the GPU's error)
        assert rel_err(out, ref) <= (1e-6 if dtype == torch.float32 else 1e-2)
    wg = w.float().clone().requires_grad_()
    y = hedgehog_feature_map(x.float(), wg, backend="triton")
    y.square().sum().backward()
    assert wg.grad is not None and rel_err(y, ref) <= 1e-6


def _rotary_tables(B, T, D, g, base=10000.0):
    """HF-style ``cos``, ``sin`` ``[B, T, D]`` (the two halves repeat) at random positions, float64."""
    pos = torch.randint(0, 4096, (B, T), generator=g).double()
    inv = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.cat([pos[..., None] * inv] * 2, dim=-1)  # [B, T, D]
    return ang.cos(), ang.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1, 4, 1, 16), (2, 65, 4, 2, 32), (1, 7, 3, 3, 24), (2, 3, 40, 8, 128),
                                   (0, 5, 2, 2, 16)], ids=lambda s: "B{}T{}H{}Hk{}D{}".format(*s))
def test_rotary_kernel(shape, dtype):
    """The one-launch rotary kernel for q and k: outputs and gradients against the float64 formula (outputs
    poisoned before each launch; the backward is the transposed rotation), a table shared by the batch
    (``[1, T, D]``), and tables that are not its own halves repeated (the backward assumes nothing of them)."""
    B, T, H, Hk, D = shape
    g = torch.Generator().manual_seed(2)
    q64, k64 = torch.randn(B, T, H, D, generator=g, dtype=torch.float64), torch.randn(B, T, Hk, D, generator=g,
                                                                                       dtype=torch.float64)
    cos64, sin64 = _rotary_tables(B, T, D, g)
    cos64[..., : D // 2] *= 0.9  # halves that differ: checks which half of the table each product reads
    sin64[..., D // 2 :] *= 1.1
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    q64, k64, cos64, sin64 = (x.to(DEV) for x in (q64, k64, cos64, sin64))
    q, k = (x.to(dtype).requires_grad_() for x in (q64, k64))
    cos, sin = cos64.to(dtype), sin64.to(dtype)
    qo, ko = rotary_embedding(q, k, cos, sin, backend="triton")
    assert qo.dtype == ko.dtype == dtype and qo.shape == q.shape and ko.shape == k.shape
    q64g, k64g = (x.clone().requires_grad_() for x in (q64, k64))
    rq, rk = rotary_reference(q64g, k64g, cos64, sin64)
    if B * T == 0:
        return
    assert not (qo.isnan().any() or ko.isnan().any())
    assert rel_err(qo, rq) <= tol and rel_err(ko, rk) <= tol
    dq_out, dk_out = torch.randn_like(rq), torch.randn_like(rk)
    torch.autograd.backward((qo, ko), (dq_out.to(dtype), dk_out.to(dtype)))
    torch.autograd.backward((rq, rk), (dq_out, dk_out))
    assert rel_err(q.grad, q64g.grad) <= tol and rel_err(k.grad, k64g.grad) <= tol
    # one table for the whole batch
    with torch.no_grad():
        qo1, ko1 = rotary_embedding(q, k, cos[:1], sin[:1], backend="triton")
        rq1, rk1 = rotary_reference(q64, k64, cos64[:1], sin64[:1])
    assert rel_err(qo1, rq1) <= tol and rel_err(ko1, rk1) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 33, 4, 2, 32, 16), (1, 5, 3, 1, 32, 24), (2, 3, 4, 2, 96, 72),
                                   (1, 4, 2, 2, 16, 2)], ids=lambda s: "B{}T{}H{}Hk{}D{}R{}".format(*s))
def test_rotary_kernel_partial(shape, dtype):
    """Partial rotary (tables of R < D dims, Phi-4-mini's 3/4): the kernel turns the first R dims of every head
    and copies the rest, outputs and gradients as the float64 formula; the pass-through dims come out unchanged."""
    B, T, H, Hk, D, R = shape
    g = torch.Generator().manual_seed(3)
    q64, k64 = (torch.randn(B, T, h, D, generator=g, dtype=torch.float64).to(DEV) for h in (H, Hk))
    cos64, sin64 = (x.to(DEV) for x in _rotary_tables(B, T, R, g))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    q, k = (x.to(dtype).requires_grad_() for x in (q64, k64))
    qo, ko = rotary_embedding(q, k, cos64.to(dtype), sin64.to(dtype), backend="triton")
    q64g, k64g = (x.clone().requires_grad_() for x in (q64, k64))
    rq, rk = rotary_reference(q64g, k64g, cos64, sin64)
    assert rel_err(qo, rq) <= tol and rel_err(ko, rk) <= tol
    assert torch.equal(qo[..., R:], q[..., R:]) and torch.equal(ko[..., R:], k[..., R:])
    dq_out, dk_out = torch.randn_like(rq), torch.randn_like(rk)
    torch.autograd.backward((qo, ko), (dq_out.to(dtype), dk_out.to(dtype)))
    torch.autograd.backward((rq, rk), (dq_out, dk_out))
    assert rel_err(q.grad, q64g.grad) <= tol and rel_err(k.grad, k64g.grad) <= tol


def test_partial_rotary_hybrid_runs_the_rotary_kernel(monkeypatch):
    """A Phi-3 hybrid whose rotary turns half of each head (tiny random model, as Phi-4-mini turns 3/4): its
    converted layers rotate with the Triton kernel and give the logits of the PyTorch rotary, prefill and steps."""
    from conftest import tiny_model

    from linearize import recipe as R
    from linearize.kernels import triton_rotary
    from linearize.convert.selection import select_layout
    from linearize.convert.surgery import linearize_model

    hybrid = linearize_model(tiny_model("phi3").float(), select_layout(4, ratio="1:1"), R.load("lolcats")).to(DEV)
    ids = torch.randint(3, 128, (2, 30), device=DEV)

    def run(backend):
        hybrid.set_kernel_options(rotary_backend=backend)
        with torch.no_grad():
            out = hybrid(ids[:, :20], use_cache=True)
            steps = [out.logits]
            for t in range(20, 30):
                out = hybrid(ids[:, t: t + 1], cache=out.past_key_values, use_cache=True)
                steps.append(out.logits)
        return torch.cat(steps, 1)

    launched = []
    real = triton_rotary.rotary_triton
    monkeypatch.setattr(triton_rotary, "rotary_triton", lambda *a, **kw: launched.append(1) or real(*a, **kw))
    ref = run("torch")
    assert not launched
    out = run("triton")
    assert launched and (out - ref).abs().max().item() <= 1e-4


def test_kernels_too_big_for_shared_memory_fall_back(monkeypatch):
    """A Hedgehog kernel that does not fit the GPU's shared memory (on an H200 the feature-map kernel at fp32,
    head_dim 256, f = 64 asked for 320 KB of 227) ends on the features-first path with the same results, state
    updates included, and later calls go there directly."""
    from triton.runtime.errors import OutOfResources

    from linearize.kernels import triton_common, triton_features, triton_step

    calls = []

    def too_big(original=None):
        def run(*args, **kwargs):  # the kernels fed features (no projection tiles) still fit
            if original is not None and kwargs.get("wqx") is None:
                return original(*args, **kwargs)
            calls.append(1)
            raise OutOfResources(327680, 232448, "shared memory")
        return run

    monkeypatch.setattr(triton_common, "TOO_BIG", set())
    B, T, H, Hk, D, f, V = 2, 4, 2, 1, 16, 8, 16
    q, k, v, wf, wq, wk, init = _hedgehog_case(B, T, H, Hk, D, f, V, 4, torch.float32, state=True, seed=3)
    with torch.no_grad():
        expected = hedgehog_feature_map(q, wq, backend="triton")
        monkeypatch.setattr(triton_features, "hedgehog_feature_map_triton", too_big())
        for _ in range(2):
            assert rel_err(hedgehog_feature_map(q, wq, backend="triton"), expected) <= 1e-6
        assert len(calls) == 1  # remembered
        fq, fk = (hedgehog_features(x, w) for x, w in ((q, wq), (k, wk)))
        fused, plain = (tuple(x.clone() for x in init) for _ in range(2))
        monkeypatch.setattr(triton_step, "linear_step_triton", too_big(triton_step.linear_step_triton))
        a = linear_attention_step_hedgehog(q[:, 0], k[:, 0], v[:, 0], wq, wk, fused, backend="triton")
        b = linear_attention_step(fq[:, 0], fk[:, 0], v[:, 0], plain, backend="reference")
        assert rel_err(a, b) <= 1e-5 and rel_err(fused[0], plain[0]) <= 1e-5
        ring = empty_window_state(B, Hk, D, 2 * f, V, 4, dtype=torch.float32, device=DEV)
        ring_plain = WindowState(*(x.clone() for x in ring))
        monkeypatch.setattr(triton_step, "window_step_triton", too_big(triton_step.window_step_triton))
        for t in range(T):
            a = window_linear_attention_step_hedgehog(q[:, t], k[:, t], v[:, t], wf, wq, wk, ring, backend="triton")
            b = window_linear_attention_step(q[:, t], k[:, t], fq[:, t], fk[:, t], v[:, t], wf, ring_plain,
                                             backend="torch")
            assert rel_err(a, b) <= 1e-5, t
        assert rel_err(ring.S, ring_plain.S) <= 1e-5 and int(ring.seen) == T
    assert len(calls) == 3


def test_projections_too_large_for_shared_memory_skip_the_compile(monkeypatch):
    """A Hedgehog projection over 128 KB (fp32 at head_dim 256, 2f = 256: the map kernel asked for 320 KB on an
    H200, after minutes of compiling) goes to the features-first path without a launch; the H200-tested sizes
    (bf16 at that shape, fp32 at head_dim 128) launch."""
    from linearize.kernels import triton_common, triton_features, triton_step
    from linearize.kernels.triton_common import projection_fits

    assert projection_fits(256, 256, torch.bfloat16) and projection_fits(128, 128, torch.float32)
    assert not projection_fits(256, 256, torch.float32)

    def never(original=None):
        def run(*args, **kwargs):  # the step kernel fed features (no projection tiles) may run
            if original is not None and kwargs.get("wqx") is None:
                return original(*args, **kwargs)
            raise AssertionError("a kernel was launched for a projection that cannot fit")
        return run

    monkeypatch.setattr(triton_common, "TOO_BIG", set())
    monkeypatch.setattr(triton_features, "hedgehog_feature_map_triton", never())
    monkeypatch.setattr(triton_step, "window_step_triton", never(triton_step.window_step_triton))
    B, T, H, Hk, D, f, V = 1, 2, 2, 1, 256, 128, 16
    q, k, v, wf, wq, wk, _ = _hedgehog_case(B, T, H, Hk, D, f, V, 4, torch.float32, state=False, seed=6)
    with torch.no_grad():
        got = hedgehog_feature_map(q, wq, backend="triton")
        assert rel_err(got, hedgehog_features(q, wq)) <= 1e-6
        ring = empty_window_state(B, Hk, D, 2 * f, V, 4, dtype=torch.float32, device=DEV)
        ring_plain = WindowState(*(x.clone() for x in ring))
        fq, fk = (hedgehog_features(x, w) for x, w in ((q, wq), (k, wk)))
        a = window_linear_attention_step_hedgehog(q[:, 0], k[:, 0], v[:, 0], wf, wq, wk, ring, backend="triton")
        b = window_linear_attention_step(q[:, 0], k[:, 0], fq[:, 0], fk[:, 0], v[:, 0], wf, ring_plain,
                                         backend="torch")
    assert rel_err(a, b) <= 1e-5 and rel_err(ring.S, ring_plain.S) <= 1e-5
    from linearize.kernels import triton_linear, triton_window

    monkeypatch.setattr(triton_window, "window_linear_attention_hedgehog_triton", never())
    monkeypatch.setattr(triton_linear, "linear_attention_hedgehog_triton", never())
    with torch.no_grad():  # the forwards that compute the features in the kernel (fused_feature_maps="all")
        o, _ = window_linear_attention_hedgehog(q, k, v, wf, wq, wk, window=4, backend="triton")
        o_ref, _ = window_linear_attention(q, k, fq, fk, v, wf, window=4, backend="torch")
        assert rel_err(o, o_ref) <= 1e-5
        o, _ = linear_attention_hedgehog(q, k, v, wq, wk, backend="triton")
        assert rel_err(o, linear_attention(fq, fk, v, backend="torch")[0]) <= 1e-5
    assert not triton_common.TOO_BIG  # skipped by the size rule, not learned from a failed launch


@pytest.mark.parametrize("case", ["plain", "two-pass", "gated", "key-mask", "wide", "wide-key-mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_sinks_and_lse_triton(case, dtype, monkeypatch):
    """Attention sinks on the Triton path (zeroed key features, the kernel's log normaliser, the merge) against the
    float64 reference: outputs, lse, final state, and every gradient including lse's (its backward adds
    ``dlse / den`` to each row's weights); a key mask runs forward only."""
    from linearize.kernels import triton_window

    monkeypatch.setitem(triton_window.CONFIG, "fwd_two_pass", case == "two-pass")
    B, T, H, Hk, D, K, V, W = 2, 150, 4, 2, 16, 16, 16, 32
    if case.startswith("wide"):  # several key blocks per chunk (an odd W: linear pairs in two of them)
        T, W = 230, 150
    inp = window_inputs(B, T, H, Hk, D, K, V, dtype=dtype, device=DEV, state=True)
    if case == "gated":
        inp = with_decay(inp, B, T, Hk, seed=4)
    key_mask = None
    sinks = torch.zeros(B, T, dtype=torch.bool, device=DEV)
    sinks[:, :5] = True
    if case.endswith("key-mask"):
        key_mask = torch.ones(B, T, dtype=torch.bool, device=DEV)
        key_mask[1, :11] = False
        sinks[1] = False
        sinks[1, 11:16] = True
    grads = key_mask is None  # a key mask on the Triton path is an inference forward
    out = {}
    for backend, cast in (("reference", torch.float64), ("triton", None)):
        x = leaf_copies(inp, dtype=cast)
        with torch.set_grad_enabled(grads):
            o, st, lse = window_linear_attention(x["q"], x["k"], x["fq"], x["fk"], x["v"], x["window_factor"],
                                                 window=W, backend=backend, initial_state=x["initial_state"],
                                                 output_final_state=True, key_mask=key_mask,
                                                 log_decay=x.get("log_decay"), sink_mask=sinks, return_lse=True)
        rows = key_mask if key_mask is not None else torch.ones(B, T, dtype=torch.bool, device=DEV)
        got = {"o": o[rows], "lse": lse[rows], "S": st[0], "z": st[1]}
        if grads:
            g = torch.Generator().manual_seed(3)
            rnd = lambda t: torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device)  # noqa: E731
            loss = (o.double() * rnd(o)).sum() + (lse.double() * rnd(lse)).sum() + (st[0].double() * rnd(st[0])).sum()
            loss.backward()
            got.update({f"d{a}": t.grad for a, t in x.items() if a != "initial_state" and t.grad is not None})
        out[backend] = got
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for name, ref in out["reference"].items():
        assert rel_err(out["triton"][name], ref, floor=1e-2) <= tol * (3 if name.startswith("d") else 1), name


@pytest.mark.parametrize("hedgehog,ring,dtype", step_matrix([(h, r) for h in (False, True) for r in (0, 4, 16)],
                                                        [(True, 4)]), ids=_dtype_id)
def test_window_step_with_sinks_triton(hedgehog, ring, dtype, monkeypatch):
    """The Triton window step reads the sinks and adds those out of its window to the softmax part: prefill +
    steps equal the float64 reference's forward with the same sinks (ring = 4: the rings walked in blocks, the
    sinks' maximum starting the online softmax; ring = 16: the ring walked in one part, merged with the sinks)."""
    if ring == 16:
        _launch(monkeypatch, step_ring_split=16, step_ring_split_from=8)
    else:
        _launch(monkeypatch, step_ring_block=ring, step_ring_block_from=ring and 8)
    check_sink_steps("triton", dtype, device=DEV, hedgehog=hedgehog)


@pytest.mark.parametrize("form", ["llama", "olmo2", "gemma"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "bf16-fp32w"])
@pytest.mark.parametrize("rows, n", [(1, 16), (7, 96), (3, 200), (0, 64)], ids=lambda v: str(v))
def test_rms_norm_kernel(form, dtypes, rows, n):
    """The RMS-norm kernel against the families' step-by-step reference (outputs poisoned first): the output
    dtype of the form, every element within a unit in the last place (only the order of the sum of squares
    differs), and in bf16 almost all identical."""
    from linearize.kernels import rms_norm, rms_norm_reference

    xdt, wdt = dtypes
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = (torch.randn(rows, 2, n, generator=g) * 3).to(xdt).to(DEV)[:, 1]  # every other row: a row stride of 2n
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(wdt).to(DEV)
    with torch.no_grad():
        got = rms_norm(x, w, 1e-5, form=form, backend="triton")
    want = rms_norm_reference(x, w, 1e-5, form)
    assert got.dtype == want.dtype and got.shape == want.shape == (rows, n)
    if rows == 0:
        return
    assert not got.isnan().any()
    ulp = 2.0 ** -7 if got.dtype == torch.bfloat16 else 2.0 ** -20
    assert ((got.float() - want.float()).abs() <= ulp * want.float().abs() + 1e-6).all()
    if got.dtype == torch.bfloat16:  # one rounding of the same fp32 value: almost always the same bits
        assert (got == want).float().mean() >= 0.9


def test_rms_norm_backend_in_a_hybrid():
    """A tiny Qwen3 hybrid (its q / k norms too) with ``norm_backend="triton"`` gives the logits of its own norms,
    in fp32 to 1e-5, and runs the kernel in every norm."""
    from conftest import tiny_model
    from linearize import recipe as R
    from linearize.convert.selection import select_layout
    from linearize.convert.surgery import linearize_model
    from linearize.model import norms

    hybrid = linearize_model(tiny_model("qwen3"), select_layout(4, ratio="1:1"), R.load("lolcats")).to(DEV)
    ids = torch.arange(24, device=DEV).view(2, 12) % 100
    with torch.no_grad():
        want = hybrid(ids).logits
        hybrid.set_kernel_options(norm_backend="triton")
        calls = []
        real = norms.rms_norm
        norms.rms_norm = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            got = hybrid(ids).logits
        finally:
            norms.rms_norm = real
    assert len(calls) == 4 * 4 + 1 and rel_err(got, want) <= 1e-5

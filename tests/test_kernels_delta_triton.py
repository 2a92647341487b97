"""The gated delta rule on the Triton kernels vs the float64 token-by-token reference.

Checked: outputs, final state and the gradients of q, k, v, beta, log_decay and the initial state (fp32 <= 1e-4,
bf16 <= 1e-2 relative L2), odd T, GQA, K != V, continuation (two halves == one call), decode steps == forward,
no decay, strong decay, the empty sequence, the public entry points reaching the kernels.

Two tiers. On a GPU the tests marked ``gpu`` run the kernels at real shapes. Without one,
``test_delta_kernels_under_interpreter`` (slow tier) re-runs the tiny-shape ``interp`` tests of this module in a
fresh interpreter with ``TRITON_INTERPRET=1`` (it must be set before ``torch`` imports ``triton``), with 16-token
chunks so that a few dozen tokens cross several chunks. Outputs and intermediates are poisoned with NaN before
every launch, so an element a kernel forgets to write fails a test.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from conftest import run_under_interpreter

triton = pytest.importorskip("triton")
tl = triton.language

from linearize.kernels import triton_common, triton_delta, triton_delta_step  # noqa: E402
from linearize.kernels.delta import gated_delta_rule, gated_delta_rule_step  # noqa: E402
from linearize.kernels.delta_testing import NAMES, TOL, backend_fn, check, delta_inputs, run  # noqa: E402
from linearize.kernels.testing import rel_err  # noqa: E402

ON_GPU = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if ON_GPU else "cpu"
F64 = torch.float64

gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (tiny shapes: test_delta_kernels_under_interpreter)")
interp = pytest.mark.skipif(not INTERPRET,
                            reason="needs TRITON_INTERPRET=1 (run by test_delta_kernels_under_interpreter)")


@pytest.fixture(autouse=True)
def _poison():
    triton_common.set_poison(True)
    yield
    triton_common.set_poison(False)


def check_continuation(B, T, H, Hk, K, V, split, dtype=torch.float32):
    """Two calls, the second from the first's final state, equal one call (outputs and final state)."""
    inp = delta_inputs(B, T, H, Hk, K, V, dtype=dtype, device=DEV, seed=9)
    xs = [inp[n] for n in NAMES]

    def call(sl, state):
        return gated_delta_rule(*(x[:, sl] for x in xs), initial_state=state, output_final_state=True,
                                backend="triton")

    o, S = call(slice(None), inp["initial_state"])
    o1, S1 = call(slice(0, split), inp["initial_state"])
    o2, S2 = call(slice(split, None), S1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(torch.cat([o1, o2], 1), o) <= tol and rel_err(S2, S) <= tol


def check_step(B, T, H, Hk, K, V, prefill, dtype=torch.float32):
    """A Triton prefill, then one Triton decode step per token (state in place, output into ``out``): the outputs
    and the state equal the float64 reference over the whole sequence."""
    inp = delta_inputs(B, T, H, Hk, K, V, dtype=dtype, device=DEV, seed=5, state=False)
    q, k, v, beta, ld = (inp[n] for n in NAMES)
    ref, ref_S = gated_delta_rule(*(x.double() for x in (q, k, v, beta, ld)), output_final_state=True,
                                  backend="reference")
    if prefill:
        _, state = gated_delta_rule(*(x[:, :prefill] for x in (q, k, v, beta, ld)), output_final_state=True,
                                    backend="triton")
    else:
        state = torch.zeros(B, Hk, K, V, device=DEV)
    out = torch.full((B, H, V), float("nan"), dtype=dtype, device=DEV)
    outs = [gated_delta_rule_step(q[:, t], k[:, t], v[:, t], beta[:, t], ld[:, t], state, out=out,
                                  backend="triton").clone() for t in range(prefill, T)]
    assert rel_err(torch.stack(outs, 1), ref[:, prefill:]) <= TOL[dtype]
    assert rel_err(state, ref_S) <= (1e-5 if dtype == torch.float32 else 1e-2)


def check_entry_points(B, T, H, Hk, K, V, monkeypatch):
    """``gated_delta_rule`` (with gradients) and ``gated_delta_rule_step`` on the Triton backend launch these
    kernels; without a GPU ``backend=None`` on CPU tensors does not."""
    launched = []

    def spy(module, name):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, functools.wraps(real)(lambda *a, **kw: launched.append(name) or real(*a, **kw)))

    spy(triton_delta, "_fwd")
    spy(triton_delta, "_bwd")
    spy(triton_delta_step, "gated_delta_rule_step_triton")
    inp = delta_inputs(B, T + 1, H, Hk, K, V, device=DEV, seed=8)
    q, k, v, beta, ld = (inp[n][:, :T].clone().requires_grad_() for n in NAMES)
    o, S = gated_delta_rule(q, k, v, beta, ld, initial_state=inp["initial_state"], output_final_state=True,
                            backend="triton")
    (o.sum() + S.sum()).backward()
    gated_delta_rule_step(*(inp[n][:, T] for n in NAMES), S.detach().clone(), backend="triton")
    assert launched == ["_fwd", "_bwd", "gated_delta_rule_step_triton"]
    if not ON_GPU:
        gated_delta_rule(*(inp[n] for n in NAMES))
        assert len(launched) == 3


def check_empty_sequence():
    inp = delta_inputs(2, 0, 4, 2, 16, 32, device=DEV)
    o, S = gated_delta_rule(*(inp[n] for n in NAMES), initial_state=inp["initial_state"], output_final_state=True,
                            backend="triton")
    assert o.shape == (2, 0, 4, 32) and torch.equal(S, inp["initial_state"])


# ---------------------------------------------------------------------------
# GPU: real shapes

KV_DIMS = [(64, 128), (128, 128)]
HEADS = [(4, 2), (4, 4)]


@gpu
@pytest.mark.parametrize("T", [1, 37, 130, 1024])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "H{}Hk{}".format(*h))
@pytest.mark.parametrize("dims", KV_DIMS, ids=lambda d: "K{}V{}".format(*d))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_backward(T, heads, dims, dtype):
    check("triton", 2, T, *heads, *dims, dtype, state=T != 1024, device=DEV)


@gpu
@pytest.mark.parametrize("T", [130, 1024])
def test_fp32_intermediates(T, monkeypatch):
    """``fwd_inter_16bit`` off: the forward's w, u, U in fp32 (the default keeps them in the inputs' dtype)."""
    monkeypatch.setitem(triton_delta.CONFIG, "fwd_inter_16bit", False)
    check("triton", 2, T, 4, 2, 128, 128, torch.bfloat16, state=True, device=DEV)


#: launch settings that change the arithmetic, each off the default (kernels/README.md times them); the row steps
#: and the tile-wide products for 16-bit keys need the doubling inverse (their default) off
ARITHMETIC = {"row_steps": {"prep_diag_doubling": 0}, "tile_wide": {"prep_diag_doubling": 0, "prep_diag_rows": 0},
              "walk_fp32": {"walk_16bit": 0}, "prep_fp32": {"prep_16bit": 0}, "prep_blocks": {"prep_blocks": 1},
              "out_fp32": {"out_16bit": 0},
              "bwd_states_16bit": {"bwd_states_16bit": 1}, "bwd_inter_16bit": {"bwd_inter_16bit": 1}}


@gpu
@pytest.mark.parametrize("settings", ARITHMETIC.values(), ids=ARITHMETIC.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_arithmetic_settings(settings, dtype, monkeypatch):
    for name, value in settings.items():
        monkeypatch.setitem(triton_delta.CONFIG, name, value)
    check("triton", 2, 1024, 4, 2, 128, 128, dtype, state=True, device=DEV)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_dim_256(dtype):
    """Gemma's head size: the walks' state tiles are [256, BV] (the backward walk's pipeline does not fit shared
    memory at two stages; launch() retries with one)."""
    check("triton", 1, 200, 2, 1, 256, 256, dtype, device=DEV)


@gpu
def test_fp32_queries_and_keys_with_bf16_values():
    """As the layer calls it: q and k normalised in fp32, v and beta in bf16."""
    check("triton", 2, 300, 4, 2, 128, 128, torch.bfloat16, device=DEV, qk_dtype=torch.float32)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp32_states(dtype, monkeypatch):
    monkeypatch.setitem(triton_delta.CONFIG, "fwd_states_fp32", True)
    check("triton", 2, 300, 4, 2, 128, 128, dtype, device=DEV)


@gpu
@pytest.mark.parametrize("bt", [32, 64])
@pytest.mark.parametrize("bv", [32, 128])
def test_chunks_and_value_blocks(bt, bv, monkeypatch):
    """Other chunk sizes and value blocks than the defaults (the walks keep theirs: walk_waves 0)."""
    monkeypatch.setitem(triton_delta.CONFIG, "bt", bt)
    monkeypatch.setitem(triton_delta.CONFIG, "walk_waves", 0)
    for key in ("walk_bv", "out_bv", "bwd_bv"):
        monkeypatch.setitem(triton_delta.CONFIG, key, bv)
    check("triton", 2, 300, 4, 2, 128, 128, torch.bfloat16, device=DEV)


@gpu
@pytest.mark.parametrize("decay", ["strong", "zero"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decays(decay, dtype):
    check("triton", 2, 1024, 4, 2, 128, 128, dtype, decay=decay, device=DEV)


@gpu
@pytest.mark.parametrize("split", [64, 100])
def test_continuation(split):
    check_continuation(2, 300, 4, 2, 128, 128, split)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bv", [0, 32])
def test_step_matches_forward(dtype, bv, monkeypatch):
    monkeypatch.setitem(triton_delta_step.CONFIG, "step_bv", bv)
    check_step(2, 90, 8, 2, 128, 128, prefill=70, dtype=dtype)


@gpu
def test_entry_points(monkeypatch):
    check_entry_points(2, 130, 4, 2, 128, 128, monkeypatch)


@gpu
def test_empty_sequence():
    check_empty_sequence()


@gpu
def test_step_under_a_cuda_graph():
    """The step captured once and replayed: the state advances in place, the outputs land in ``out``."""
    B, H, Hk, K, V, T = 2, 4, 2, 128, 128, 6
    inp = delta_inputs(B, T, H, Hk, K, V, device=DEV, seed=11, state=False)
    xs = [inp[n] for n in NAMES]
    ref, _ = gated_delta_rule(*(x.double() for x in xs), backend="reference")
    state = torch.zeros(B, Hk, K, V, device=DEV)
    slots = [torch.empty_like(x[:, 0]) for x in xs]
    out = torch.empty(B, H, V, device=DEV)
    gated_delta_rule_step(*(x[:, 0] for x in xs), state.clone(), out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gated_delta_rule_step(*slots, state, out=out)
    outs = []
    for t in range(T):
        for slot, x in zip(slots, xs):
            slot.copy_(x[:, t])
        graph.replay()
        outs.append(out.clone())
    assert rel_err(torch.stack(outs, 1), ref) <= 1e-5


# ---------------------------------------------------------------------------
# CPU: Triton's interpreter at tiny shapes (16-token chunks)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setitem(triton_delta.CONFIG, "bt", 16)


@interp
@pytest.mark.parametrize("shape", [(1, 1, 2, 2, 16, 32), (1, 37, 4, 2, 16, 32), (2, 33, 2, 2, 32, 16)],
                         ids=lambda s: "B{}T{}H{}Hk{}K{}V{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interp_forward_backward(shape, dtype, small_chunks):
    check("triton", *shape, dtype, state=shape[1] != 33)


@interp
def test_interp_long_odd_sequence(small_chunks):
    """T = 130: nine chunks, the last one of two tokens; groups of 4 query heads."""
    check("triton", 1, 130, 4, 1, 16, 16, torch.float32)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interp_fp32_states(dtype, small_chunks, monkeypatch):
    monkeypatch.setitem(triton_delta.CONFIG, "fwd_states_fp32", True)
    check("triton", 1, 37, 4, 2, 16, 32, dtype)


@interp
def test_interp_fp32_queries_and_keys_with_bf16_values(small_chunks):
    check("triton", 1, 37, 4, 2, 16, 32, torch.bfloat16, qk_dtype=torch.float32)


@interp
@pytest.mark.parametrize("decay", ["strong", "zero"])
def test_interp_decays(decay, small_chunks):
    check("triton", 1, 40, 2, 2, 16, 16, torch.float32, decay=decay)


@interp
def test_interp_fp32_intermediates(small_chunks, monkeypatch):
    """``fwd_inter_16bit`` off: bf16 inputs with the forward's w, u, U in fp32 (the other tests run the default, bf16
    intermediates, within the same bf16 tolerance; gradients: fp32 recompute either way)."""
    monkeypatch.setitem(triton_delta.CONFIG, "fwd_inter_16bit", False)
    check("triton", 2, 37, 4, 2, 16, 32, torch.bfloat16)


# off-by-default settings: each chunk size once, one of them in each dtype (the defaults run both everywhere)
BT_DTYPES = pytest.mark.parametrize("bt,dtype", [(16, torch.bfloat16), (64, torch.float32)],
                                    ids=["bt16-bf16", "bt64-fp32"])


@interp
@BT_DTYPES
def test_interp_diagonal_blocks_tile_wide(bt, dtype, monkeypatch):
    """``prep_diag_rows`` off: the UT inverse's diagonal blocks by masked [BT, BT] products instead of on [16, 16]
    tiles (one block at BT = 16, four at 64); 16-bit keys need the doubling inverse off to take it."""
    monkeypatch.setitem(triton_delta.CONFIG, "bt", bt)
    monkeypatch.setitem(triton_delta.CONFIG, "prep_diag_rows", 0)
    monkeypatch.setitem(triton_delta.CONFIG, "prep_diag_doubling", 0)
    check("triton", 1, bt + 13, 2, 1, 32, 32, dtype)


@interp
@pytest.mark.parametrize("bt", [16, 64])
def test_interp_diagonal_blocks_by_row_steps(bt, monkeypatch):
    """``prep_diag_doubling`` off: 16-bit keys' diagonal blocks by the 15 row steps, forward and backward (the
    backward recomputes the transforms the same way). The default, (I - N)(I + N^2)(I + N^4)(I + N^8), runs in every
    bf16 test here; fp32 keys take the row steps always, in every fp32 test."""
    monkeypatch.setitem(triton_delta.CONFIG, "bt", bt)
    monkeypatch.setitem(triton_delta.CONFIG, "prep_diag_doubling", 0)
    check("triton", 1, bt + 13, 2, 1, 32, 32, torch.bfloat16)


@triton.jit
def _diagonal_inverses_probe(A_ptr, OUT_ptr, BT: tl.constexpr, DOUBLING: tl.constexpr):
    """The block-diagonal inverse of ``I + A`` (``A [BT, BT]``) into ``OUT``, by row steps or by doubling."""
    ar = tl.arange(0, BT)
    A = tl.load(A_ptr + ar[:, None] * BT + ar[None, :])
    D = triton_delta._diagonal_block_inverse(A, BT, 16, DOUBLING)
    tl.store(OUT_ptr + ar[:, None] * BT + ar[None, :], D)


@interp
@pytest.mark.parametrize("case", ["random", "aligned"])
def test_interp_diagonal_inverse_doubling_against_float64(case):
    """The doubling inverse of one 64-token chunk's diagonal blocks against float64, beside the row steps': for
    random keys, and for the worst case of the series, identical keys with beta = 0.99 (the entries of N^k grow as
    binomials, up to C(15, 7) x 0.99^8, before the sum cancels to the small true inverse): there 2.4e-4, which is
    why the forward uses it for 16-bit keys only."""
    g = torch.Generator().manual_seed(0)
    if case == "random":
        k = torch.nn.functional.normalize(torch.randn(64, 32, generator=g, dtype=torch.float64), dim=-1)
    else:
        k = torch.nn.functional.normalize(torch.ones(64, 32, dtype=torch.float64), dim=-1)
    beta = torch.full((64,), 0.99, dtype=torch.float64) if case == "aligned" else torch.rand(64, generator=g).double()
    A = torch.tril(beta[:, None] * (k @ k.T), -1)
    blocks = torch.block_diag(*[torch.eye(16, dtype=torch.float64) + A[i:i + 16, i:i + 16] for i in range(0, 64, 16)])
    ref = torch.linalg.inv(blocks)
    errs = {}
    for doubling in (False, True):
        out = torch.zeros(64, 64)
        _diagonal_inverses_probe[(1,)](A.float().contiguous(), out, 64, doubling)
        errs[doubling] = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert errs[False] <= 1e-6, errs
    assert errs[True] <= (1e-6 if case == "random" else 1e-3), errs


@interp
def test_interp_walk_tf32(small_chunks, monkeypatch):
    """``walk_16bit`` off: the forward walk's products on tf32 operands for bf16 inputs (the default's bf16 operands
    are what every other bf16 test here runs); fp32 inputs keep fp32 operands either way."""
    monkeypatch.setitem(triton_delta.CONFIG, "walk_16bit", 0)
    check("triton", 2, 37, 4, 2, 16, 32, torch.bfloat16)
    check("triton", 1, 37, 2, 1, 16, 32, torch.float32)


@interp
def test_interp_prep_16bit_off(small_chunks, monkeypatch):
    """``prep_16bit`` off: the forward's ``w`` and ``u`` products on tf32 operands for bf16 inputs (the default's bf16
    operands are what every other bf16 test here runs); fp32 inputs keep fp32 operands either way."""
    monkeypatch.setitem(triton_delta.CONFIG, "prep_16bit", 0)
    check("triton", 2, 37, 4, 2, 16, 32, torch.bfloat16)
    check("triton", 1, 37, 2, 1, 16, 32, torch.float32)


@interp
def test_interp_out_16bit_off(small_chunks, monkeypatch):
    """``out_16bit`` off: the output kernel's in-chunk product on tf32 operands for bf16 inputs (GQA: the query heads
    of a KV head share its keys); fp32 inputs keep fp32 operands either way."""
    monkeypatch.setitem(triton_delta.CONFIG, "out_16bit", 0)
    check("triton", 2, 37, 4, 2, 16, 32, torch.bfloat16)
    check("triton", 1, 37, 2, 1, 16, 32, torch.float32)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interp_prep_blocks(dtype, monkeypatch):
    """``prep_blocks``: the UT inverse of a 64-token chunk as four 16-row blocks (forward and backward; a whole
    chunk and a part of one; GQA, K != V) equals the reference within the dtype's tolerance, with and without
    ``prep_16bit``."""
    monkeypatch.setitem(triton_delta.CONFIG, "bt", 64)
    monkeypatch.setitem(triton_delta.CONFIG, "prep_blocks", 1)
    check("triton", 2, 64 + 37, 4, 2, 16, 32, dtype)
    monkeypatch.setitem(triton_delta.CONFIG, "prep_16bit", 0)
    check("triton", 1, 64 + 37, 2, 1, 16, 32, dtype)


@interp
@BT_DTYPES
def test_interp_prep_split(bt, dtype, monkeypatch):
    """``prep_split``: the prep as two launches (the transforms, then ``w`` and ``u``) gives exactly the one
    launch's ``w``, ``u`` and stored transforms (the forward's, 16-bit products and intermediates under bf16; the
    backward's, fp32), and forward and backward equal the reference (GQA, K != V, a partial last chunk)."""
    monkeypatch.setitem(triton_delta.CONFIG, "bt", bt)
    inp = delta_inputs(2, bt + 13, 4, 2, 16, 40, dtype=dtype, device=DEV, seed=3)
    k, v, beta, ld = (inp[n] for n in ("k", "v", "beta", "log_decay"))
    lg = ld.float().contiguous()
    low16 = dtype == torch.bfloat16
    for split_kw in ({"store_t": False, "dtype": dtype, "low16": low16}, {"store_t": True}):
        monkeypatch.setitem(triton_delta.CONFIG, "prep_split", 0)
        one = triton_delta._prep(k, v, beta, lg, **split_kw)
        monkeypatch.setitem(triton_delta.CONFIG, "prep_split", 1)
        two = triton_delta._prep(k, v, beta, lg, **split_kw)
        for a, b in zip(one, two):
            assert (a is None and b is None) or torch.equal(a, b)
    check("triton", 2, bt + 13, 4, 2, 16, 40, dtype)


def backward_grads(inp: dict, settings: dict, monkeypatch) -> dict:
    """The Triton path's gradients of every input (the initial state's included) under ``settings``."""
    for name, value in settings.items():
        monkeypatch.setitem(triton_delta.CONFIG, name, value)
    return run(backend_fn("triton"), inp)[2]


@interp
@pytest.mark.parametrize("setting", ["bwd_states_16bit", "bwd_inter_16bit"])
def test_interp_backward_16bit_intermediates(setting, small_chunks, monkeypatch):
    """``bwd_states_16bit`` (the backward's stored chunk states and state gradients) and ``bwd_inter_16bit`` (its
    ``w``, ``U`` and ``dU``) in bf16 for bf16 inputs: the gradients move by the rounding only (< 1e-2 from the
    fp32-intermediate ones) and still match the reference (GQA, K != V, a partial last chunk, an initial state,
    a final-state gradient)."""
    inp = delta_inputs(2, 37, 4, 2, 16, 40, dtype=torch.bfloat16, device=DEV, seed=5)
    off, on = (backward_grads(inp, {setting: v}, monkeypatch) for v in (0, 1))
    assert all(rel_err(on[n].double(), off[n].double()) < 1e-2 for n in off)
    check("triton", 2, 37, 4, 2, 16, 40, torch.bfloat16)


@interp
def test_interp_backward_16bit_settings_leave_fp32_alone(small_chunks, monkeypatch):
    """fp32 inputs keep fp32 intermediates under both settings: the same gradients bit for bit."""
    inp = delta_inputs(1, 21, 2, 1, 16, 24, dtype=torch.float32, device=DEV, seed=6)
    off = backward_grads(inp, {}, monkeypatch)
    on = backward_grads(inp, {"bwd_states_16bit": 1, "bwd_inter_16bit": 1}, monkeypatch)
    assert all(torch.equal(off[n], on[n]) for n in off)


@interp
@pytest.mark.parametrize("bt", [32, 64])
def test_interp_chunks_of(bt, monkeypatch):
    """Chunks of two and four 16-row blocks: the blocked inverse's off-diagonal steps."""
    monkeypatch.setitem(triton_delta.CONFIG, "bt", bt)
    check("triton", 1, bt + 13, 2, 1, 32, 32, torch.float32)


@interp
def test_interp_continuation(small_chunks):
    check_continuation(1, 40, 4, 2, 16, 32, split=21)


@interp
@pytest.mark.parametrize("bv", [0, 16])
def test_interp_step_matches_forward(bv, small_chunks, monkeypatch):
    monkeypatch.setitem(triton_delta_step.CONFIG, "step_bv", bv)
    check_step(1, 24, 4, 2, 16, 64, prefill=17)


@interp
def test_interp_entry_points(small_chunks, monkeypatch):
    check_entry_points(1, 20, 4, 2, 16, 32, monkeypatch)


@interp
def test_interp_empty_sequence():
    check_empty_sequence()


@pytest.mark.slow  # the interpreter: about half a minute of CPU
@pytest.mark.skipif(ON_GPU, reason="on a GPU the gpu tests run the kernels directly")
@pytest.mark.skipif(INTERPRET, reason="already interpreting: the interp tests run directly")
def test_delta_kernels_under_interpreter():
    assert run_under_interpreter(Path(__file__).resolve(), "interp_") == 36  # every interp test ran

"""Gated (decayed) linear attention on the Triton kernels vs a literal float64 recurrence.

``log_decay`` ``[B, T, Hk]`` (``<= 0``): ``S_t = e^{ld_t} S_{t-1} + k_t v_t^T``, ``z_t = e^{ld_t} z_{t-1} + k_t``,
``o_t = q_t.S_t / (q_t.z_t + eps)``. Checked: outputs, final states and every gradient (``log_decay`` and the
initial state too), continuation, decode steps == forward, zero decay == the plain kernels, strong decay.

Two tiers. On a GPU the tests marked ``gpu`` run the kernels at real shapes. Without one,
``test_gated_kernels_under_interpreter`` (slow tier) re-runs the tiny-shape ``interp`` tests of this module in
a fresh interpreter with ``TRITON_INTERPRET=1`` (it must be set before ``torch`` imports ``triton``), with
16-token chunks so that a few dozen tokens cross several chunks and segments. Outputs are poisoned with NaN
before every launch, so an element a kernel forgets to write fails a test.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from conftest import run_under_interpreter

triton = pytest.importorskip("triton")

from linearize.kernels import linear_attention, linear_attention_step  # noqa: E402
from linearize.kernels import triton_common, triton_linear, triton_step  # noqa: E402
from linearize.kernels.testing import rel_err  # noqa: E402
from linearize.kernels.triton_linear import linear_attention_triton  # noqa: E402
from linearize.kernels.triton_step import linear_step_triton  # noqa: E402

ON_GPU = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if ON_GPU else "cpu"
F64 = torch.float64

gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (tiny shapes: test_gated_kernels_under_interpreter)")
interp = pytest.mark.skipif(not INTERPRET,
                            reason="needs TRITON_INTERPRET=1 (run by test_gated_kernels_under_interpreter)")

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # relative L2 vs float64, outputs and gradients
GRAD_FLOOR = 1e-2  # RMS below which a reference gradient counts as ~0 (dq at T = 1 without a state)


@pytest.fixture(autouse=True)
def _poison():
    triton_common.set_poison(True)
    yield
    triton_common.set_poison(False)


# ---------------------------------------------------------------------------
# the spec: the recurrence, token by token, in the inputs' dtype (float64 here)


def recurrence(q, k, v, log_decay, *, normalize=True, eps=1e-6, initial_state=None):
    """``(o [B,T,H,V], (S [B,Hk,K,V], z [B,Hk,K]))`` of the gated recurrence; autograd flows to every input."""
    B, T, H, K = q.shape
    Hk, V = k.shape[2], v.shape[-1]
    S, z = initial_state if initial_state is not None else (q.new_zeros(B, Hk, K, V), q.new_zeros(B, Hk, K))
    outs = []
    for t in range(T):
        a = log_decay[:, t].exp()  # [B, Hk]
        S = a[..., None, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        z = a[..., None] * z + k[:, t]
        qt = q[:, t].view(B, Hk, H // Hk, K)
        o = qt @ S  # [B, Hk, G, V]
        if normalize:
            o = o / ((qt @ z[..., None]) + eps)
        outs.append(o.reshape(B, H, V))
    return torch.stack(outs, 1), (S, z)


def quadratic(q, k, v, log_decay, *, normalize=True, eps=1e-6, initial_state=None):
    """:func:`recurrence` in closed form (``e^{b_t - b_j}`` weights, ``b`` the cumulative log decay), for long
    sequences; :func:`test_quadratic_form_is_the_recurrence` holds it to the recurrence."""
    T, H, Hk = q.shape[1], q.shape[2], k.shape[2]
    G = H // Hk
    b = log_decay.cumsum(1)  # [B, T, Hk]
    bq = b.repeat_interleave(G, 2).transpose(1, 2)  # [B, H, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    w = (bq[..., :, None] - bq[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [B, H, T, T]
    qh = q.transpose(1, 2)  # [B, H, T, K]
    kh, vh = (x.repeat_interleave(G, 2).transpose(1, 2) for x in (k, v))
    a = (qh @ kh.transpose(-1, -2)) * w
    num, den = a @ vh, a.sum(-1, keepdim=True)  # [B, H, T, V], [B, H, T, 1]
    keys = (b[:, -1:] - b).exp()  # [B, T, Hk]: each key decayed to the last position
    S = torch.einsum("btn,btnk,btnv->bnkv", keys, k, v)
    z = torch.einsum("btn,btnk->bnk", keys, k)
    if initial_state is not None:
        S0, z0 = initial_state
        eq = bq.exp()[..., None]  # [B, H, T, 1]
        num = num + eq * (qh @ S0.repeat_interleave(G, 1))
        den = den + eq * (qh @ z0.repeat_interleave(G, 1)[..., None])
        last = b[:, -1].exp()  # [B, Hk]
        S, z = S + last[..., None, None] * S0, z + last[..., None] * z0
    o = num / (den + eps) if normalize else num
    return o.transpose(1, 2), (S, z)


def gated_inputs(B, T, H, Hk, K, V, *, dtype, seed=0, state=True, decay="mixed"):
    """Non-negative q, k (feature-mapped-like), signed v, log decays (``mixed``: per-token magnitudes spread
    around 0.05, from 1e-3 to ~1; ``strong``: about -5; ``zero``), an optional initial state."""
    g = torch.Generator().manual_seed(seed)
    out = {"q": torch.rand(B, T, H, K, generator=g).to(DEV, dtype),
           "k": torch.rand(B, T, Hk, K, generator=g).to(DEV, dtype),
           "v": torch.randn(B, T, Hk, V, generator=g).to(DEV, dtype)}
    if decay == "mixed":
        ld = -(torch.randn(B, T, Hk, generator=g) - 3).exp()
    elif decay == "strong":
        ld = -5 + 0.5 * torch.randn(B, T, Hk, generator=g).clamp(-1, 1)
    else:
        ld = torch.zeros(B, T, Hk)
    out["log_decay"] = ld.to(DEV)
    if state:
        out["initial_state"] = ((torch.rand(B, Hk, K, V, generator=g) * 4 - 1).to(DEV),
                                (torch.rand(B, Hk, K, generator=g) * 4).to(DEV))
    return out


def _leaves(inp, dtype=None):
    def leaf(x):
        return x.detach().to(dtype if dtype is not None else x.dtype).clone().requires_grad_()

    return {n: (tuple(map(leaf, x)) if n == "initial_state" else leaf(x)) for n, x in inp.items()}


def _grads(x):
    out = {n: t.grad for n, t in x.items() if n != "initial_state"}
    if "initial_state" in x:
        out["S0"], out["z0"] = (t.grad for t in x["initial_state"])
    return out


def _run(fn, inp, *, normalize, dtype=None, seed=1):
    """Forward with the final state, backward of seeded random float64 cotangents; (o, (S, z), grads)."""
    x = _leaves(inp, dtype)
    o, (S, z) = fn(x, normalize)
    g = torch.Generator().manual_seed(seed)
    cot = [torch.randn(t.shape, generator=g, dtype=F64).to(o.device) for t in (o, S, z)]
    sum((t.double() * c).sum() for t, c in zip((o, S, z), cot)).backward()
    return o, (S, z), _grads(x)


def triton_fn(x, normalize):
    return linear_attention_triton(x["q"], x["k"], x["v"], normalize=normalize, initial_state=x.get("initial_state"),
                                   output_final_state=True, log_decay=x["log_decay"])


def recurrence_fn(x, normalize):
    return recurrence(x["q"], x["k"], x["v"], x["log_decay"], normalize=normalize, initial_state=x.get("initial_state"))


def reference_fn(x, normalize):
    """The spec, fast: the recurrence for short sequences, its closed form for long ones."""
    fn = recurrence if x["q"].shape[1] <= 80 else quadratic
    return fn(x["q"], x["k"], x["v"], x["log_decay"], normalize=normalize, initial_state=x.get("initial_state"))


def check_gated(B, T, H, Hk, K, V, dtype, *, normalize=True, state=True, decay="mixed", tol=None, tols=None):
    """The gated Triton forward and backward match the float64 recurrence: outputs, final state, all gradients
    (``tols``: other tolerances by name)."""
    inp = gated_inputs(B, T, H, Hk, K, V, dtype=dtype, seed=T * 7 + H + K, state=state, decay=decay)
    o, st, g = _run(triton_fn, inp, normalize=normalize)
    ro, rst, rg = _run(reference_fn, inp, normalize=normalize, dtype=F64)
    tol = tol or TOL[dtype]
    assert o.dtype == dtype and o.shape == (B, T, H, V)
    assert st[0].dtype == torch.float32 and st[1].dtype == torch.float32
    errs = {"o": rel_err(o, ro), "S": rel_err(st[0], rst[0]), "z": rel_err(st[1], rst[1])}
    errs.update({name: rel_err(g[name], rg[name], floor=GRAD_FLOOR) for name in rg})
    assert set(g) == set(rg) and all(g[n] is not None for n in rg)
    bad = {n: e for n, e in errs.items() if not e <= (tols or {}).get(n, tol)}
    assert not bad, (bad, errs)
    return errs


def check_step(B, T, H, Hk, K, V, prefill, dtype=torch.float32, *, normalize=True, tol=None):
    """Prefill with the gated forward, then one gated decode step per token (state updated in place, output
    written into ``out``): the outputs and the state equal one forward over the whole sequence."""
    inp = gated_inputs(B, T, H, Hk, K, V, dtype=dtype, seed=5, state=False)
    q, k, v, ld = (inp[n] for n in ("q", "k", "v", "log_decay"))
    ro, (rS, rz) = quadratic(q.double(), k.double(), v.double(), ld.double(), normalize=normalize)
    if prefill:
        _, (S, z) = linear_attention_triton(q[:, :prefill], k[:, :prefill], v[:, :prefill], normalize=normalize,
                                            output_final_state=True, log_decay=ld[:, :prefill])
    else:
        S, z = torch.zeros(B, Hk, K, V, device=DEV), torch.zeros(B, Hk, K, device=DEV)
    out = torch.full((B, H, V), float("nan"), dtype=dtype, device=DEV)
    outs = []
    for t in range(prefill, T):
        outs.append(linear_step_triton(q[:, t], k[:, t], v[:, t], S, z, normalize=normalize, out=out,
                                       log_decay=ld[:, t]).clone())
    tol = tol or TOL[dtype]
    assert rel_err(torch.stack(outs, 1), ro[:, prefill:]) <= tol
    assert rel_err(S, rS) <= 1e-5 and rel_err(z, rz) <= 1e-5


def check_continuation(B, T, H, Hk, K, V, split, dtype=torch.float32):
    """Two calls, the second starting from the first's final state, equal one call (outputs and states)."""
    inp = gated_inputs(B, T, H, Hk, K, V, dtype=dtype, seed=9, state=True)
    q, k, v, ld = (inp[n] for n in ("q", "k", "v", "log_decay"))
    run = lambda sl, init: linear_attention_triton(q[:, sl], k[:, sl], v[:, sl], initial_state=init,  # noqa: E731
                                                   output_final_state=True, log_decay=ld[:, sl])
    o, st = run(slice(None), inp["initial_state"])
    o1, st1 = run(slice(0, split), inp["initial_state"])
    o2, st2 = run(slice(split, None), st1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(torch.cat([o1, o2], 1), o) <= tol
    assert rel_err(st2[0], st[0]) <= tol and rel_err(st2[1], st[1]) <= tol


def check_zero_decay_is_plain(B, T, H, Hk, K, V, dtype, normalize=True):
    """``log_decay`` all zeros gives the plain kernels' outputs, state and gradients (and a finite d log_decay)."""
    inp = gated_inputs(B, T, H, Hk, K, V, dtype=dtype, seed=2, state=True, decay="zero")

    def plain_fn(x, norm):
        return linear_attention_triton(x["q"], x["k"], x["v"], normalize=norm, initial_state=x["initial_state"],
                                       output_final_state=True)

    o, st, g = _run(triton_fn, inp, normalize=normalize)
    po, pst, pg = _run(plain_fn, inp, normalize=normalize)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(o, po) <= tol and rel_err(st[0], pst[0]) <= tol and rel_err(st[1], pst[1]) <= tol
    for name in pg:
        if pg[name] is not None:
            assert rel_err(g[name], pg[name], floor=GRAD_FLOOR) <= 2 * tol, name
    assert torch.isfinite(g["log_decay"]).all()


def check_entry_points(B, T, H, Hk, K, V, monkeypatch):
    """``linear_attention`` and ``linear_attention_step`` with ``log_decay`` on the Triton backend run these
    kernels (and agree with the package's float64 reference)."""
    launched = []

    def spy(module, name):  # functools.wraps: the dispatcher reads the entry point's signature
        real = getattr(module, name)
        monkeypatch.setattr(module, name, functools.wraps(real)(lambda *a, **kw: launched.append(name) or real(*a, **kw)))

    spy(triton_linear, "_gated_fwd")
    spy(triton_step, "linear_step_triton")
    inp = gated_inputs(B, T + 1, H, Hk, K, V, dtype=torch.float32, seed=8)
    q, k, v, ld = (inp[n] for n in ("q", "k", "v", "log_decay"))
    o, st = linear_attention(q[:, :T], k[:, :T], v[:, :T], log_decay=ld[:, :T], initial_state=inp["initial_state"],
                             output_final_state=True, backend="triton")
    ref, ref_st = linear_attention(*(x.double() for x in (q, k, v)), log_decay=ld.double(), backend="reference",
                                   initial_state=tuple(x.double() for x in inp["initial_state"]),
                                   output_final_state=True)
    assert rel_err(o, ref[:, :T]) <= 1e-5
    last = linear_attention_step(q[:, T], k[:, T], v[:, T], st, log_decay=ld[:, T], backend="triton")
    assert launched == ["_gated_fwd", "linear_step_triton"]
    assert rel_err(last, ref[:, T]) <= 1e-5 and rel_err(st[0], ref_st[0]) <= 1e-5 and rel_err(st[1], ref_st[1]) <= 1e-5


# ---------------------------------------------------------------------------
# the closed form used at long sequences is the recurrence (CPU, no kernels)


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "num"])
@pytest.mark.parametrize("decay", ["mixed", "strong"])
def test_quadratic_form_is_the_recurrence(normalize, decay):
    inp = {n: (tuple(t.cpu() for t in x) if n == "initial_state" else x.cpu())
           for n, x in gated_inputs(2, 70, 4, 2, 8, 12, dtype=torch.float32, seed=4, decay=decay).items()}
    o, st, g = _run(lambda x, norm: quadratic(x["q"], x["k"], x["v"], x["log_decay"], normalize=norm,
                                              initial_state=x["initial_state"]), inp, normalize=normalize, dtype=F64)
    ro, rst, rg = _run(recurrence_fn, inp, normalize=normalize, dtype=F64)
    assert rel_err(o, ro) < 1e-12 and rel_err(st[0], rst[0]) < 1e-12 and rel_err(st[1], rst[1]) < 1e-12
    for name in rg:
        assert rel_err(g[name], rg[name]) < 1e-10, name


def test_bench_summary_has_the_gated_ratios():
    """`bench kernels`' summary: fla's chunk_simple_gla ms / our unnormalised gated ms, forward and fwd+bwd."""
    from linearize.bench.kernels import summarize

    def row(impl, passes, ms, bench="linear gated"):
        return {"bench": bench, "impl": impl, "T": 2048, "B": 16, "passes": passes, "ms": ms}

    (s,) = summarize([row("ours", "fwd", 0.5, bench="linear"), row("ours-unnorm", "fwd", 0.4),
                      row("ours-unnorm", "fwd+bwd", 2.0), row("fla simple_gla", "fwd", 0.6),
                      row("fla simple_gla", "fwd+bwd", 3.0), row("ours", "fwd", 0.9)])
    assert s["gated unnorm fwd vs fla simple_gla"] == pytest.approx(1.5)
    assert s["gated unnorm fwd+bwd vs fla simple_gla"] == pytest.approx(1.5)


# ---------------------------------------------------------------------------
# GPU: real shapes


KV_DIMS = [(64, 128), (128, 128)]
HEADS = [(4, 2), (4, 4)]


@gpu
@pytest.mark.parametrize("T", [1, 63, 64, 200, 1024])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "H{}Hk{}".format(*h))
@pytest.mark.parametrize("dims", KV_DIMS, ids=lambda d: "K{}V{}".format(*d))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_forward_backward(T, heads, dims, dtype):
    check_gated(2, T, *heads, *dims, dtype, state=T != 64)


@gpu
@pytest.mark.parametrize("T", [1, 65, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_unnormalised(T, dtype):
    check_gated(2, T, 4, 2, 64, 128, dtype, normalize=False)


@gpu
@pytest.mark.parametrize("segments", [1, 3], ids=["one-segment", "three-segments"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_forward_segments(segments, dtype, monkeypatch):
    """The forward cut into segments (each starting from the decayed sum of those before it) and not."""
    monkeypatch.setitem(triton_linear.CONFIG, "force_segments", segments)
    check_gated(1, 700, 4, 2, 128, 128, dtype)


@gpu
@pytest.mark.parametrize("bt", [32, 64])
def test_gated_chunk_sizes(bt, monkeypatch):
    """Forward and backward at another chunk size than the default (segment and chunk boundaries move)."""
    monkeypatch.setitem(triton_linear.CONFIG, "gated_fwd_bt", bt)
    monkeypatch.setitem(triton_linear.CONFIG, "gated_bwd_bt", bt)
    check_gated(2, 300, 4, 2, 128, 128, torch.bfloat16)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_strong_decay_stays_finite(dtype):
    """log_decay around -5 (a token is forgotten within a few steps) over many chunks: finite, and the spec's.
    d log_decay is then ~e^-5 of the terms of the final state's share it is a difference of (``<S_f, dS_f>`` less
    each key's part), so fp32 keeps about 1e-4 of it."""
    errs = check_gated(2, 1024, 4, 2, 128, 128, dtype, decay="strong",
                       tols={"log_decay": 1e-3} if dtype == torch.float32 else None)
    assert all(e < float("inf") for e in errs.values())


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_zero_decay_is_plain(dtype):
    check_zero_decay_is_plain(2, 200, 4, 2, 64, 128, dtype)


@gpu
@pytest.mark.parametrize("split", [64, 100])
def test_gated_continuation(split):
    check_continuation(2, 300, 4, 2, 128, 128, split)


@gpu
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "num"])
@pytest.mark.parametrize("bv,heads,H", [(0, 0, 4), (16, 0, 4), (0, 1, 4), (16, 2, 6)])
def test_gated_step_matches_forward(normalize, bv, heads, H, monkeypatch):
    """Decode steps after a gated prefill as one forward; bv = 16: several value blocks (z updated by the second
    kernel); heads = 1 / 2: the KV group's query heads over several programs (S updated by the second kernel)."""
    for key, value in {"small_grid_heads_per_sm": 0, "step_bv": bv, "linear_step_heads": heads,
                       "unfused_linear_step_split_min_group": 0}.items():
        monkeypatch.setitem(triton_step.CONFIG, key, value)
    check_step(2, 90, H, 2, 64, 128, prefill=70, normalize=normalize)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_normaliser_as_lane_reductions(dtype, monkeypatch):
    monkeypatch.setitem(triton_linear.CONFIG, "fwd_norm_mma", False)
    check_gated(2, 200, 4, 2, 128, 128, dtype)


@gpu
def test_gated_public_entry_points(monkeypatch):
    check_entry_points(2, 130, 4, 2, 64, 128, monkeypatch)


@gpu
def test_gated_step_from_empty_state_bf16():
    check_step(2, 40, 4, 2, 128, 128, prefill=0, dtype=torch.bfloat16)


# ---------------------------------------------------------------------------
# CPU: Triton's interpreter at tiny shapes (16-token chunks)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setitem(triton_linear.CONFIG, "gated_fwd_bt", 16)
    monkeypatch.setitem(triton_linear.CONFIG, "gated_bwd_bt", 16)


@interp
@pytest.mark.parametrize("shape", [(1, 1, 2, 2, 16, 32), (1, 40, 4, 2, 16, 32), (2, 33, 2, 2, 32, 16)],
                         ids=lambda s: "B{}T{}H{}Hk{}K{}V{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "num"])
def test_interp_gated_forward_backward(shape, dtype, normalize, small_chunks):
    check_gated(*shape, dtype, normalize=normalize)


@interp
@pytest.mark.parametrize("decay", ["strong", "mixed"])
def test_interp_gated_segments(decay, small_chunks, monkeypatch):
    monkeypatch.setitem(triton_linear.CONFIG, "force_segments", 3)
    check_gated(1, 40, 4, 2, 16, 32, torch.float32, decay=decay)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interp_gated_normaliser_as_lane_reductions(dtype, small_chunks, monkeypatch):
    """The forward whose normaliser is lane reductions (CONFIG fwd_norm_mma off; by default q.z and the update
    of z are tensor-core products)."""
    monkeypatch.setitem(triton_linear.CONFIG, "fwd_norm_mma", False)
    check_gated(1, 40, 4, 2, 16, 32, dtype)


@interp
def test_interp_gated_zero_decay_is_plain(small_chunks):
    check_zero_decay_is_plain(1, 40, 4, 2, 16, 32, torch.float32)


@interp
def test_interp_gated_public_entry_points(small_chunks, monkeypatch):
    check_entry_points(1, 40, 4, 2, 16, 32, monkeypatch)


@interp
def test_interp_gated_continuation(small_chunks):
    check_continuation(1, 40, 4, 2, 16, 32, split=20)


@interp
@pytest.mark.parametrize("bv,heads", [(0, 0), (16, 1)])
def test_interp_gated_step_matches_forward(bv, heads, small_chunks, monkeypatch):
    for key, value in {"step_bv": bv, "linear_step_heads": heads, "unfused_linear_step_split_min_group": 0}.items():
        monkeypatch.setitem(triton_step.CONFIG, key, value)
    check_step(1, 24, 4, 2, 16, 32, prefill=17)


@pytest.mark.slow  # the interpreter: about a minute of CPU
@pytest.mark.skipif(ON_GPU, reason="on a GPU the gpu tests run the kernels directly")
@pytest.mark.skipif(INTERPRET, reason="already interpreting: the interp tests run directly")
def test_gated_kernels_under_interpreter():
    assert run_under_interpreter(Path(__file__).resolve(), "interp_") == 21  # every interp test ran

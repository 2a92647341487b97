"""Gated (decayed) linear attention on the PyTorch paths: the reference against literal recurrences, the chunked
path against the float64 reference (outputs, final states, every gradient including ``log_decay``), continuation,
decode steps against one forward, padding, the Hedgehog variants and the argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from linearize.kernels import (
    empty_linear_state,
    empty_window_state,
    fold_tokens,
    linear_attention,
    linear_attention_hedgehog,
    linear_attention_step,
    linear_attention_step_hedgehog,
    window_linear_attention,
    window_linear_attention_hedgehog,
    window_linear_attention_step,
    window_linear_attention_step_hedgehog,
    window_state_from_prefill,
)
from linearize.kernels.reference import linear_attention_reference, window_linear_attention_reference
from linearize.kernels.testing import grads, leaves, linear_inputs, rel_err, window_inputs

F64 = torch.float64
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, F64: 1e-10}
GRAD_FLOOR = 1e-2  # RMS below which a reference gradient counts as ~0 (e.g. dq at T=1)
WINDOW_NAMES = ("q", "k", "fq", "fk", "v")


def with_decay(inp: dict, B: int, T: int, Hk: int, *, seed: int, low: float = -0.5, high: float = 0.0) -> dict:
    """``inp`` plus ``log_decay`` ``[B, T, Hk]`` uniform in ``[low, high]`` (float32; float64 for float64 inputs)."""
    g = torch.Generator().manual_seed(seed)
    dt = F64 if inp["v"].dtype == F64 else torch.float32
    return {**inp, "log_decay": (low + (high - low) * torch.rand(B, T, Hk, generator=g)).to(inp["v"].device, dt)}


def backward_random(o, state, seed=1):
    """Backpropagate seeded float64 random cotangents of the output and the final state."""
    g = torch.Generator().manual_seed(seed)
    loss = sum((x.double() * torch.randn(x.shape, generator=g, dtype=F64).to(x.device)).sum() for x in (o, *state))
    loss.backward()


def run_linear(backend, inp, *, normalize=True, dtype=None):
    x = leaves(inp, dtype=dtype)
    o, st = linear_attention(x["q"], x["k"], x["v"], normalize=normalize, initial_state=x.get("initial_state"),
                             output_final_state=True, backend=backend, log_decay=x["log_decay"])
    backward_random(o, st)
    return o, st, grads(x)


def run_window(backend, inp, *, window, dtype=None, key_mask=None):
    x = leaves(inp, dtype=dtype)
    o, st = window_linear_attention(*(x[n] for n in WINDOW_NAMES), x["window_factor"], window=window,
                                    initial_state=x.get("initial_state"), output_final_state=True, backend=backend,
                                    key_mask=key_mask, log_decay=x["log_decay"])
    backward_random(o, st)
    return o, st, grads(x)


def assert_matches(got, ref, dtype, *, skip=(), tol_g=None, tol_wf=None):
    """Outputs, final state and every gradient of a path against the float64 reference's (gradients within
    ``tol_g``, by default the outputs' tolerance). The window factor's gradient is a sum over the ``B*T`` rows of
    terms that cancel, so its floor scales with ``sqrt(B*T)`` and its tolerance is ``tol_wf`` (``2.5 tol_g``)."""
    (o, st, g), (ro, rst, rg) = got, ref
    tol = TOL[dtype]
    tol_g = tol_g or tol
    tol_wf = tol_wf or 2.5 * tol_g
    assert o.dtype == dtype and o.shape == ro.shape
    assert st[0].dtype == torch.float32 and st[1].dtype == torch.float32
    assert rel_err(o, ro) <= tol, ("o", rel_err(o, ro))
    for name, a, b in (("S", st[0], rst[0]), ("z", st[1], rst[1])):
        assert rel_err(a, b) <= tol, (name, rel_err(a, b))
    assert "log_decay" in rg
    for name in rg:
        if name in skip:
            continue
        assert g[name] is not None, name
        if name == "window_factor":
            e = rel_err(g[name], rg[name], floor=GRAD_FLOOR * o.shape[0] ** 0.5 * o.shape[1] ** 0.5)
            assert e <= tol_wf, (name, e)
            continue
        e = rel_err(g[name], rg[name], floor=GRAD_FLOOR)
        assert e <= tol_g, (name, e)


# ---------------------------------------------------------------------------
# the reference is the spec: a literal recurrence / per-query loop


@pytest.mark.parametrize("normalize", [True, False])
def test_reference_linear_is_the_recurrence(normalize):
    B, T, H, Hk, K, V = 2, 11, 4, 2, 3, 5
    inp = with_decay(linear_inputs(B, T, H, Hk, K, V, dtype=F64, state=True), B, T, Hk, seed=1, low=-2.0)
    q, k, v, ld = inp["q"], inp["k"], inp["v"], inp["log_decay"]
    S, z = (x.clone() for x in inp["initial_state"])
    o, (Sf, zf) = linear_attention_reference(q, k, v, normalize=normalize, initial_state=inp["initial_state"],
                                             output_final_state=True, log_decay=ld)
    for t in range(T):
        keep = ld[:, t].exp()  # [B, Hk]
        S = keep[..., None, None] * S + torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
        z = keep[..., None] * z + k[:, t]
        for h in range(H):
            hk = h // (H // Hk)
            num = torch.einsum("bk,bkv->bv", q[:, t, h], S[:, hk])
            exp = num / ((q[:, t, h] * z[:, hk]).sum(-1, keepdim=True) + 1e-6) if normalize else num
            torch.testing.assert_close(o[:, t, h], exp)
    torch.testing.assert_close(Sf, S)
    torch.testing.assert_close(zf, z)


def test_reference_window_is_the_formula():
    """Softmax over the window unchanged; linear weights (fq_i.fk_j) e^{b_i - b_j} for j <= i-W, the initial
    state e^{b_i}; final state decayed to position T-1-W."""
    B, T, H, Hk, D, K, V, W = 1, 13, 4, 2, 6, 3, 5, 4
    inp = with_decay(window_inputs(B, T, H, Hk, D, K, V, dtype=F64, state=True), B, T, Hk, seed=2, low=-1.0)
    q, k, fq, fk, v, ld = (inp[n] for n in (*WINDOW_NAMES, "log_decay"))
    wf = inp["window_factor"].double()
    S0, z0 = inp["initial_state"]
    eps = 1e-12
    o, (S, z) = window_linear_attention_reference(q, k, fq, fk, v, wf, window=W, initial_state=(S0, z0),
                                                  output_final_state=True, eps=eps, log_decay=ld)
    b = ld[0].cumsum(0)  # [T, Hk]
    sc = D ** -0.5
    for h in range(H):
        hk = h // (H // Hk)
        for i in range(T):
            e0 = math.exp(float(b[i, hk]))
            num = (1 - wf[h]) * e0 * (fq[0, i, h] @ S0[0, hk])
            den = (1 - wf[h]) * e0 * (fq[0, i, h] @ z0[0, hk]) + eps
            for j in range(i + 1):
                if i - j < W:
                    e = math.exp(sc * float(q[0, i, h] @ k[0, j, hk]))
                    num, den = num + wf[h] * e * v[0, j, hk], den + wf[h] * e
                else:
                    a = (fq[0, i, h] @ fk[0, j, hk]) * math.exp(float(b[i, hk] - b[j, hk]))
                    num, den = num + (1 - wf[h]) * a * v[0, j, hk], den + (1 - wf[h]) * a
            torch.testing.assert_close(o[0, i, h], num / den)
    n = T - W
    w = (b[n - 1] - b[:n]).exp()  # [n, Hk]: decayed to position T-1-W
    torch.testing.assert_close(S, b[n - 1].exp()[None, :, None, None] * S0
                               + torch.einsum("bthk,bthv,th->bhkv", fk[:, :n], v[:, :n], w))
    torch.testing.assert_close(z, b[n - 1].exp()[None, :, None] * z0 + torch.einsum("bthk,th->bhk", fk[:, :n], w))


def test_reference_window_short_sequence_keeps_the_state():
    """T <= W: no token leaves the window, the final state is the initial state unchanged."""
    inp = with_decay(window_inputs(2, 5, 2, 1, 8, 4, 4, dtype=F64, state=True), 2, 5, 1, seed=3)
    _, st = window_linear_attention_reference(*(inp[n] for n in (*WINDOW_NAMES, "window_factor")), window=8,
                                              initial_state=inp["initial_state"], output_final_state=True,
                                              log_decay=inp["log_decay"])
    assert torch.equal(st[0], inp["initial_state"][0]) and torch.equal(st[1], inp["initial_state"][1])


# ---------------------------------------------------------------------------
# chunked PyTorch path vs the float64 reference: outputs, final state, every gradient

LIN_SHAPES = [
    # B, T, H, Hk, K, V
    (2, 1, 2, 2, 16, 16),
    (1, 63, 4, 2, 16, 32),
    (2, 65, 4, 2, 32, 16),
    (1, 130, 4, 1, 16, 8),
]


@pytest.mark.parametrize("shape", LIN_SHAPES, ids=lambda s: "B{}T{}H{}Hk{}K{}V{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "num"])
def test_linear_chunked_vs_reference(shape, dtype, normalize):
    B, T, H, Hk, K, V = shape
    inp = with_decay(linear_inputs(B, T, H, Hk, K, V, dtype=dtype, state=T % 2 == 1, seed=T), B, T, Hk, seed=T)
    assert_matches(run_linear("torch", inp, normalize=normalize),
                   run_linear("reference", inp, normalize=normalize, dtype=F64), dtype)


WIN_SHAPES = [
    # B, T, H, Hk, D, K, V, W
    (2, 1, 2, 2, 16, 16, 16, 64),
    (1, 63, 4, 2, 16, 32, 16, 64),
    (2, 65, 4, 2, 32, 16, 32, 16),
    (1, 130, 4, 1, 16, 16, 8, 64),
    (1, 150, 2, 1, 16, 8, 16, 100),
]


@pytest.mark.parametrize("shape", WIN_SHAPES, ids=lambda s: "B{}T{}H{}Hk{}D{}K{}V{}W{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_chunked_vs_reference(shape, dtype):
    B, T, H, Hk, D, K, V, W = shape
    inp = with_decay(window_inputs(B, T, H, Hk, D, K, V, dtype=dtype, state=T % 2 == 1, seed=T), B, T, Hk,
                     seed=T, low=-2.0 / W)  # the linear part, older than W tokens, keeps a visible weight
    # with no token older than the window and no state, w's gradient is ~0 (only rounding is left to compare)
    skip = ("window_factor",) if T <= W and T % 2 == 0 else ()
    assert_matches(run_window("torch", inp, window=W), run_window("reference", inp, window=W, dtype=F64), dtype,
                   skip=skip)


def test_window_chunked_vs_reference_with_key_mask():
    """Padding keys take part in no sum and do not decay (NaN log decays at padding included)."""
    B, T, H, Hk, D, K, V, W = 2, 150, 4, 2, 16, 8, 8, 8
    inp = with_decay(window_inputs(B, T, H, Hk, D, K, V, state=True, seed=4), B, T, Hk, seed=4, low=-0.2)
    mask = torch.rand(B, T, generator=torch.Generator().manual_seed(5)) > 0.35
    mask[0, :40] = False
    inp["log_decay"] = inp["log_decay"].masked_fill(~mask.unsqueeze(-1), float("nan"))
    got = run_window("torch", inp, window=W, key_mask=mask)
    ref = run_window("reference", inp, window=W, dtype=F64, key_mask=mask)
    ref[2]["log_decay"] = ref[2]["log_decay"].nan_to_num(0.0)
    got[2]["log_decay"] = got[2]["log_decay"].nan_to_num(0.0)
    assert_matches(got, ref, torch.float32)


@pytest.mark.parametrize("kind", ["linear", "window"])
def test_strong_decay_stays_finite(kind):
    """log_decay ~ -5 (a state that forgets within a few tokens) over long runs: no overflow, no NaN."""
    B, T, Hk = 1, 260, 2
    if kind == "linear":
        inp = with_decay(linear_inputs(B, T, 4, Hk, 16, 8, state=True), B, T, Hk, seed=6, low=-6.0, high=-4.0)
        got, ref = run_linear("torch", inp), run_linear("reference", inp, dtype=F64)
    else:
        inp = with_decay(window_inputs(B, T, 4, Hk, 16, 16, 8, state=True), B, T, Hk, seed=6, low=-6.0, high=-4.0)
        got, ref = run_window("torch", inp, window=8), run_window("reference", inp, window=8, dtype=F64)
    assert all(torch.isfinite(x).all() for x in (got[0], *got[1], *got[2].values()))
    assert_matches(got, ref, torch.float32)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_zero_decay_is_the_ungated_path(backend):
    inp = linear_inputs(2, 70, 4, 2, 16, 8, state=True)
    zeros = torch.zeros(2, 70, 2)
    a = linear_attention(inp["q"], inp["k"], inp["v"], initial_state=inp["initial_state"], output_final_state=True,
                         backend=backend)
    b = linear_attention(inp["q"], inp["k"], inp["v"], initial_state=inp["initial_state"], output_final_state=True,
                         backend=backend, log_decay=zeros)
    for x, y in zip((a[0], *a[1]), (b[0], *b[1])):
        assert rel_err(y, x) < 1e-6
    win = window_inputs(2, 70, 4, 2, 16, 8, 8, state=True)
    args = [win[n] for n in (*WINDOW_NAMES, "window_factor")]
    a = window_linear_attention(*args, window=16, initial_state=win["initial_state"], output_final_state=True,
                                backend=backend)
    b = window_linear_attention(*args, window=16, initial_state=win["initial_state"], output_final_state=True,
                                backend=backend, log_decay=zeros)
    for x, y in zip((a[0], *a[1]), (b[0], *b[1])):
        assert rel_err(y, x) < 1e-6


# ---------------------------------------------------------------------------
# continuation


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_linear_continuation_two_halves(backend):
    B, T, Hk = 2, 130, 2
    inp = with_decay(linear_inputs(B, T, 4, Hk, 16, 8, state=True), B, T, Hk, seed=7)
    q, k, v, ld = inp["q"], inp["k"], inp["v"], inp["log_decay"]
    o, st = linear_attention(q, k, v, initial_state=inp["initial_state"], output_final_state=True, backend=backend,
                             log_decay=ld)
    o1, st1 = linear_attention(q[:, :57], k[:, :57], v[:, :57], initial_state=inp["initial_state"],
                               output_final_state=True, backend=backend, log_decay=ld[:, :57])
    o2, st2 = linear_attention(q[:, 57:], k[:, 57:], v[:, 57:], initial_state=st1, output_final_state=True,
                               backend=backend, log_decay=ld[:, 57:])
    assert rel_err(torch.cat([o1, o2], 1), o) < 1e-5
    assert rel_err(st2[0], st[0]) < 1e-5 and rel_err(st2[1], st[1]) < 1e-5


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("split", [3, 50, 90])
def test_window_continuation_prepend(backend, split):
    """The second part with the previous W tokens (and their log decays) prepended and the first part's state ==
    one whole."""
    W, T, Hk = 16, 120, 2
    inp = with_decay(window_inputs(1, T, 4, Hk, 16, 8, 8), 1, T, Hk, seed=8, low=-0.1)
    xs = [inp[n] for n in (*WINDOW_NAMES, "log_decay")]
    wf = inp["window_factor"]

    def call(lo, hi, state):
        *args, ld = (x[:, lo:hi] for x in xs)
        return window_linear_attention(*args, wf, window=W, initial_state=state, output_final_state=True,
                                       backend=backend, log_decay=ld)

    o, st = call(0, T, None)
    _, st1 = call(0, split, None)
    lo = max(split - W, 0)
    o2, st2 = call(lo, T, st1)
    assert rel_err(o2[:, split - lo :], o[:, split:]) < 1e-5
    assert rel_err(st2[0], st[0]) < 1e-5 and rel_err(st2[1], st[1]) < 1e-5


# ---------------------------------------------------------------------------
# decode steps == one forward


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("prefill", [0, 5, 70])
def test_linear_step_matches_forward(normalize, prefill):
    B, T, H, Hk, K, V = 2, 90, 4, 2, 16, 8
    inp = with_decay(linear_inputs(B, T, H, Hk, K, V), B, T, Hk, seed=9)
    q, k, v, ld = inp["q"], inp["k"], inp["v"], inp["log_decay"]
    o_full, st_full = linear_attention(q, k, v, normalize=normalize, output_final_state=True, backend="reference",
                                       log_decay=ld)
    if prefill:
        _, state = linear_attention(q[:, :prefill], k[:, :prefill], v[:, :prefill], normalize=normalize,
                                    output_final_state=True, backend="torch", log_decay=ld[:, :prefill])
    else:
        state = empty_linear_state(B, Hk, K, V)
    out = torch.full((B, H, V), float("nan"))
    outs = [linear_attention_step(q[:, t], k[:, t], v[:, t], state, normalize=normalize, log_decay=ld[:, t],
                                  out=out if t % 2 else None).clone() for t in range(prefill, T)]
    assert rel_err(torch.stack(outs, 1), o_full[:, prefill:]) < 1e-5
    assert rel_err(state[0], st_full[0]) < 1e-5 and rel_err(state[1], st_full[1]) < 1e-5


@pytest.mark.parametrize("gated", [True, False])
def test_fold_tokens_is_the_state_recurrence(gated):
    """``fold_tokens`` moves a state by n tokens as the reference's final state over prefix + tokens does; padding
    tokens add nothing and do not decay."""
    B, T, H, Hk, K, V, n = 2, 40, 2, 2, 8, 8, 13
    inp = with_decay(linear_inputs(B, T, H, Hk, K, V, dtype=F64), B, T, Hk, seed=3, low=-2.0)
    k, v, ld = inp["k"], inp["v"], inp["log_decay"] if gated else None
    _, (S, z) = linear_attention(k[:, :T - n], k[:, :T - n], v[:, :T - n], output_final_state=True,
                                 backend="reference", log_decay=None if ld is None else ld[:, :T - n])
    _, want = linear_attention(k, k, v, output_final_state=True, backend="reference", log_decay=ld)
    got = fold_tokens(S, z, k[:, T - n:], v[:, T - n:], None if ld is None else ld[:, T - n:])
    assert rel_err(got[0], want[0]) < 1e-12 and rel_err(got[1], want[1]) < 1e-12
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, 4:9] = False  # tokens of row 1 that are padding
    padded = fold_tokens(S, z, k[:, T - n:], v[:, T - n:], None if ld is None else ld[:, T - n:], mask)
    keep = torch.cat([torch.ones(B, T - n, dtype=torch.bool), mask], 1)
    _, want = linear_attention(k, k, v, output_final_state=True, backend="reference", key_mask=keep,
                               log_decay=None if ld is None else ld.masked_fill(~keep[..., None], 0.0))
    assert rel_err(padded[0], want[0]) < 1e-12 and rel_err(padded[1], want[1]) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prefill,W", [(0, 8), (5, 8), (8, 8), (37, 8), (70, 64), (3, 64)])
def test_window_step_matches_forward(prefill, W, dtype):
    B, T, H, Hk, D, K, V = 2, 85, 4, 2, 16, 8, 8
    inp = with_decay(window_inputs(B, T, H, Hk, D, K, V, dtype=dtype), B, T, Hk, seed=10, low=-2.0 / W)
    q, k, fq, fk, v, ld = (inp[n] for n in (*WINDOW_NAMES, "log_decay"))
    wf = inp["window_factor"]
    o_full, st_full = window_linear_attention(q, k, fq, fk, v, wf, window=W, output_final_state=True,
                                              backend="reference", log_decay=ld)
    if prefill:
        _, st = window_linear_attention(*(x[:, :prefill] for x in (q, k, fq, fk, v)), wf, window=W,
                                        output_final_state=True, backend="torch", log_decay=ld[:, :prefill])
        state = window_state_from_prefill(k[:, :prefill], fk[:, :prefill], v[:, :prefill], st, W,
                                          log_decay=ld[:, :prefill])
    else:
        state = empty_window_state(B, Hk, D, K, V, W, dtype=dtype, gated=True)
    out = torch.full((B, H, V), float("nan"), dtype=dtype)
    outs = [window_linear_attention_step(q[:, t], k[:, t], fq[:, t], fk[:, t], v[:, t], wf, state,
                                         log_decay=ld[:, t], out=out if t % 2 else None).clone()
            for t in range(prefill, T)]
    assert int(state.seen) == T
    assert rel_err(torch.stack(outs, 1), o_full[:, prefill:]) < TOL[dtype]
    assert rel_err(state.S, st_full[0]) < 1e-5 and rel_err(state.z, st_full[1]) < 1e-5


@pytest.mark.parametrize("kind", ["linear", "window"])
def test_left_padding_equals_unpadded(kind):
    """A left-padded row (NaN inputs and log decays at the padding) gets its unpadded sequence's outputs and state,
    in the forward and in the decode steps after it."""
    T, pad, steps, W, Hk = 30, 11, 12, 8, 2
    n = T + steps
    if kind == "linear":
        inp = with_decay(linear_inputs(2, n, 4, Hk, 16, 8, seed=11), 2, n, Hk, seed=11)
        names = ("q", "k", "v", "log_decay")
    else:
        inp = with_decay(window_inputs(2, n, 4, Hk, 16, 16, 8, seed=11), 2, n, Hk, seed=11)
        names = (*WINDOW_NAMES, "log_decay")
    wf = inp.get("window_factor")
    alone = {name: inp[name][1:, pad:] for name in names}
    batch = {name: torch.cat([inp[name][:1], torch.cat([torch.full_like(alone[name][:, :pad], float("nan")),
                                                        alone[name]], 1)], 0) for name in names}
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, :pad] = False

    def run(x, prompt, key_mask):
        *args, ld = (x[name][:, :prompt] for name in names)
        if kind == "linear":
            o, st = linear_attention(*args, output_final_state=True, backend="torch", key_mask=key_mask,
                                     log_decay=ld)
        else:
            o, st = window_linear_attention(*args, wf, window=W, output_final_state=True, backend="torch",
                                            key_mask=key_mask, log_decay=ld)
            st = window_state_from_prefill(x["k"][:, :prompt], x["fk"][:, :prompt], x["v"][:, :prompt], st, W,
                                           key_mask=key_mask, log_decay=ld)
        outs = []
        for t in range(prompt, prompt + steps):
            *row, ld_t = (x[name][:, t] for name in names)
            if kind == "linear":
                outs.append(linear_attention_step(*row, st, log_decay=ld_t))
            else:
                outs.append(window_linear_attention_step(*row, wf, st, log_decay=ld_t))
        return o, torch.stack(outs, 1), st

    o, steps_out, st = run(batch, T, mask)
    o1, steps1, st1 = run(alone, T - pad, None)
    assert rel_err(o[1:, pad:], o1) < 1e-5 and rel_err(steps_out[1:], steps1) < 1e-5
    for a, b in zip(st[:2], st1[:2]):
        assert rel_err(a[1:], b) < 1e-5


# ---------------------------------------------------------------------------
# Hedgehog variants: features first, then the gated path


def test_hedgehog_variants_are_features_then_gated():
    from linearize.kernels import hedgehog_features

    B, T, H, Hk, D, f, W = 2, 40, 4, 2, 8, 4, 8
    g = torch.Generator().manual_seed(12)
    q, k = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, Hk, D, generator=g)
    v = torch.randn(B, T, Hk, 8, generator=g)
    wq, wk = torch.randn(H, D, f, generator=g), torch.randn(Hk, D, f, generator=g)
    wf = torch.sigmoid(torch.randn(H, generator=g))
    ld = -torch.rand(B, T, Hk, generator=g)
    fq, fk = hedgehog_features(q, wq), hedgehog_features(k, wk)
    o_lin, st_lin = linear_attention(fq, fk, v, output_final_state=True, backend="reference", log_decay=ld)
    o_win, st_win = window_linear_attention(q, k, fq, fk, v, wf, window=W, output_final_state=True,
                                            backend="reference", log_decay=ld)
    o, st = linear_attention_hedgehog(q, k, v, wq, wk, output_final_state=True, log_decay=ld)
    assert rel_err(o, o_lin) < 1e-5 and rel_err(st[0], st_lin[0]) < 1e-5
    o, st = window_linear_attention_hedgehog(q, k, v, wf, wq, wk, window=W, output_final_state=True, log_decay=ld)
    assert rel_err(o, o_win) < 1e-5 and rel_err(st[0], st_win[0]) < 1e-5

    lin = empty_linear_state(B, Hk, 2 * f, 8)
    win = empty_window_state(B, Hk, D, 2 * f, 8, W, dtype=torch.float32, gated=True)
    lin_out = [linear_attention_step_hedgehog(q[:, t], k[:, t], v[:, t], wq, wk, lin, log_decay=ld[:, t])
               for t in range(T)]
    win_out = [window_linear_attention_step_hedgehog(q[:, t], k[:, t], v[:, t], wf, wq, wk, win, log_decay=ld[:, t])
               for t in range(T)]
    assert rel_err(torch.stack(lin_out, 1), o_lin) < 1e-5
    assert rel_err(torch.stack(win_out, 1), o_win) < 1e-5


# ---------------------------------------------------------------------------
# argument checks


def test_log_decay_must_be_float_b_t_hk():
    inp = linear_inputs(2, 10, 4, 2, 8, 8)
    q, k, v = inp["q"], inp["k"], inp["v"]
    with pytest.raises(ValueError, match=r"log_decay must be a floating-point tensor of shape \[2, 10, 2\]"):
        linear_attention(q, k, v, log_decay=torch.zeros(2, 10, 4))
    with pytest.raises(ValueError, match="log_decay"):
        linear_attention(q, k, v, log_decay=torch.zeros(2, 10, 2, dtype=torch.int64))
    win = window_inputs(2, 10, 4, 2, 8, 8, 8)
    with pytest.raises(ValueError, match="log_decay"):
        window_linear_attention(*(win[n] for n in (*WINDOW_NAMES, "window_factor")), window=4,
                                log_decay=torch.zeros(2, 10))
    with pytest.raises(ValueError, match=r"log_decay must be a floating-point tensor of shape \[2, 2\]"):
        linear_attention_step(q[:, 0], k[:, 0], v[:, 0], empty_linear_state(2, 2, 8, 8), log_decay=torch.zeros(2, 4))
    # a window state knows whether it is gated: a step with the other kind is refused
    args = [win[n][:, 0] for n in WINDOW_NAMES] + [win["window_factor"]]
    with pytest.raises(ValueError, match="without decay"):
        window_linear_attention_step(*args, empty_window_state(2, 2, 8, 8, 8, 4), log_decay=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="pass log_decay"):
        window_linear_attention_step(*args, empty_window_state(2, 2, 8, 8, 8, 4, gated=True))
    # another floating dtype is cast to float32: the same result as the float32 values
    ld = -torch.rand(2, 10, 2).bfloat16()
    a, _ = linear_attention(q, k, v, log_decay=ld, backend="torch")
    b, _ = linear_attention(q, k, v, log_decay=ld.float(), backend="torch")
    assert torch.equal(a, b)

"""Helpers shared by the kernel tests and the GPU check in ``linearize.bench``."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from . import (hedgehog_features_rounded, linear_attention, linear_attention_step, window_linear_attention,
               window_linear_attention_step, window_linear_attention_step_hedgehog, window_state_from_prefill)
from .sinks import gather_sinks


def rel_err(x: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """||x - ref|| / max(||ref||, floor * sqrt(numel)) in float64 (inf if x has NaN/inf).

    ``floor`` is an RMS level below which a reference counts as zero (for gradients
    that vanish mathematically, e.g. dq at T=1).
    """
    x64, r64 = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x64).all():
        return float("inf")
    den = max(r64.norm().item(), floor * max(r64.numel(), 1) ** 0.5, 1e-30)
    return (x64 - r64).norm().item() / den


def linear_inputs(B, T, H, Hk, K, V, *, dtype=torch.float32, device="cpu", seed=0, state=False):
    """Random non-negative q, k (feature-mapped-like), signed v; optional initial state."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.rand(B, T, H, K, generator=g).to(device=device, dtype=dtype)
    k = torch.rand(B, T, Hk, K, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(B, T, Hk, V, generator=g).to(device=device, dtype=dtype)
    out = {"q": q, "k": k, "v": v}
    if state:
        sdt = torch.float64 if dtype == torch.float64 else torch.float32
        S0 = (torch.rand(B, Hk, K, V, generator=g) * 4 - 1).to(device=device, dtype=sdt)
        z0 = (torch.rand(B, Hk, K, generator=g) * 4).to(device=device, dtype=sdt)
        out["initial_state"] = (S0, z0)
    return out


def window_inputs(B, T, H, Hk, D, K, V, *, dtype=torch.float32, device="cpu", seed=0, state=False, qk_std=2.0):
    """Random raw q, k (scores of a few units), positive fq, fk, signed v, window factor in (0,1)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = (torch.randn(B, T, H, D, generator=g) * qk_std).to(device=device, dtype=dtype)
    k = (torch.randn(B, T, Hk, D, generator=g) * qk_std / D ** 0.25).to(device=device, dtype=dtype)
    fq = torch.rand(B, T, H, K, generator=g).to(device=device, dtype=dtype)
    fk = torch.rand(B, T, Hk, K, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(B, T, Hk, V, generator=g).to(device=device, dtype=dtype)
    wf = torch.sigmoid(torch.randn(H, generator=g)).to(device=device)
    out = {"q": q, "k": k, "fq": fq, "fk": fk, "v": v, "window_factor": wf}
    if state:
        sdt = torch.float64 if dtype == torch.float64 else torch.float32
        S0 = (torch.rand(B, Hk, K, V, generator=g) * 4 - 1).to(device=device, dtype=sdt)
        z0 = (torch.rand(B, Hk, K, generator=g) * 4).to(device=device, dtype=sdt)
        out["initial_state"] = (S0, z0)
    return out


def leaves(inputs: Dict, names: Optional[Sequence[str]] = None, dtype: Optional[torch.dtype] = None):
    """Detached copies (optionally cast) that require grad; initial_state kept as a tuple."""
    out = {}
    for name, t in inputs.items():
        if name == "initial_state":
            out[name] = tuple(
                (x.detach().to(dtype) if dtype is not None else x.detach().clone()).requires_grad_() for x in t
            )
        else:
            x = t.detach().to(dtype) if dtype is not None else t.detach().clone()
            out[name] = x.requires_grad_()
    return out


def grads(inputs: Dict):
    """Flatten the .grad of every leaf in an inputs dict into name -> tensor."""
    out = {}
    for name, t in inputs.items():
        if name == "initial_state":
            out["S0"], out["z0"] = t[0].grad, t[1].grad
        else:
            out[name] = t.grad
    return out


F64 = torch.float64
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}


# ---------------------------------------------------------------------------
# generic checks: a path vs the float64 reference, outputs, final state and all gradients


def _backward_random(o, S, z, seed):
    """Backpropagate seeded float64 random cotangents of the output and the final state."""
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=g, dtype=F64).to(o.device)
    dS = torch.randn(S.shape, generator=g, dtype=F64).to(o.device)
    dz = torch.randn(z.shape, generator=g, dtype=F64).to(o.device)
    ((o.double() * do).sum() + (S.double() * dS).sum() + (z.double() * dz).sum()).backward()


def run_linear(backend, inp, *, normalize=True, dtype=None, seed=1):
    x = leaves(inp, dtype=dtype)
    o, (S, z) = linear_attention(
        x["q"], x["k"], x["v"], normalize=normalize, initial_state=x.get("initial_state"),
        output_final_state=True, backend=backend,
    )
    _backward_random(o, S, z, seed)
    return o, (S, z), grads(x)


# gradient tolerances per path and dtype; bf16 gradients of the Triton path use the
# stored bf16 output for the normaliser term (as FlashAttention does), so they are looser
TOL_G = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
GRAD_FLOOR = 1e-2  # RMS below which a reference gradient counts as ~0 (e.g. dq at T=1)


def check_linear(backend, B, T, H, Hk, K, V, dtype, *, normalize=True, state=False, tol=None, tol_g=None, device="cpu"):
    """Assert a path matches the float64 reference (outputs, final state, all gradients)."""
    inp = linear_inputs(B, T, H, Hk, K, V, dtype=dtype, state=state, seed=T * 7 + H, device=device)
    o, st, g = run_linear(backend, inp, normalize=normalize)
    ro, rst, rg = run_linear("reference", inp, normalize=normalize, dtype=F64)
    tol = tol or TOL[dtype]
    tol_g = tol_g or TOL_G[dtype]
    assert o.dtype == dtype and o.shape == (B, T, H, V)
    assert st[0].dtype == torch.float32 and st[1].dtype == torch.float32
    assert rel_err(o, ro) <= tol, ("o", rel_err(o, ro))
    assert rel_err(st[0], rst[0]) <= tol and rel_err(st[1], rst[1]) <= tol
    for name in rg:
        assert g[name] is not None, name
        e = rel_err(g[name], rg[name], floor=GRAD_FLOOR)
        assert e <= tol_g, (name, e)


def run_window(backend, inp, *, window, dtype=None, seed=1, key_mask=None):
    x = leaves(inp, dtype=dtype)
    if dtype is not None:
        x["window_factor"] = inp["window_factor"].detach().to(dtype).requires_grad_()
    o, (S, z) = window_linear_attention(
        x["q"], x["k"], x["fq"], x["fk"], x["v"], x["window_factor"], window=window,
        initial_state=x.get("initial_state"), output_final_state=True, backend=backend, key_mask=key_mask,
    )
    _backward_random(o, S, z, seed)
    return o, (S, z), grads(x)


def random_key_mask(B, T, *, seed=0, device="cpu") -> torch.Tensor:
    """``[B, T]`` bool with about a third of the keys False (padding), row 0 starting with a masked run."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.35
    mask[0, : max(1, T // 4)] = False
    return mask.to(device)


def check_window(backend, B, T, H, Hk, D, K, V, W, dtype, *, state=False, tol=None, tol_g=None, qk_std=2.0,
                 device="cpu", masked=False):
    """Assert a path matches the float64 reference (outputs, final state, all gradients); ``masked``: both with
    the same :func:`random_key_mask`."""
    inp = window_inputs(B, T, H, Hk, D, K, V, dtype=dtype, state=state, seed=T * 5 + W, qk_std=qk_std,
                        device=device)
    km = random_key_mask(B, T, seed=T, device=device) if masked else None
    o, st, g = run_window(backend, inp, window=W, key_mask=km)
    ro, rst, rg = run_window("reference", inp, window=W, dtype=F64, key_mask=km)
    tol = tol or TOL[dtype]
    tol_g = tol_g or TOL_G[dtype]
    assert o.dtype == dtype and o.shape == (B, T, H, V)
    assert rel_err(o, ro) <= tol, ("o", rel_err(o, ro))
    assert rel_err(st[0], rst[0]) <= tol and rel_err(st[1], rst[1]) <= tol
    for name in rg:
        assert g[name] is not None, name
        if name == "window_factor":
            # a sum over B*T rows; with no token older than the window (T <= W, no state) it is
            # ~0 mathematically (w only enters through eps) and only rounding is left to compare
            if T <= W and not state:
                continue
            e = rel_err(g[name], rg[name], floor=GRAD_FLOOR * (B * T) ** 0.5)
            assert e <= 2.5 * tol_g, (name, e)
            continue
        e = rel_err(g[name], rg[name], floor=GRAD_FLOOR)
        assert e <= tol_g, (name, e)




# ---------------------------------------------------------------------------
# padding: a left-padded row computes what its unpadded sequence computes


def check_left_padding(kind, backend, *, T=40, pad=13, H=4, Hk=2, D=16, K=16, V=16, W=8, steps=12,
                       dtype=torch.float32, device="cpu", step_backend=None, tol=None):
    """A batch of two rows, the second left-padded by ``pad`` tokens whose inputs are NaN: the forward (with
    ``key_mask``) and ``steps`` decode steps after it give each row what its sequence gives alone, outputs and
    states. ``kind``: ``"linear"`` or ``"window"``."""

    tol = tol or TOL[dtype]
    n = T + steps
    if kind == "linear":
        inp = linear_inputs(2, n, H, Hk, K, V, dtype=dtype, device=device, seed=3)
        names = ("q", "k", "v")
    else:
        inp = window_inputs(2, n, H, Hk, D, K, V, dtype=dtype, device=device, seed=3)
        names = ("q", "k", "fq", "fk", "v")
    long_seq = {name: inp[name][:1] for name in names}
    short = {name: inp[name][1:, pad:] for name in names}  # the second row: T - pad prompt tokens, then steps
    batch = {name: torch.cat([long_seq[name], torch.cat([torch.full_like(short[name][:, :pad], float("nan")),
                                                         short[name]], 1)], 0) for name in names}
    key_mask = torch.ones(2, T, dtype=torch.bool, device=device)
    key_mask[1, :pad] = False

    def prefill(x, prompt, mask):
        args = [x[name][:, :prompt] for name in names]
        if kind == "linear":
            o, st = linear_attention(*args, output_final_state=True, backend=backend, key_mask=mask)
            return o, st
        o, st = window_linear_attention(*args, inp["window_factor"], window=W, output_final_state=True,
                                        backend=backend, key_mask=mask)
        return o, window_state_from_prefill(x["k"][:, :prompt], x["fk"][:, :prompt], x["v"][:, :prompt], st, W,
                                            key_mask=mask)

    def decode(x, prompt, state):
        outs = []
        for t in range(prompt, prompt + steps):
            row = [x[name][:, t] for name in names]
            if kind == "linear":
                outs.append(linear_attention_step(*row, state, backend=step_backend))
            else:
                outs.append(window_linear_attention_step(*row, inp["window_factor"], state, backend=step_backend))
        return torch.stack(outs, 1)

    o, st = prefill(batch, T, key_mask)
    steps_out = decode(batch, T, st)
    for row, seq, prompt in ((0, long_seq, T), (1, short, T - pad)):
        o_alone, st_alone = prefill(seq, prompt, None)
        assert rel_err(o[row : row + 1, T - prompt :], o_alone) <= tol, (row, "prefill", rel_err(o[row:row + 1], o_alone))
        steps_alone = decode(seq, prompt, st_alone)
        assert rel_err(steps_out[row : row + 1], steps_alone) <= tol, (row, "steps")
        for a, b in zip(st[:2], st_alone[:2]):  # S, z (ring slots go by absolute position, which padding shifts)
            assert rel_err(a[row : row + 1], b) <= tol, (row, "state", tuple(a.shape))
    if kind == "window":
        # the ring held padding iff a padding position was among the last W; a step overwrites the oldest slot
        assert bool(st.keep.all()) == (pad <= T - W or steps >= pad + W - T), "padding left in the ring"


def check_sink_steps(backend, dtype, *, device="cpu", T=40, prefill=13, W=8, n_sinks=5, gated=False, hedgehog=False,
                     tol=None) -> None:
    """Prefill ``prefill`` tokens, then decode steps with attention sinks (the first ``n_sinks`` tokens; their key
    features kept out of the rings as the layers keep them) against the float64 reference's forward with
    ``sink_mask``. The steps get every sink from the start: a sink at a later position is out of reach
    (``t - pos < W``) until it leaves the window. ``hedgehog``: the Hedgehog steps (features inside the Triton
    step kernel)."""
    B, H, Hk, D, K, V = 2, 4, 2, 16, 16, 16
    inp = window_inputs(B, T, H, Hk, D, K if not hedgehog else D, V, dtype=dtype, device=device, seed=7)
    q, k, v, wf = inp["q"], inp["k"], inp["v"], inp["window_factor"]
    g = torch.Generator(device="cpu").manual_seed(8)
    wq = (torch.randn(H, D, K // 2, generator=g) * 0.3).to(device=device, dtype=dtype)
    wk = (torch.randn(Hk, D, K // 2, generator=g) * 0.3).to(device=device, dtype=dtype)
    fq, fk = ((hedgehog_features_rounded(q, wq), hedgehog_features_rounded(k, wk)) if hedgehog
              else (inp["fq"], inp["fk"]))
    ld = None
    if gated:
        ld = (-torch.rand(B, T, Hk, generator=g) * 0.3).to(device=device)
    sink = torch.zeros(B, T, dtype=torch.bool, device=device)
    sink[:, :n_sinks] = True
    d = lambda x: None if x is None else x.double()  # noqa: E731
    want, _ = window_linear_attention(d(q), d(k), d(fq), d(fk), d(v), d(wf), window=W, backend="reference",
                                      sink_mask=sink, log_decay=d(ld))
    fk = fk.masked_fill(sink.view(B, T, 1, 1), 0.0)
    _, final = window_linear_attention(q[:, :prefill], k[:, :prefill], fq[:, :prefill], fk[:, :prefill],
                                       v[:, :prefill], wf, window=W, backend="torch", output_final_state=True,
                                       log_decay=None if ld is None else ld[:, :prefill],
                                       sink_mask=sink[:, :prefill])
    state = window_state_from_prefill(k[:, :prefill], fk[:, :prefill], v[:, :prefill], final, W,
                                      log_decay=None if ld is None else ld[:, :prefill])
    sinks = gather_sinks(sink, n_sinks, k, v)
    tol = tol if tol is not None else (1e-4 if dtype == torch.float32 else 1e-2)
    for t in range(prefill, T):
        if hedgehog:
            o = window_linear_attention_step_hedgehog(q[:, t], k[:, t], v[:, t], wf, wq, wk, state, backend=backend,
                                                      sinks=sinks, feature_eps=1e-12)
        else:
            o = window_linear_attention_step(q[:, t], k[:, t], fq[:, t], fk[:, t], v[:, t], wf, state,
                                             backend=backend, sinks=sinks,
                                             log_decay=None if ld is None else ld[:, t])
        err = rel_err(o, want[:, t])
        assert err <= tol, f"step {t}: relative error {err:.2e} > {tol:.0e}"

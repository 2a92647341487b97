"""Helpers of the gated-delta-rule tests: inputs, a forward + backward with
random cotangents, the comparison of a path against the float64 reference."""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from .delta import gated_delta_rule
from .testing import rel_err

F64 = torch.float64
#: relative L2 error vs float64, outputs, final state and gradients
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2, F64: 1e-10}
GRAD_FLOOR = 1e-2  # RMS below which a reference gradient counts as ~0 (d log_decay at T = 1 without a state)
NAMES = ("q", "k", "v", "beta", "log_decay")


def delta_inputs(B, T, H, Hk, K, V, *, dtype=torch.float32, device="cpu", seed=0, state=True, decay="mixed"):
    """L2-normalised ``q``, ``k`` (as the layer gives them), signed ``v``, ``beta`` in (0, 1), log decays
    (``mixed``: magnitudes spread around 0.05, from 1e-3 to ~1; ``strong``: about -5; ``zero``), an optional
    fp32 initial state of unit-scale entries."""
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, K, generator=g), dim=-1)
    v = torch.randn(B, T, Hk, V, generator=g)
    beta = torch.sigmoid(torch.randn(B, T, Hk, generator=g))
    if decay == "mixed":
        ld = -(torch.randn(B, T, Hk, generator=g) - 3).exp()
    elif decay == "strong":
        ld = -5 + 0.5 * torch.randn(B, T, Hk, generator=g).clamp(-1, 1)
    else:
        ld = torch.zeros(B, T, Hk)
    out = {"q": q.to(device, dtype), "k": k.to(device, dtype), "v": v.to(device, dtype),
           "beta": beta.to(device, dtype), "log_decay": ld.to(device)}
    if state:
        out["initial_state"] = torch.randn(B, Hk, K, V, generator=g).to(device)
    return out


def leaves(inp: Dict, dtype: Optional[torch.dtype] = None) -> Dict:
    """Detached copies (cast to ``dtype`` when given) that require grad."""
    return {n: x.detach().to(dtype if dtype is not None else x.dtype).clone().requires_grad_() for n, x in inp.items()}


def run(fn: Callable, inp: Dict, *, dtype: Optional[torch.dtype] = None, seed: int = 1):
    """``fn(x) -> (o, S)`` on fresh leaves of ``inp``, then the backward of seeded float64 random cotangents of
    ``o`` and ``S``: ``(o, S, {name: grad})``."""
    x = leaves(inp, dtype)
    o, S = fn(x)
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=g, dtype=F64).to(o.device)
    dS = torch.randn(S.shape, generator=g, dtype=F64).to(o.device)
    ((o.double() * do).sum() + (S.double() * dS).sum()).backward()
    return o, S, {n: t.grad for n, t in x.items()}


def backend_fn(backend: Optional[str], scale: Optional[float] = None) -> Callable:
    """``fn`` for :func:`run`: :func:`gated_delta_rule` on ``backend`` with the final state."""
    def fn(x):
        return gated_delta_rule(*(x[n] for n in NAMES), scale=scale, initial_state=x.get("initial_state"),
                                output_final_state=True, backend=backend)

    return fn


def compare(got, ref, dtype: torch.dtype, *, tols: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """Errors of ``got = run(...)`` against ``ref = run(..., dtype=float64)`` on the reference: outputs, final
    state and every gradient, each within ``TOL[dtype]`` (``tols``: others by name); returns them all."""
    (o, S, g), (ro, rS, rg) = got, ref
    assert o.dtype == dtype and o.shape == ro.shape, (o.dtype, tuple(o.shape))
    assert S.dtype == torch.float32 and S.shape == rS.shape, (S.dtype, tuple(S.shape))
    assert set(g) == set(rg) and all(g[n] is not None for n in rg), {n: g[n] is None for n in g}
    errs = {"o": rel_err(o, ro), "S": rel_err(S, rS)}
    errs.update({"d" + n: rel_err(g[n], rg[n], floor=GRAD_FLOOR) for n in rg})
    bad = {n: e for n, e in errs.items() if not e <= (tols or {}).get(n, TOL[dtype])}
    assert not bad, (bad, errs)
    return errs


def check(backend: str, B, T, H, Hk, K, V, dtype, *, state=True, decay="mixed", device="cpu", tols=None,
          scale=None, qk_dtype=None) -> Dict[str, float]:
    """A backend against the float64 reference on :func:`delta_inputs` (see :func:`compare`); ``qk_dtype``: ``q``
    and ``k`` in another dtype than ``v`` and ``beta`` (the layer normalises them in fp32)."""
    inp = delta_inputs(B, T, H, Hk, K, V, dtype=dtype, device=device, seed=T * 7 + H + K, state=state, decay=decay)
    if qk_dtype is not None:
        inp["q"], inp["k"] = inp["q"].to(qk_dtype), inp["k"].to(qk_dtype)
    return compare(run(backend_fn(backend, scale), inp), run(backend_fn("reference", scale), inp, dtype=F64), dtype,
                   tols=tols)

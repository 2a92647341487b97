"""Helpers shared by the kernel tests and the GPU check in ``linearize.bench``."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (inf if x has NaN/inf)."""
    x64, r64 = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x64).all():
        return float("inf")
    den = r64.norm().item()
    return (x64 - r64).norm().item() / max(den, 1e-30)


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

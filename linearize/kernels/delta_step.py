"""One decode token of the gated delta rule in PyTorch, the state updated in place.

``S <- a S``; ``S <- S + beta k (v - S^T k)^T`` (the same as ``a (I - beta k k^T) S + beta k v^T``); ``o = S^T
(scale q)`` for every query head of the KV group. A few in-place ops that allocate only temporaries of fixed
shapes and never read a value back to the host, so a CUDA graph can capture them (the Triton step,
``triton_delta_step.py``, is the GPU default).
"""

from __future__ import annotations

from typing import Optional

import torch


def gated_delta_rule_step_torch(
    q: torch.Tensor,  # [B, H, K]
    k: torch.Tensor,  # [B, Hk, K]
    v: torch.Tensor,  # [B, Hk, V]
    beta: torch.Tensor,  # [B, Hk]
    log_decay: Optional[torch.Tensor],  # [B, Hk] (None: no decay)
    state: torch.Tensor,  # [B, Hk, K, V] fp32, updated in place
    scale: float,
    out: Optional[torch.Tensor] = None,  # [B, H, V]
) -> torch.Tensor:
    B, H, K = q.shape
    Hk, V = k.shape[1], v.shape[-1]
    G = H // Hk
    dt = state.dtype
    if log_decay is not None:
        state.mul_(log_decay.to(dt).exp()[..., None, None])
    kf = k.to(dt).unsqueeze(-2)  # [B, Hk, 1, K]
    delta = beta.to(dt)[..., None, None] * (v.to(dt).unsqueeze(-2) - kf @ state)  # [B, Hk, 1, V]
    state.view(B * Hk, K, V).baddbmm_(kf.reshape(B * Hk, K, 1), delta.reshape(B * Hk, 1, V))
    o = ((q.to(dt) * scale).reshape(B, Hk, G, K) @ state).reshape(B, H, V)
    if out is None:
        return o.to(v.dtype)
    out.copy_(o)
    return out

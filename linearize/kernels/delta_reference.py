"""The gated delta rule (Gated DeltaNet), token by token: the specification.

Per KV head, with the state ``S`` ``[K, V]``::

    S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        a_t = exp(log_decay_t)
    o_t = S_t^T (scale q_t)

``S_{-1}`` is the initial state (zeros without one). The state belongs to the key/value heads: with GQA query
head ``h`` reads the state of KV head ``h // (H / Hk)``. The caller L2-normalises ``q`` and ``k`` per head (the
layer does); nothing here assumes it. Every fast path in :mod:`linearize.kernels` for this rule is tested
against :func:`gated_delta_rule_reference`. The math of the chunked forms is in ``kernels/README.md``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def gated_delta_rule_reference(
    q: torch.Tensor,  # [B, T, H, K]
    k: torch.Tensor,  # [B, T, Hk, K]
    v: torch.Tensor,  # [B, T, Hk, V]
    beta: torch.Tensor,  # [B, T, Hk], in (0, 1)
    log_decay: Optional[torch.Tensor],  # [B, T, Hk], <= 0 (None: no decay)
    *,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,  # [B, Hk, K, V]
    output_final_state: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The recurrence, one token at a time, in float64 (autograd flows to every input).

    Returns ``(o [B, T, H, V] in v's dtype, S_{T-1} [B, Hk, K, V])``, the state float32 (float64 for float64
    inputs) when ``output_final_state``, else None. ``scale`` defaults to ``K ** -0.5``.
    """
    B, T, H, K = q.shape
    Hk, V = k.shape[2], v.shape[-1]
    G = H // Hk
    f64 = torch.float64
    scale = K ** -0.5 if scale is None else float(scale)
    S = initial_state.to(f64) if initial_state is not None else q.new_zeros(B, Hk, K, V, dtype=f64)
    outs = []
    for t in range(T):
        kt = k[:, t].to(f64)  # [B, Hk, K]
        bt = beta[:, t].to(f64)[..., None, None]  # [B, Hk, 1, 1]
        at = log_decay[:, t].to(f64).exp()[..., None, None] if log_decay is not None else 1.0
        kS = kt.unsqueeze(-2) @ S  # [B, Hk, 1, V]: k_t^T S_{t-1}
        S = at * (S - bt * kt.unsqueeze(-1) * kS) + bt * kt.unsqueeze(-1) * v[:, t].to(f64).unsqueeze(-2)
        qt = q[:, t].to(f64).reshape(B, Hk, G, K) * scale
        outs.append((qt @ S).reshape(B, H, V))  # o_t = S_t^T q_t per query head
    o = (torch.stack(outs, 1) if T else q.new_zeros(B, 0, H, V, dtype=f64)).to(v.dtype)
    if not output_final_state:
        return o, None
    sdt = f64 if f64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    return o, S.to(sdt)

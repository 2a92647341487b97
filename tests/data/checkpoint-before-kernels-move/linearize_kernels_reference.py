# Bundled by linearize 0.1.0 from linearize.kernels.reference for trust_remote_code=True; do not edit.
"""Naive quadratic reference implementations: the specification.

Every fast path in :mod:`linearize.kernels` is tested against these. They
materialise the full ``[B, H, T, T]`` score matrix, so use them only on short
sequences. Arithmetic runs in float64 when the inputs are float64, otherwise in
float32; outputs have ``v``'s dtype, states are float32 (float64 for float64
inputs). The math is written out in ``kernels/README.md``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

State = Tuple[torch.Tensor, torch.Tensor]


def _acc_dtype(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def drop_keys(key_mask: torch.Tensor, *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``xs`` (each ``[B, T, Hk, X]``) with zeros at the positions where ``key_mask [B, T]`` is False: such keys add
    nothing to a linear-attention sum (``torch.where``, so a non-finite padding row is dropped too)."""
    keep = key_mask.view(*key_mask.shape, 1, 1)
    return tuple(torch.where(keep, x, x.new_zeros(())) for x in xs)


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, T, Hk, D] -> [B, T, Hk * groups, D]; query head h reads KV head h // groups.
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def hedgehog_features(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Hedgehog feature map ``[softmax(x W), softmax(-x W)]`` per head, clamped to ``>= eps`` (0 = no clamp).

    ``x`` ``[B, T, H, D]``, ``weight`` ``[H, D, f]`` -> ``[B, T, H, 2f]`` in ``x``'s dtype (the caller picks
    the compute precision). The spec of :class:`linearize.feature_maps.HedgehogFeatureMap` and of the fused
    map inside :func:`linearize.kernels.window_linear_attention_hedgehog`.
    """
    u = torch.einsum("bthd,hdf->bthf", x, weight.to(x.dtype))  # [B, T, H, f]
    out = torch.cat([torch.softmax(u, dim=-1), torch.softmax(-u, dim=-1)], dim=-1)
    return out.clamp(min=eps) if eps > 0 else out  # [B, T, H, 2f]


def hedgehog_features_rounded(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """:func:`hedgehog_features` as the layers compute them: fp32 math (fp64 for fp64 inputs), rounded to ``x``'s
    dtype."""
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    return hedgehog_features(x.to(cd), weight.to(cd), eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for the two halves ``x1``, ``x2`` of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary position embedding ``x * cos + rotate_half(x) * sin`` of ``q`` ``[B, T, H, D]`` and ``k``
    ``[B, T, Hk, D]`` with ``cos`` / ``sin`` ``[B or 1, T, R]`` (the Llama convention), in the inputs' dtype
    as the original attention modules compute it. Tables narrower than the heads (``R < D``: partial rotary, as in
    Phi-4-mini) rotate the first ``R`` dims of each head and pass the rest through."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, R]
    R = cos.shape[-1]
    if R < q.shape[-1]:
        (qr, qp), (kr, kp) = q.split([R, q.shape[-1] - R], -1), k.split([R, k.shape[-1] - R], -1)
        return (torch.cat([qr * cos + rotate_half(qr) * sin, qp], -1),
                torch.cat([kr * cos + rotate_half(kr) * sin, kp], -1))
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def linear_attention_reference(
    q: torch.Tensor,  # [B, T, H, K]
    k: torch.Tensor,  # [B, T, Hk, K]
    v: torch.Tensor,  # [B, T, Hk, V]
    *,
    normalize: bool = True,
    eps: float = 1e-6,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
) -> Tuple[torch.Tensor, Optional[State]]:
    """Causal linear attention, quadratic form.

    ``o_t = q_t . S_t / (q_t . z_t + eps)`` with ``S_t = S_0 + sum_{j<=t} k_j v_j^T``
    and ``z_t = z_0 + sum_{j<=t} k_j``; the numerator alone when ``normalize=False``.
    """
    B, T, H, K = q.shape
    Hk = k.shape[2]
    G = H // Hk
    dt = _acc_dtype(q, k, v)
    qf = q.to(dt)
    kf = _expand_kv(k.to(dt), G)
    vf = _expand_kv(v.to(dt), G)
    a = torch.einsum("bihk,bjhk->bhij", qf, kf)  # [B, H, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    a = a.masked_fill(~causal, 0.0)
    num = torch.einsum("bhij,bjhv->bihv", a, vf)  # [B, T, H, V]
    den = a.sum(-1).transpose(1, 2)  # [B, T, H]
    if initial_state is not None:
        S0, z0 = initial_state
        S0 = _expand_kv(S0.to(dt).unsqueeze(1), G).squeeze(1)  # [B, H, K, V]
        z0 = _expand_kv(z0.to(dt).unsqueeze(1), G).squeeze(1)  # [B, H, K]
        num = num + torch.einsum("bthk,bhkv->bthv", qf, S0)
        den = den + torch.einsum("bthk,bhk->bth", qf, z0)
    o = num / (den.unsqueeze(-1) + eps) if normalize else num
    state = None
    if output_final_state:
        sdt = torch.float64 if dt == torch.float64 else torch.float32
        S = torch.einsum("bthk,bthv->bhkv", k.to(sdt), v.to(sdt))
        z = k.to(sdt).sum(1)
        if initial_state is not None:
            S = S + initial_state[0].to(sdt)
            z = z + initial_state[1].to(sdt)
        state = (S, z)
    return o.to(v.dtype), state


def window_linear_attention_reference(
    q: torch.Tensor,  # [B, T, H, D] raw (post-rotary) queries
    k: torch.Tensor,  # [B, T, Hk, D] raw keys
    fq: torch.Tensor,  # [B, T, H, K] feature-mapped queries
    fk: torch.Tensor,  # [B, T, Hk, K] feature-mapped keys
    v: torch.Tensor,  # [B, T, Hk, V]
    window_factor: torch.Tensor,  # [H], values in (0, 1)
    *,
    window: int = 64,
    scale: Optional[float] = None,
    eps: float = 1e-12,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    key_mask: Optional[torch.Tensor] = None,  # [B, T] bool, False = a padding token
) -> Tuple[torch.Tensor, Optional[State]]:
    """LoLCATs sliding-window hybrid, quadratic form.

    Query ``i`` attends with exact softmax to ``{j : i-W < j <= i}`` and with
    linear attention to ``{j <= i-W}`` (plus the initial state), one shared
    normaliser, mixed per head by ``window_factor``. Computed with the shift
    ``m_i = max(0, max_window s_ij)`` applied to both parts (and to ``eps``) so the
    result equals the unshifted formula exactly. Keys where ``key_mask`` is False
    take part in neither sum (the window stays ``W`` positions wide).
    """
    B, T, H, D = q.shape
    Hk = k.shape[2]
    G = H // Hk
    W = int(window)
    if scale is None:
        scale = D ** -0.5
    dt = _acc_dtype(q, k, fq, fk, v)
    if key_mask is not None:
        k, fk, v = drop_keys(key_mask, k, fk, v)
    qf, kf = q.to(dt), _expand_kv(k.to(dt), G)
    fqf, fkf = fq.to(dt), _expand_kv(fk.to(dt), G)
    vf = _expand_kv(v.to(dt), G)
    i = torch.arange(T, device=q.device)
    diff = i[:, None] - i[None, :]  # i - j
    win = (diff >= 0) & (diff < W)  # [T, T]
    lin = diff >= W
    if key_mask is not None:
        win = win & key_mask.view(B, 1, 1, T)  # [B, 1, T, T]
    s = torch.einsum("bihd,bjhd->bhij", qf, kf) * scale  # [B, H, T, T]
    s = s.masked_fill(~win, float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_min(0.0).detach()  # [B, H, T, 1]
    em = torch.exp(-m)
    p = torch.exp(s - m)  # zeros outside the window
    a = torch.einsum("bihk,bjhk->bhij", fqf, fkf).masked_fill(~lin, 0.0) * em
    w = window_factor.to(dt).view(1, H, 1)
    num_w = torch.einsum("bhij,bjhv->bhiv", p, vf)
    num_l = torch.einsum("bhij,bjhv->bhiv", a, vf)
    den_w = p.sum(-1)
    den_l = a.sum(-1)
    if initial_state is not None:
        S0, z0 = initial_state
        S0 = _expand_kv(S0.to(dt).unsqueeze(1), G).squeeze(1)
        z0 = _expand_kv(z0.to(dt).unsqueeze(1), G).squeeze(1)
        num_l = num_l + torch.einsum("bthk,bhkv->bhtv", fqf, S0) * em
        den_l = den_l + torch.einsum("bthk,bhk->bht", fqf, z0) * em[..., 0]
    num = w.unsqueeze(-1) * num_w + (1 - w.unsqueeze(-1)) * num_l
    den = w * den_w + (1 - w) * den_l + eps * em[..., 0]
    o = (num / den.unsqueeze(-1)).transpose(1, 2)  # [B, T, H, V]
    state = None
    if output_final_state:
        sdt = torch.float64 if dt == torch.float64 else torch.float32
        n = max(T - W, 0)
        S = torch.einsum("bthk,bthv->bhkv", fk[:, :n].to(sdt), v[:, :n].to(sdt))
        z = fk[:, :n].to(sdt).sum(1)
        if initial_state is not None:
            S = S + initial_state[0].to(sdt)
            z = z + initial_state[1].to(sdt)
        state = (S, z)
    return o.to(v.dtype), state

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


def needs_grad(*tensors) -> bool:
    """Whether autograd will want gradients of any of ``tensors`` (None entries allowed)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def drop_keys(key_mask: torch.Tensor, *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``xs`` (each ``[B, T, Hk, X]``) with zeros at the positions where ``key_mask [B, T]`` is False: such keys add
    nothing to a linear-attention sum (``torch.where``, so a non-finite padding row is dropped too)."""
    keep = key_mask.view(*key_mask.shape, 1, 1)
    return tuple(torch.where(keep, x, x.new_zeros(())) for x in xs)


def drop_decay(key_mask: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
    """``log_decay`` ``[B, T, Hk]`` with zeros where ``key_mask`` ``[B, T]`` is False: a padding token neither adds to
    a gated state nor decays it (``torch.where``, so a non-finite padding value is dropped too)."""
    return torch.where(key_mask.unsqueeze(-1), log_decay, log_decay.new_zeros(()))


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, T, Hk, D] -> [B, T, Hk * groups, D]; query head h reads KV head h // groups.
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def hedgehog_features(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Hedgehog feature map ``[softmax(x W), softmax(-x W)]`` per head, clamped to ``>= eps`` (0 = no clamp).

    ``x`` ``[B, T, H, D]``, ``weight`` ``[H, D, f]`` -> ``[B, T, H, 2f]`` in ``x``'s dtype (the caller picks
    the compute precision). The spec of :class:`linearize.model.feature_maps.HedgehogFeatureMap` and of the fused
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


def decay_matrix(log_decay: torch.Tensor, groups: int, dt: torch.dtype) -> torch.Tensor:
    """``e^{b_i - b_j}`` for ``j <= i`` (0 above the diagonal), ``b`` the cumulative sum of ``log_decay``
    ``[B, T, Hk]`` over time, per query head: ``[B, H, T, T]`` in ``dt``. Only differences are exponentiated,
    so nothing overflows."""
    b = _expand_kv(log_decay.to(dt).unsqueeze(-1), groups)[..., 0].cumsum(1).transpose(1, 2)  # [B, H, T]
    diff = b.unsqueeze(-1) - b.unsqueeze(-2)  # [B, H, T, T]: b_i - b_j
    T = b.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=b.device).tril()
    return diff.masked_fill(~causal, float("-inf")).exp()


def decayed_sum(log_decay: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, initial_state: Optional[State],
                dt: torch.dtype) -> State:
    """The gated linear state of all ``T`` tokens of ``fk`` ``[B, T, Hk, K]``, ``v`` ``[B, T, Hk, V]`` at the last
    position: ``(sum_j e^{b_{T-1} - b_j} fk_j v_j^T + e^{b_{T-1}} S_0, same for z)`` in ``dt``. The exponents are
    suffix sums of ``log_decay`` ``[B, T, Hk]`` (``b_{T-1} - b_j = sum_{j<s<=T-1} log_decay_s``), accumulated from the
    end so that the weights that matter (near the end) are exact."""
    ld = log_decay.to(dt)
    tail = ld.flip(1).cumsum(1).flip(1) - ld  # [B, T, Hk]: sum_{s>j} ld_s
    w = tail.exp().unsqueeze(-1)  # [B, T, Hk, 1], <= 1
    fkd = fk.to(dt) * w
    S = torch.einsum("bthk,bthv->bhkv", fkd, v.to(dt))
    z = fkd.sum(1)
    if initial_state is not None:
        total = ld.sum(1).exp()  # [B, Hk]: e^{b_{T-1}}
        S = S + total[..., None, None] * initial_state[0].to(dt)
        z = z + total[..., None] * initial_state[1].to(dt)
    return S, z


def window_final_state(fk: torch.Tensor, v: torch.Tensor, window: int, initial_state: Optional[State],
                       log_decay: Optional[torch.Tensor], dt: torch.dtype) -> State:
    """A window hybrid's final state: the linear state of the tokens ``j <= T-1-W`` of ``fk`` ``[B, T, Hk, K]``,
    ``v`` ``[B, T, Hk, V]`` plus ``initial_state`` (decayed to position ``T-1-W`` with ``log_decay``), float32
    (float64 when ``dt`` is)."""
    sdt = torch.float64 if dt == torch.float64 else torch.float32
    n = max(fk.shape[1] - int(window), 0)
    if log_decay is not None:
        return decayed_sum(log_decay[:, :n], fk[:, :n], v[:, :n], initial_state, sdt)
    S = torch.einsum("bthk,bthv->bhkv", fk[:, :n].to(sdt), v[:, :n].to(sdt))
    z = fk[:, :n].to(sdt).sum(1)
    if initial_state is not None:
        S = S + initial_state[0].to(sdt)
        z = z + initial_state[1].to(sdt)
    return S, z


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for the two halves ``x1``, ``x2`` of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


#: the rounding orders of the RMS norms of the families (:func:`rms_norm_reference`)
RMS_NORM_FORMS = ("llama", "olmo2", "gemma")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str) -> torch.Tensor:
    """RMS norm of ``x [..., N]`` with ``weight [N]``, step by step as the families' modules compute it: the mean
    of squares and the scaling in fp32 (float64 stays float64), then ``llama``: round to ``x``'s dtype and multiply
    by ``weight`` in the promoted dtype; ``olmo2``: multiply by ``weight`` in fp32, round; ``gemma``: multiply by
    ``1 + weight`` in fp32, round."""
    if form not in RMS_NORM_FORMS:
        raise ValueError(f"form must be one of {RMS_NORM_FORMS}, got {form!r}")
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if form == "llama":
        return weight * h.to(x.dtype)
    if form == "olmo2":
        return (weight * h).to(x.dtype)
    return (h * (1.0 + weight.to(acc))).to(x.dtype)


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
    log_decay: Optional[torch.Tensor] = None,  # [B, T, Hk], <= 0
) -> Tuple[torch.Tensor, Optional[State]]:
    """Causal linear attention, quadratic form.

    ``o_t = q_t . S_t / (q_t . z_t + eps)`` with ``S_t = S_0 + sum_{j<=t} k_j v_j^T``
    and ``z_t = z_0 + sum_{j<=t} k_j``; the numerator alone when ``normalize=False``.
    With ``log_decay``: ``S_t = e^{log_decay_t} S_{t-1} + k_t v_t^T`` (and ``z``), i.e. the weight of key ``j``
    at query ``t`` is ``e^{b_t - b_j}`` and that of the initial state ``e^{b_t}``, ``b`` = cumulative sum of
    ``log_decay``.
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
    if log_decay is not None:
        a = a * decay_matrix(log_decay, G, dt)
    num = torch.einsum("bhij,bjhv->bihv", a, vf)  # [B, T, H, V]
    den = a.sum(-1).transpose(1, 2)  # [B, T, H]
    if initial_state is not None:
        S0, z0 = initial_state
        S0 = _expand_kv(S0.to(dt).unsqueeze(1), G).squeeze(1)  # [B, H, K, V]
        z0 = _expand_kv(z0.to(dt).unsqueeze(1), G).squeeze(1)  # [B, H, K]
        s_num = torch.einsum("bthk,bhkv->bthv", qf, S0)
        s_den = torch.einsum("bthk,bhk->bth", qf, z0)
        if log_decay is not None:  # e^{b_t}: the initial state decays from the position before token 0
            e0 = _expand_kv(log_decay.to(dt).cumsum(1).exp().unsqueeze(-1), G)[..., 0]  # [B, T, H]
            s_num, s_den = s_num * e0.unsqueeze(-1), s_den * e0
        num = num + s_num
        den = den + s_den
    o = num / (den.unsqueeze(-1) + eps) if normalize else num
    state = None
    if output_final_state:
        sdt = torch.float64 if dt == torch.float64 else torch.float32
        if log_decay is not None:
            return o.to(v.dtype), decayed_sum(log_decay, k, v, initial_state, sdt)
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
    log_decay: Optional[torch.Tensor] = None,  # [B, T, Hk], <= 0
    sink_mask: Optional[torch.Tensor] = None,  # [B, T] bool, True = an attention sink
    return_lse: bool = False,
):
    """LoLCATs sliding-window hybrid, quadratic form.

    Query ``i`` attends with exact softmax to ``{j : i-W < j <= i}`` and with
    linear attention to ``{j <= i-W}`` (plus the initial state), one shared
    normaliser, mixed per head by ``window_factor``. Computed with the shift
    ``m_i = max(0, max_window s_ij)`` applied to both parts (and to ``eps``) so the
    result equals the unshifted formula exactly. Keys where ``key_mask`` is False
    take part in neither sum (the window stays ``W`` positions wide) and do not decay.
    With ``log_decay`` the linear weights are ``(fq_i.fk_j) e^{b_i - b_j}``, the initial state's ``e^{b_i}``
    (``b`` = cumulative sum of ``log_decay``); the softmax part does not decay.
    Keys where ``sink_mask`` is True (attention sinks) are in the softmax part of every later query, window or
    not, and in no linear sum or state. ``return_lse``: a third result, ``lse [B, T, H]`` fp32, the log of the
    shared normaliser (unshifted: ``log(den) + m``), for merging further softmax keys.
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
        if log_decay is not None:
            log_decay = drop_decay(key_mask, log_decay)
    if sink_mask is not None:  # sinks add nothing to the linear part or the state
        (fk,) = drop_keys(~sink_mask, fk)
    qf, kf = q.to(dt), _expand_kv(k.to(dt), G)
    fqf, fkf = fq.to(dt), _expand_kv(fk.to(dt), G)
    vf = _expand_kv(v.to(dt), G)
    i = torch.arange(T, device=q.device)
    diff = i[:, None] - i[None, :]  # i - j
    win = (diff >= 0) & (diff < W)  # [T, T]
    lin = diff >= W
    if sink_mask is not None:
        win = win | (sink_mask.view(B, 1, 1, T) & (diff >= 0))  # [B, 1, T, T]
    if key_mask is not None:
        win = win & key_mask.view(B, 1, 1, T)  # [B, 1, T, T]
    s = torch.einsum("bihd,bjhd->bhij", qf, kf) * scale  # [B, H, T, T]
    s = s.masked_fill(~win, float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_min(0.0).detach()  # [B, H, T, 1]
    em = torch.exp(-m)
    p = torch.exp(s - m)  # zeros outside the window
    a = torch.einsum("bihk,bjhk->bhij", fqf, fkf).masked_fill(~lin, 0.0) * em
    if log_decay is not None:
        a = a * decay_matrix(log_decay, G, dt)
    w = window_factor.to(dt).view(1, H, 1)
    num_w = torch.einsum("bhij,bjhv->bhiv", p, vf)
    num_l = torch.einsum("bhij,bjhv->bhiv", a, vf)
    den_w = p.sum(-1)
    den_l = a.sum(-1)
    if initial_state is not None:
        S0, z0 = initial_state
        S0 = _expand_kv(S0.to(dt).unsqueeze(1), G).squeeze(1)
        z0 = _expand_kv(z0.to(dt).unsqueeze(1), G).squeeze(1)
        e0 = em  # [B, H, T, 1]
        if log_decay is not None:  # e^{b_i}: the initial state decays from the position before token 0
            e0 = em * _expand_kv(log_decay.to(dt).cumsum(1).exp().unsqueeze(-1), G)[..., 0].transpose(1, 2)[..., None]
        num_l = num_l + torch.einsum("bthk,bhkv->bhtv", fqf, S0) * e0
        den_l = den_l + torch.einsum("bthk,bhk->bht", fqf, z0) * e0[..., 0]
    num = w.unsqueeze(-1) * num_w + (1 - w.unsqueeze(-1)) * num_l
    den = w * den_w + (1 - w) * den_l + eps * em[..., 0]
    o = (num / den.unsqueeze(-1)).transpose(1, 2)  # [B, T, H, V]
    state = window_final_state(fk, v, W, initial_state, log_decay, dt) if output_final_state else None
    if return_lse:
        lse = (den.log() + m[..., 0]).transpose(1, 2)  # [B, T, H]
        return o.to(v.dtype), state, lse.to(torch.float64 if dt == torch.float64 else torch.float32)
    return o.to(v.dtype), state

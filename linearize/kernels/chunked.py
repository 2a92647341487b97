"""Chunked PyTorch implementations (the default path off CUDA, used for CPU training).

Tokens are grouped in chunks of ``C`` (64). Inside a chunk the quadratic form
is used (masked matmuls); across chunks the running state
``S = sum k v^T`` / ``z = sum k`` is carried by a cumulative sum over per-chunk
states. GQA is handled by folding the ``G = H / Hk`` query heads of a KV group
into the rows of one matmul (``[G*C, K] @ [K, C]``), so K/V are never repeated.
Everything runs in float32 (float64 for float64 inputs); autograd is PyTorch's.

With ``log_decay`` (gated) the decays inside a chunk come from chunk-local cumulative sums ``c`` of
``log_decay``: only ``e^{c_i - c_j}`` (``j <= i``), ``e^{c_i}`` and ``e^{c_last - c_j}`` are formed, all ``<= 1``;
across chunks the state is carried by a scan over chunks (``S <- e^{c_last} S + chunk state``), since a
cumulative sum cannot carry a decay.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .reference import drop_decay, drop_keys, window_final_state

State = Tuple[torch.Tensor, torch.Tensor]

CHUNK = 64


def _acc_dtype(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _pad_t(x: torch.Tensor, n: int) -> torch.Tensor:
    # pad dim 1 (time) at the end with n zeros
    return F.pad(x, (0, 0, 0, 0, 0, n)) if n else x


def _q_chunks(x: torch.Tensor, Hk: int, C: int, dt: torch.dtype) -> torch.Tensor:
    """[B, T', H, D] (T' = N*C) -> [B, Hk, N, G*C, D] (row = g*C + i)."""
    B, Tp, H, D = x.shape
    N, G = Tp // C, H // Hk
    x = x.to(dt).view(B, N, C, Hk, G, D).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(B, Hk, N, G * C, D)


def _kv_chunks(x: torch.Tensor, C: int, dt: torch.dtype) -> torch.Tensor:
    """[B, T', Hk, D] -> [B, Hk, N, C, D]."""
    B, Tp, Hk, D = x.shape
    return x.to(dt).view(B, Tp // C, C, Hk, D).permute(0, 3, 1, 2, 4)


def _o_unchunk(o: torch.Tensor, G: int, C: int, T: int) -> torch.Tensor:
    """[B, Hk, N, G*C, V] -> [B, T, H, V]."""
    B, Hk, N, _, V = o.shape
    o = o.view(B, Hk, N, G, C, V).permute(0, 2, 4, 1, 3, 5).reshape(B, N * C, Hk * G, V)
    return o[:, :T]


def _decay_chunks(log_decay: torch.Tensor, C: int, dt: torch.dtype) -> torch.Tensor:
    """[B, T', Hk] (T' = N*C) -> [B, Hk, N, C]."""
    B, Tp, Hk = log_decay.shape
    return log_decay.to(dt).view(B, Tp // C, C, Hk).permute(0, 3, 1, 2)


def _rows(x: torch.Tensor, G: int) -> torch.Tensor:
    """[B, Hk, N, C, ...] -> [B, Hk, N, G*C, ...]: one copy per query head of the group (row g*C + i)."""
    return torch.cat([x] * G, dim=3) if G > 1 else x


def _gated_chunk_states(kc: torch.Tensor, vc: torch.Tensor, cum: torch.Tensor,
                        initial_state: Optional[State]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gated states at the chunk boundaries by a scan over chunks.

    ``kc`` [B, Hk, N, C, K], ``vc`` [B, Hk, N, C, V], ``cum`` [B, Hk, N, C] chunk-local inclusive cumulative
    sums of the log decays. Returns ``S`` [B, Hk, N+1, K, V], ``z`` [B, Hk, N+1, K]: entry ``n`` is the state of
    the tokens before chunk ``n`` at the position just before it (entry 0 the initial state, entry ``N`` the
    final state)."""
    B, Hk, N, C, K = kc.shape
    V = vc.shape[-1]
    last = cum[..., -1:]  # [B, Hk, N, 1]
    kd = kc * (last - cum).exp().unsqueeze(-1)  # [B, Hk, N, C, K]: keys decayed to their chunk's end
    kvz = torch.cat([kd.transpose(-1, -2) @ vc, kd.sum(-2).unsqueeze(-1)], -1)  # [B, Hk, N, K, V+1]
    keep = last.exp().unsqueeze(-1)  # [B, Hk, N, 1, 1]: e^{chunk's total log decay}
    if initial_state is not None:
        Sz = torch.cat([initial_state[0].to(kc.dtype), initial_state[1].to(kc.dtype).unsqueeze(-1)], -1)
    else:
        Sz = kc.new_zeros(B, Hk, K, V + 1)
    states = [Sz]
    for n in range(N):
        Sz = keep[:, :, n] * Sz + kvz[:, :, n]
        states.append(Sz)
    Sz = torch.stack(states, 2)  # [B, Hk, N+1, K, V+1]
    return Sz[..., :V], Sz[..., V]


def linear_attention_chunked(
    q: torch.Tensor,  # [B, T, H, K]
    k: torch.Tensor,  # [B, T, Hk, K]
    v: torch.Tensor,  # [B, T, Hk, V]
    *,
    normalize: bool = True,
    eps: float = 1e-6,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    chunk_size: int = CHUNK,
    log_decay: Optional[torch.Tensor] = None,  # [B, T, Hk], <= 0
) -> Tuple[torch.Tensor, Optional[State]]:
    """Chunked causal linear attention (same contract as the reference)."""
    B, T, H, K = q.shape
    Hk = k.shape[2]
    G = H // Hk
    C = chunk_size
    N = max(1, math.ceil(T / C))
    pad = N * C - T
    dt = _acc_dtype(q, k, v)
    qc = _q_chunks(_pad_t(q, pad), Hk, C, dt)  # [B, Hk, N, G*C, K]
    kc = _kv_chunks(_pad_t(k, pad), C, dt)  # [B, Hk, N, C, K]
    vc = _kv_chunks(_pad_t(v, pad), C, dt)  # [B, Hk, N, C, V]
    if log_decay is not None:
        return _linear_gated(qc, kc, vc, log_decay, G, T, pad, normalize=normalize, eps=eps,
                             initial_state=initial_state, output_final_state=output_final_state, out_dtype=v.dtype)

    kv = kc.transpose(-1, -2) @ vc  # [B, Hk, N, K, V]
    ks = kc.sum(-2)  # [B, Hk, N, K]
    # exclusive prefix over chunks: state before chunk n
    S_ex = torch.cat([torch.zeros_like(kv[:, :, :1]), kv[:, :, :-1]], 2).cumsum(2)
    z_ex = torch.cat([torch.zeros_like(ks[:, :, :1]), ks[:, :, :-1]], 2).cumsum(2)
    if initial_state is not None:
        S_ex = S_ex + initial_state[0].to(dt).unsqueeze(2)
        z_ex = z_ex + initial_state[1].to(dt).unsqueeze(2)

    mask = torch.ones(C, C, dtype=torch.bool, device=q.device).tril().repeat(G, 1)  # [G*C, C]
    a = (qc @ kc.transpose(-1, -2)).masked_fill(~mask, 0.0)  # [B, Hk, N, G*C, C]
    num = a @ vc + qc @ S_ex  # [B, Hk, N, G*C, V]
    if normalize:
        den = a.sum(-1) + (qc @ z_ex.unsqueeze(-1)).squeeze(-1)  # [B, Hk, N, G*C]
        num = num / (den.unsqueeze(-1) + eps)
    o = _o_unchunk(num, G, C, T).to(v.dtype)

    state = None
    if output_final_state:
        S = S_ex[:, :, -1] + kv[:, :, -1]
        z = z_ex[:, :, -1] + ks[:, :, -1]
        if dt != torch.float64:
            S, z = S.float(), z.float()
        state = (S, z)
    return o, state


def _linear_gated(qc, kc, vc, log_decay, G, T, pad, *, normalize, eps, initial_state, output_final_state,
                  out_dtype):
    """:func:`linear_attention_chunked` with ``log_decay`` (chunked ``qc``, ``kc``, ``vc`` as there)."""
    C, dt = kc.shape[3], kc.dtype
    cum = _decay_chunks(F.pad(log_decay, (0, 0, 0, pad)), C, dt).cumsum(-1)  # [B, Hk, N, C]
    S_ex, z_ex = _gated_chunk_states(kc, vc, cum, initial_state)  # [B, Hk, N+1, K, V], [B, Hk, N+1, K]
    cq = _rows(cum.unsqueeze(-1), G)  # [B, Hk, N, G*C, 1]: b_i - b_{chunk start - 1}
    causal = torch.ones(C, C, dtype=torch.bool, device=qc.device).tril().repeat(G, 1)  # [G*C, C]
    decay = (cq - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [B, Hk, N, G*C, C]
    a = (qc @ kc.transpose(-1, -2)) * decay
    eq = cq.exp()  # [B, Hk, N, G*C, 1]
    num = a @ vc + eq * (qc @ S_ex[:, :, :-1])  # [B, Hk, N, G*C, V]
    if normalize:
        den = a.sum(-1, keepdim=True) + eq * (qc @ z_ex[:, :, :-1].unsqueeze(-1))  # [B, Hk, N, G*C, 1]
        num = num / (den + eps)
    o = _o_unchunk(num, G, C, T).to(out_dtype)
    state = None
    if output_final_state:
        S, z = S_ex[:, :, -1], z_ex[:, :, -1]
        if dt != torch.float64:
            S, z = S.float(), z.float()
        state = (S.contiguous(), z.contiguous())  # views of the scan's [K, V+1] blocks; steps update states in place
    return o, state


def window_linear_attention_chunked(
    q: torch.Tensor,  # [B, T, H, D]
    k: torch.Tensor,  # [B, T, Hk, D]
    fq: torch.Tensor,  # [B, T, H, K]
    fk: torch.Tensor,  # [B, T, Hk, K]
    v: torch.Tensor,  # [B, T, Hk, V]
    window_factor: torch.Tensor,  # [H]
    *,
    window: int = 64,
    scale: Optional[float] = None,
    eps: float = 1e-12,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    chunk_size: int = CHUNK,
    key_mask: Optional[torch.Tensor] = None,  # [B, T] bool, False = a padding token
    log_decay: Optional[torch.Tensor] = None,  # [B, T, Hk], <= 0
    return_lse: bool = False,
):
    """Chunked LoLCATs sliding-window hybrid (same contract as the reference; ``return_lse`` adds the log
    normaliser ``[B, T, H]`` fp32 as a third result).

    Queries of chunk ``n`` look at the keys of chunks ``n-P .. n``
    (``P = ceil(W / C)``) through masked quadratic scores: softmax for the
    window, feature-map products for the older tokens of that span; tokens
    before chunk ``n-P`` come from the carried linear state. With ``log_decay`` the decays are
    cumulative sums over each span (chunks ``n-P .. n``), and the carried state is the gated state just
    before the span.
    """
    B, T, H, D = q.shape
    Hk = k.shape[2]
    G = H // Hk
    W = int(window)
    if scale is None:
        scale = D ** -0.5
    C = chunk_size
    N = max(1, math.ceil(T / C))
    P = max(1, math.ceil(W / C))
    pad = N * C - T
    dt = _acc_dtype(q, k, fq, fk, v)
    dev = q.device
    if key_mask is not None:  # padding keys: zero features (no linear term), masked out of the window below
        k, fk, v = drop_keys(key_mask, k, fk, v)
        if log_decay is not None:
            log_decay = drop_decay(key_mask, log_decay)

    qc = _q_chunks(_pad_t(q, pad), Hk, C, dt)  # [B, Hk, N, G*C, D]
    fqc = _q_chunks(_pad_t(fq, pad), Hk, C, dt)  # [B, Hk, N, G*C, K]
    kc = _kv_chunks(_pad_t(k, pad), C, dt)  # [B, Hk, N, C, D]
    fkc = _kv_chunks(_pad_t(fk, pad), C, dt)  # [B, Hk, N, C, K]
    vc = _kv_chunks(_pad_t(v, pad), C, dt)  # [B, Hk, N, C, V]

    def span(x: torch.Tensor) -> torch.Tensor:
        # [B, Hk, N, C, X] -> [B, Hk, N, (P+1)*C, X]: chunks n-P .. n (zeros before 0)
        xp = F.pad(x, (0, 0, 0, 0, P, 0))
        return torch.cat([xp[:, :, p : p + N] for p in range(P + 1)], dim=3)

    ksp, fksp, vsp = span(kc), span(fkc), span(vc)

    # masks over (chunk n, row g*C+i, span column c): key position (n-P)*C + c
    n_idx = torch.arange(N, device=dev).view(N, 1, 1)
    i_idx = torch.arange(C, device=dev).repeat(G).view(1, G * C, 1)
    c_idx = torch.arange((P + 1) * C, device=dev).view(1, 1, (P + 1) * C)
    diff = P * C + i_idx - c_idx  # i - j
    valid = (n_idx - P) * C + c_idx >= 0
    win = (diff >= 0) & (diff < W) & valid  # [N, G*C, (P+1)*C]
    lin = (diff >= W) & valid
    if key_mask is not None:  # [B, 1, N, 1, (P+1)*C]: whether the key in each span column is a real token
        kept = _pad_t(key_mask.view(B, T, 1, 1).to(dt), pad).view(B, N, C, 1, 1).permute(0, 3, 1, 2, 4)
        win = win & (span(kept).transpose(-1, -2) > 0.5)

    s = (qc @ ksp.transpose(-1, -2)) * scale  # [B, Hk, N, G*C, (P+1)*C]
    s = s.masked_fill(~win, float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_min(0.0).detach()  # [B, Hk, N, G*C, 1]
    em = torch.exp(-m)
    p = torch.exp(s - m)
    a = (fqc @ fksp.transpose(-1, -2)).masked_fill(~lin, 0.0)

    if log_decay is None:
        # linear state before chunk n-P: S0 + sum of chunk states m < n-P
        kv = fkc.transpose(-1, -2) @ vc  # [B, Hk, N, K, V]
        ks = fkc.sum(-2)  # [B, Hk, N, K]
        S_lin = torch.cat([torch.zeros_like(kv[:, :, :1]).expand(-1, -1, P + 1, -1, -1), kv], 2)[:, :, :N].cumsum(2)
        z_lin = torch.cat([torch.zeros_like(ks[:, :, :1]).expand(-1, -1, P + 1, -1), ks], 2)[:, :, :N].cumsum(2)
        if initial_state is not None:
            S_lin = S_lin + initial_state[0].to(dt).unsqueeze(2)
            z_lin = z_lin + initial_state[1].to(dt).unsqueeze(2)
    else:
        ldc = _decay_chunks(F.pad(log_decay, (0, 0, 0, pad)), C, dt)  # [B, Hk, N, C]
        cs = span(ldc.unsqueeze(-1))[..., 0].cumsum(-1)  # [B, Hk, N, (P+1)*C]: b_j - b_{span start - 1}
        cq = _rows(cs[..., P * C :].unsqueeze(-1), G)  # [B, Hk, N, G*C, 1]: the queries' b_i - b_{span start - 1}
        a = a * (cq - cs.unsqueeze(-2)).masked_fill(~lin, float("-inf")).exp()
        # gated state just before the span (chunk n-P), i.e. at the boundary max(n-P, 0)
        S_b, z_b = _gated_chunk_states(fkc, vc, ldc.cumsum(-1), initial_state)  # [B, Hk, N+1, ...]
        at = (torch.arange(N, device=dev) - P).clamp_min(0)
        S_lin, z_lin = S_b.index_select(2, at), z_b.index_select(2, at)
        eq = cq.exp()  # [B, Hk, N, G*C, 1]

    wf = window_factor.to(dt).view(Hk, G, 1).expand(Hk, G, C).reshape(1, Hk, 1, G * C, 1)
    mix = wf * p + (1 - wf) * em * a  # disjoint supports
    lin_w = (1 - wf) * em  # [B, Hk, N, G*C, 1]
    if log_decay is not None:
        lin_w = lin_w * eq
    num = mix @ vsp + lin_w * (fqc @ S_lin)
    den = mix.sum(-1, keepdim=True) + lin_w * (fqc @ z_lin.unsqueeze(-1)) + eps * em
    o = _o_unchunk(num / den, G, C, T).to(v.dtype)

    state = window_final_state(fk, v, W, initial_state, log_decay, dt) if output_final_state else None
    if return_lse:
        lse = _o_unchunk(den.log() + m, G, C, T)[..., 0]  # [B, T, H]
        return o, state, lse.to(torch.float64 if dt == torch.float64 else torch.float32)
    return o, state

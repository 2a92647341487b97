"""Chunked PyTorch implementations (the default path off CUDA, used for CPU training).

Tokens are grouped in chunks of ``C`` (64). Inside a chunk the quadratic form
is used (masked matmuls); across chunks the running state
``S = sum k v^T`` / ``z = sum k`` is carried by a cumulative sum over per-chunk
states. GQA is handled by folding the ``G = H / Hk`` query heads of a KV group
into the rows of one matmul (``[G*C, K] @ [K, C]``), so K/V are never repeated.
Everything runs in float32 (float64 for float64 inputs); autograd is PyTorch's.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .reference import drop_keys

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
) -> Tuple[torch.Tensor, Optional[State]]:
    """Chunked LoLCATs sliding-window hybrid (same contract as the reference).

    Queries of chunk ``n`` look at the keys of chunks ``n-P .. n``
    (``P = ceil(W / C)``) through masked quadratic scores: softmax for the
    window, feature-map products for the older tokens of that span; tokens
    before chunk ``n-P`` come from the carried linear state.
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

    # linear state before chunk n-P: S0 + sum of chunk states m < n-P
    kv = fkc.transpose(-1, -2) @ vc  # [B, Hk, N, K, V]
    ks = fkc.sum(-2)  # [B, Hk, N, K]
    S_lin = torch.cat([torch.zeros_like(kv[:, :, :1]).expand(-1, -1, P + 1, -1, -1), kv], 2)[:, :, :N].cumsum(2)
    z_lin = torch.cat([torch.zeros_like(ks[:, :, :1]).expand(-1, -1, P + 1, -1), ks], 2)[:, :, :N].cumsum(2)
    if initial_state is not None:
        S_lin = S_lin + initial_state[0].to(dt).unsqueeze(2)
        z_lin = z_lin + initial_state[1].to(dt).unsqueeze(2)

    wf = window_factor.to(dt).view(Hk, G, 1).expand(Hk, G, C).reshape(1, Hk, 1, G * C, 1)
    mix = wf * p + (1 - wf) * em * a  # disjoint supports
    lin_w = (1 - wf) * em  # [B, Hk, N, G*C, 1]
    num = mix @ vsp + lin_w * (fqc @ S_lin)
    den = mix.sum(-1, keepdim=True) + lin_w * (fqc @ z_lin.unsqueeze(-1)) + eps * em
    o = _o_unchunk(num / den, G, C, T).to(v.dtype)

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
    return o, state

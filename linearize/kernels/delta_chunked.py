"""The gated delta rule, chunked, in PyTorch (the default off CUDA; autograd is PyTorch's).

Tokens are grouped in chunks of ``C`` (64). Inside a chunk, with ``g`` the chunk-local inclusive cumulative sums
of the log decays, ``gamma = e^g``, ``S0`` the state before the chunk, the recurrence unrolls to the WY / UT form
(derivation in ``kernels/README.md``)::

    A = strict_lower(diag(beta) (K K^T) * e^{g_i - g_j})      T = (I + A)^{-1}        (the UT transform)
    w = T diag(beta gamma) K        u = T diag(beta) V        U = u - w S0             (the chunk's new values)
    O = diag(gamma) (scale Q) S0 + (tril(scale Q K^T) * e^{g_i - g_j}) U
    S1 = e^{g_last} S0 + (e^{g_last - g} K)^T U

``T`` is never formed: ``w`` and ``u`` come from one unit-lower-triangular solve each. Only ``e^{g_i - g_j}`` with
``j <= i`` (masked before ``exp``), ``e^{g}`` and ``e^{g_last - g}`` are exponentiated, all ``<= 1``. The chunk
states are a loop over chunks (the state update is not a sum). GQA: the state and the UT transform belong to the
KV heads; the ``G = H / Hk`` query heads of a group are folded into the rows of one product, as in
:mod:`linearize.kernels.chunked`. Float32 arithmetic (float64 for float64 inputs).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .chunked import _decay_chunks, _kv_chunks, _o_unchunk, _pad_t, _q_chunks, _rows

CHUNK = 64


def _acc_dtype(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def gated_delta_rule_chunked(
    q: torch.Tensor,  # [B, T, H, K]
    k: torch.Tensor,  # [B, T, Hk, K]
    v: torch.Tensor,  # [B, T, Hk, V]
    beta: torch.Tensor,  # [B, T, Hk]
    log_decay: Optional[torch.Tensor],  # [B, T, Hk], <= 0 (None: no decay)
    *,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,  # [B, Hk, K, V]
    output_final_state: bool = False,
    chunk_size: int = CHUNK,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunked gated delta rule (the contract of
    :func:`linearize.kernels.delta_reference.gated_delta_rule_reference`)."""
    B, T, H, K = q.shape
    Hk, V = k.shape[2], v.shape[-1]
    G = H // Hk
    C = chunk_size
    N = max(1, math.ceil(T / C))
    pad = N * C - T
    dt = _acc_dtype(q, k, v)
    scale = K ** -0.5 if scale is None else float(scale)
    dev = q.device
    qc = _q_chunks(_pad_t(q, pad), Hk, C, dt) * scale  # [B, Hk, N, G*C, K]
    kc = _kv_chunks(_pad_t(k, pad), C, dt)  # [B, Hk, N, C, K]
    vc = _kv_chunks(_pad_t(v, pad), C, dt)  # [B, Hk, N, C, V]
    bc = _decay_chunks(F.pad(beta, (0, 0, 0, pad)), C, dt)  # [B, Hk, N, C] (padding: beta = 0, adds nothing)
    if log_decay is None:
        g = bc.new_zeros(bc.shape)
    else:
        g = _decay_chunks(F.pad(log_decay, (0, 0, 0, pad)), C, dt).cumsum(-1)  # [B, Hk, N, C]

    ar = torch.arange(C, device=dev)
    strict = ar[:, None] > ar[None, :]  # [C, C]: i > j
    diff = g.unsqueeze(-1) - g.unsqueeze(-2)  # [B, Hk, N, C, C]: g_i - g_j
    A = bc.unsqueeze(-1) * (kc @ kc.transpose(-1, -2)) * diff.masked_fill(~strict, float("-inf")).exp()
    L = A + torch.eye(C, device=dev, dtype=dt)  # I + A, unit lower triangular
    w = torch.linalg.solve_triangular(L, (bc * g.exp()).unsqueeze(-1) * kc, upper=False,
                                      unitriangular=True)  # [B, Hk, N, C, K]
    u = torch.linalg.solve_triangular(L, bc.unsqueeze(-1) * vc, upper=False, unitriangular=True)  # [.., C, V]

    last = g[..., -1:]  # [B, Hk, N, 1]: the chunk's total log decay
    kd = kc * (last - g).exp().unsqueeze(-1)  # [B, Hk, N, C, K]: keys decayed to their chunk's end
    keep = last.exp().unsqueeze(-1)  # [B, Hk, N, 1, 1]
    S = initial_state.to(dt) if initial_state is not None else kc.new_zeros(B, Hk, K, V)
    states, news = [], []
    for n in range(N):
        states.append(S)
        U = u[:, :, n] - w[:, :, n] @ S  # [B, Hk, C, V]
        news.append(U)
        S = keep[:, :, n] * S + kd[:, :, n].transpose(-1, -2) @ U
    S_ex = torch.stack(states, 2)  # [B, Hk, N, K, V]: the state before each chunk
    U = torch.stack(news, 2)  # [B, Hk, N, C, V]

    gq = _rows(g.unsqueeze(-1), G)  # [B, Hk, N, G*C, 1]: each query row's g_i
    incl = (ar[:, None] >= ar[None, :]).repeat(G, 1)  # [G*C, C]
    P = (qc @ kc.transpose(-1, -2)) * (gq - g.unsqueeze(-2)).masked_fill(~incl, float("-inf")).exp()
    o = gq.exp() * (qc @ S_ex) + P @ U  # [B, Hk, N, G*C, V]
    o = _o_unchunk(o, G, C, T).to(v.dtype)
    if not output_final_state:
        return o, None
    return o, (S if dt == torch.float64 else S.float()).contiguous()

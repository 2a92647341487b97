"""Attention sinks for the window hybrid: a few first tokens kept in the exact-softmax part for every query.

A window-hybrid query ``i`` normally sees keys ``i-W < j <= i`` through softmax and older ones through the
linear state. With sinks, the first ``N`` (non-padding) tokens of a sequence stay in the softmax part forever and
never enter the linear state. The kernels compute the window hybrid with the sinks' key features zeroed (so they
add nothing to a linear sum) and return the log of their shared normaliser (``lse``); the sinks that are out of a
query's window are then merged in here, exactly: with ``L`` the kernel's ``lse`` and ``L_s = log w + logsumexp_j
s_ij`` over the visible sinks (``w`` the head's window factor),

    o_i = sigmoid(L - L_s) o_kernel + sigmoid(L_s - L) softmax_j(s_ij) v_j,

the output of one normaliser over window, sinks and linear part. Everything here is a few small PyTorch ops over
``[B, T, H, N]`` scores (``N`` sinks, 4-64), differentiable. Decode steps take the :class:`Sinks` themselves (the
step kernels add the ones out of the window to their softmax part). The quadratic spec is
``window_linear_attention_reference(sink_mask=...)``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch


class Sinks(NamedTuple):
    """The sink tokens of a batch: ``k`` ``[B, N, Hk, D]``, ``v`` ``[B, N, Hk, V]``, ``pos`` ``[B, N]`` int64 (their
    positions in the stream), ``valid`` ``[B, N]`` bool (False for slots no token has filled yet)."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor


def first_tokens(sinks: int, B: int, T: int, device, key_mask: Optional[torch.Tensor] = None,
                 before: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, T]`` bool: which of a call's ``T`` tokens are sinks, the first ``sinks`` non-padding tokens of each row
    after ``before`` ``[B]`` (int64, sinks already taken by earlier calls)."""
    real = key_mask if key_mask is not None else torch.ones(B, T, dtype=torch.bool, device=device)
    rank = real.long().cumsum(1) - 1  # [B, T]: index among the row's real tokens of this call
    if before is not None:
        rank = rank + before.view(B, 1)
    return real & (rank < sinks)


def gather_sinks(is_sink: torch.Tensor, sinks: int, k: torch.Tensor, v: torch.Tensor,
                 offset: int = 0) -> Sinks:
    """The sink tokens of one call (``is_sink`` ``[B, T]``, at most ``sinks`` per row) gathered into
    :class:`Sinks` of ``sinks`` slots, in order; ``offset``: the stream position of the call's first token."""
    B, T = is_sink.shape
    n = min(sinks, T)
    # the sink positions first (a stable sort keeps their order), then the rest
    order = torch.sort((~is_sink).to(torch.int8), dim=1, stable=True).indices[:, :n]  # [B, n]
    valid = is_sink.gather(1, order)
    idx = order.view(B, n, 1, 1)
    ks = k.gather(1, idx.expand(B, n, *k.shape[2:]))
    vs = v.gather(1, idx.expand(B, n, *v.shape[2:]))
    if n < sinks:  # a call shorter than the sink count: empty slots
        pad = sinks - n
        ks = torch.cat([ks, ks.new_zeros(B, pad, *ks.shape[2:])], 1)
        vs = torch.cat([vs, vs.new_zeros(B, pad, *vs.shape[2:])], 1)
        order = torch.cat([order, order.new_zeros(B, pad)], 1)
        valid = torch.cat([valid, valid.new_zeros(B, pad)], 1)
    return Sinks(ks, vs, order + offset, valid)


def join_sinks(kept: Sinks, new: Sinks) -> Sinks:
    """``kept`` followed by the valid slots of ``new`` (the sinks of a later call), as many slots as ``kept``."""
    n = kept.k.shape[1]
    both = Sinks(*(torch.cat([a, b], 1) for a, b in zip(kept, new)))
    order = torch.sort((~both.valid).to(torch.int8), dim=1, stable=True).indices[:, :n]  # valid ones first
    B = order.shape[0]
    pick = lambda x: x.gather(1, order.view(B, n, *([1] * (x.dim() - 2))).expand(B, n, *x.shape[2:]))  # noqa: E731
    return Sinks(*(pick(x) for x in both))


def merge_sinks(
    o: torch.Tensor,  # [B, T, H, V] the window hybrid without the sinks outside the window
    lse: torch.Tensor,  # [B, T, H] its log normaliser
    q: torch.Tensor,  # [B, T, H, D] raw post-rotary queries
    sinks: Sinks,
    visible: torch.Tensor,  # [B, T, N] bool: which sinks each query reads through this merge
    window_factor: torch.Tensor,  # [H] in (0, 1)
    scale: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``o`` with the ``visible`` sinks joined to its softmax part (module docstring); returns ``(o [B, T, H, V] in
    o's dtype, lse [B, T, H])``. A query with no visible sink keeps ``o`` exactly."""
    B, T, H, D = q.shape
    Hk, N = sinks.k.shape[2], sinks.k.shape[1]
    G = H // Hk
    dt = torch.float64 if o.dtype == torch.float64 or lse.dtype == torch.float64 else torch.float32
    qg = q.to(dt).view(B, T, Hk, G, D)
    s = torch.einsum("btkgd,bnkd->btkgn", qg, sinks.k.to(dt)) * scale  # [B, T, Hk, G, N]
    seen = visible.view(B, T, 1, 1, N)
    s = s.masked_fill(~seen, float("-inf"))
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    e = torch.exp(s - top)  # 0 where not visible
    total = e.sum(-1)  # [B, T, Hk, G]
    any_seen = total > 0
    o_s = torch.einsum("btkgn,bnkv->btkgv", e, sinks.v.to(dt)) / total.clamp_min(1e-30).unsqueeze(-1)
    log_w = window_factor.to(dt).log().view(1, 1, Hk, G)
    l_s = torch.where(any_seen, total.clamp_min(1e-30).log() + top[..., 0] + log_w,
                      torch.full_like(total, float("-inf")))
    l_k = lse.to(dt).view(B, T, Hk, G)
    keep = torch.sigmoid(l_k - l_s).unsqueeze(-1)  # 1 where no sink is visible
    V = o.shape[-1]
    merged = keep * o.to(dt).view(B, T, Hk, G, V) + (1 - keep) * o_s
    return merged.view(B, T, H, V).to(o.dtype), torch.logaddexp(l_k, l_s).view(B, T, H)


def sink_visibility(sinks: Sinks, query_pos: torch.Tensor, window: int) -> torch.Tensor:
    """``[B, T, N]`` bool: the sinks outside the window of each query (``query_pos`` ``[T]`` or ``[B, T]`` stream
    positions; a sink at distance ``>= window`` is no longer in the softmax window, so the merge adds it)."""
    qp = query_pos.view(1, -1, 1) if query_pos.dim() == 1 else query_pos.unsqueeze(-1)
    return sinks.valid.unsqueeze(1) & (qp - sinks.pos.unsqueeze(1) >= window)

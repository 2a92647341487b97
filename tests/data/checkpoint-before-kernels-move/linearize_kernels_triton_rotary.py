# Bundled by linearize 0.1.0 from linearize.kernels.triton_rotary for trust_remote_code=True; do not edit.
"""Triton kernel for rotary position embeddings of queries and keys in one launch.

``x * cos + rotate_half(x) * sin`` per head (the Llama / Mistral / Qwen convention, ``rotate_half(x) = [-x2, x1]``
for the halves ``x1``, ``x2`` of the head dimension). One program per (token, block of heads), where the heads of
``q`` and ``k`` are numbered one after the other, so a decode step rotates both with one kernel where PyTorch
runs ten (products, negation, concatenation, sums); a prefill reads each input once and writes it once, in fp32
arithmetic with one rounding. The backward is the same kernel with the transposed rotation
(``dx1 = c1 g1 + s2 g2``, ``dx2 = c2 g2 - s1 g1``), which needs no assumption that the two halves of ``cos`` and
``sin`` repeat each other. Tables narrower than the heads (``R < D``: partial rotary, Phi-4-mini rotates 3/4 of
each head) rotate the first ``R`` dims and copy the rest, in both directions.
"""

from __future__ import annotations

import torch
try:  # imported only where the Triton kernels run
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install without Triton never calls this module
    triton = tl = None

from .linearize_kernels_triton_common import launch, new_empty, pow2


@triton.jit
def _rotary_kernel(
    Q, Kx, COS, SIN, QO, KO,  # q [B*T, H, D], k [B*T, HK, D], cos / sin rows [B, T, ROT] by strides, outputs as q, k
    T, H, HK, scb, sct, ssb, sst,
    D: tl.constexpr, ROT: tl.constexpr, BHALF: tl.constexpr, BPASS: tl.constexpr, BH: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)  # token row b * T + t
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    b, t = r // T, r % T
    half: tl.constexpr = ROT // 2
    oh = tl.arange(0, BHALF)
    mh = oh < half
    c1 = tl.load(COS + b * scb + t * sct + oh, mask=mh, other=0.0).to(tl.float32)
    c2 = tl.load(COS + b * scb + t * sct + half + oh, mask=mh, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + b * ssb + t * sst + oh, mask=mh, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + b * ssb + t * sst + half + oh, mask=mh, other=0.0).to(tl.float32)
    is_q, is_k = heads < H, (heads >= H) & (heads < H + HK)
    rq = (r * H + tl.where(is_q, heads, 0))[:, None] * D + oh[None, :]  # [BH, BHALF] offsets of the first halves
    rk = (r * HK + tl.where(is_k, heads - H, 0))[:, None] * D + oh[None, :]
    mq, mk = is_q[:, None] & mh[None, :], is_k[:, None] & mh[None, :]
    x1 = tl.load(Q + rq, mask=mq, other=0.0).to(tl.float32) + tl.load(Kx + rk, mask=mk, other=0.0).to(tl.float32)
    x2 = (tl.load(Q + rq + half, mask=mq, other=0.0).to(tl.float32)
          + tl.load(Kx + rk + half, mask=mk, other=0.0).to(tl.float32))
    if BACKWARD:  # the transposed rotation
        y1 = x1 * c1[None, :] + x2 * s2[None, :]
        y2 = x2 * c2[None, :] - x1 * s1[None, :]
    else:
        y1 = x1 * c1[None, :] - x2 * s1[None, :]
        y2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(QO + rq, y1.to(QO.dtype.element_ty), mask=mq)
    tl.store(QO + rq + half, y2.to(QO.dtype.element_ty), mask=mq)
    tl.store(KO + rk, y1.to(KO.dtype.element_ty), mask=mk)
    tl.store(KO + rk + half, y2.to(KO.dtype.element_ty), mask=mk)
    if ROT < D:  # partial rotary: dims ROT..D pass through (forward and backward alike)
        op = ROT + tl.arange(0, BPASS)
        mp = op < D
        pq = (r * H + tl.where(is_q, heads, 0))[:, None] * D + op[None, :]
        pk = (r * HK + tl.where(is_k, heads - H, 0))[:, None] * D + op[None, :]
        mpq, mpk = is_q[:, None] & mp[None, :], is_k[:, None] & mp[None, :]
        tl.store(QO + pq, tl.load(Q + pq, mask=mpq, other=0.0), mask=mpq)
        tl.store(KO + pk, tl.load(Kx + pk, mask=mpk, other=0.0), mask=mpk)


def rotary_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  backward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (or, with ``backward``, inversely rotated gradient) ``q [B,T,H,D]`` and ``k [B,T,Hk,D]`` for
    ``cos`` / ``sin`` ``[B or 1, T, R]`` (``R <= D``, even: the first ``R`` dims of each head turn); outputs in
    the inputs' dtypes."""
    B, T, H, D = q.shape
    HK, ROT = k.shape[2], cos.shape[-1]
    q, k = q.contiguous(), k.contiguous()
    cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (cos, sin))
    qo, ko = new_empty(q.shape, dtype=q.dtype, device=q.device), new_empty(k.shape, dtype=k.dtype, device=k.device)
    BHALF = pow2(ROT // 2)
    BH = min(pow2(H + HK), max(1, 2048 // BHALF))  # up to 4K elements of one token per program
    grid = (B * T, triton.cdiv(H + HK, BH))
    launch(_rotary_kernel, grid, q, k, cos, sin, qo, ko, T, H, HK,
           0 if cos.shape[0] == 1 else cos.stride(0), cos.stride(1),
           0 if sin.shape[0] == 1 else sin.stride(0), sin.stride(1),
           D=D, ROT=ROT, BHALF=BHALF, BPASS=pow2(max(D - ROT, 1)), BH=BH, BACKWARD=backward, num_warps=4)
    return qo, ko


class RotaryTriton(torch.autograd.Function):
    """:func:`rotary_triton` with its backward (no gradient for ``cos`` / ``sin``)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotary_triton(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return (*rotary_triton(dq, dk, cos, sin, backward=True), None, None)

"""Triton kernel for the Hedgehog feature map on its own: ``[softmax(x W), softmax(-x W)]`` per head.

One program per ``BR`` rows of one head: it loads the ``[BR, D]`` input tile and the head's ``[D, 2f]`` signed
projection ``[W, -W]``, forms ``u = x [W, -W]`` with one product (fp32 accumulation) and writes both softmax
halves in the input dtype. The PyTorch map (fp32 upcast, product, two softmaxes, concatenation, clamp,
downcast) makes several full-size fp32 passes over memory; this kernel reads ``x`` once and writes the
features once. Forward only (inference); the same math as :func:`triton_common.hedgehog_tile`, which the
fused attention kernels use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import hedgehog_tile, launch, new_empty, pow2, prec, signed_projection

BR = 64  # rows per program


@triton.jit
def _hedgehog_map_kernel(
    X, WX, OUT,  # x [R, H, D], [W, -W] [H, D, K], features [R, H, K] (R = B*T rows)
    R, H, feps,
    D: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr,
):
    pr = tl.program_id(0)
    h = tl.program_id(1)
    rows = pr * BR + tl.arange(0, BR)
    od = tl.arange(0, BD)
    ok = tl.arange(0, BK)
    mr, md, mk = rows < R, od < D, ok < K
    base = rows.to(tl.int64) * H + h
    x = tl.load(X + base[:, None] * D + od[None, :], mask=mr[:, None] & md[None, :], other=0.0)
    f = hedgehog_tile(x, WX, h, od, ok, md, mk, D, K, K // 2, feps, PREC)  # [BR, BK] fp32
    tl.store(OUT + base[:, None] * K + ok[None, :], f.to(OUT.dtype.element_ty), mask=mr[:, None] & mk[None, :])


def hedgehog_feature_map_triton(x: torch.Tensor, weight: torch.Tensor, feature_eps: float = 1e-12) -> torch.Tensor:
    """``x`` ``[B, T, H, D]``, ``weight`` ``[H, D, f]`` -> features ``[B, T, H, 2f]`` in ``x``'s dtype (no autograd)."""
    B, T, H, D = x.shape
    f = weight.shape[-1]
    x = x.contiguous()
    wx = signed_projection(weight, x.dtype)  # [H, D, 2f]
    out = new_empty((B, T, H, 2 * f), dtype=x.dtype, device=x.device)
    R = B * T
    if R == 0:
        return out
    launch(_hedgehog_map_kernel, (triton.cdiv(R, BR), H), x, wx, out, R, H, float(feature_eps),
           D=D, K=2 * f, BD=pow2(D), BK=pow2(2 * f), BR=BR, PREC=prec(x.dtype), num_warps=4)
    return out

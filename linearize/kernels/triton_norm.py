"""Triton kernel for RMS normalisation of rows, in one launch.

A family's RMS norm is several PyTorch kernels (an fp32 copy, the square, the mean, ``rsqrt``, two products and a
cast back): at a decode step, where each normalises a few rows of ``hidden_size`` values, launching them costs more
than the arithmetic, and a model runs two per layer. This kernel does one row per program: the fp32 mean of
squares, the scaling and the weight in one read and one write, in the rounding order of the family's own module
(``FORM``, :data:`linearize.kernels.RMS_NORM_FORMS`):

* ``llama``: ``w * (x * rsqrt(mean(x²) + eps)).to(x.dtype)``, the product in the promoted dtype (Llama, Qwen,
  Mistral and most others);
* ``olmo2``: ``(w * x * rsqrt(mean(x²) + eps)).to(x.dtype)``, the product in fp32;
* ``gemma``: ``(x * rsqrt(mean(x²) + eps) * (1 + w)).to(x.dtype)``, in fp32 (Gemma 1-3).

Only the order of the sum of squares differs from PyTorch's, so outputs agree to a unit in the last place of the
output dtype. Inference only: there is no backward (a forward under autograd runs the module's own code).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import launch, new_empty, pow2, to16

#: the kernel's code for each form (constexpr ``FORM``)
FORM_CODES = {"llama": 0, "olmo2": 1, "gemma": 2}


@triton.jit
def _rms_norm_kernel(X, W, Y, N, sx, sy, eps,  # x [R, N] (row stride sx), w [N], y [R, N] (row stride sy)
                     FORM: tl.constexpr, BN: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BN)
    m = o < N
    x = tl.load(X + r * sx + o, mask=m, other=0.0).to(tl.float32)
    w = tl.load(W + o, mask=m, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    if FORM == 0:  # round to the input's dtype first, then the product (rounded to the output's dtype below)
        y = to16(normed, X.dtype.element_ty).to(tl.float32) * w
    elif FORM == 1:
        y = w * normed
    else:
        y = normed * (1.0 + w)
    tl.store(Y + r * sy + o, to16(y, Y.dtype.element_ty), mask=m)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str) -> torch.Tensor:
    """RMS norm of ``x [..., N]`` with ``weight [N]`` in ``form``'s rounding order; the output dtype is the
    module's: ``x``'s for ``olmo2`` and ``gemma``, ``x``'s promoted with ``weight``'s for ``llama``."""
    N = x.shape[-1]
    rows = x.reshape(-1, N)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if form == "llama" else x.dtype
    y = new_empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0]:
        BN = pow2(N)
        launch(_rms_norm_kernel, (rows.shape[0],), rows, weight.contiguous(), y, N, rows.stride(0), y.stride(0),
               float(eps), FORM=FORM_CODES[form], BN=BN,
               num_warps=min(16, max(1, BN // 256)))
    return y.view(*x.shape[:-1], N)

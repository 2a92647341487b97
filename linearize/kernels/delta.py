"""The gated delta rule (Gated DeltaNet): public entry points and backend selection.

:func:`gated_delta_rule` runs a sequence, :func:`gated_delta_rule_step` one decode token (state updated in
place). The spec is :func:`linearize.kernels.delta_reference.gated_delta_rule_reference`; the math of the chunked
forms is in ``kernels/README.md``. Layout ``[B, T, H, D]`` as everywhere in :mod:`linearize.kernels`.

``backend``: ``None`` picks Triton for CUDA tensors and the chunked PyTorch path elsewhere; ``"triton"`` forces
Triton (on CPU only under ``TRITON_INTERPRET=1``), ``"torch"`` the chunked PyTorch path, ``"reference"`` the
token-by-token float64 recurrence (the same rules as :func:`linearize.kernels.linear_attention`).

``q`` and ``k`` are expected L2-normalised per head by the caller (the layer normalises them where it computes
them; the kernels do not, so the one rule holds on every backend and the backward needs no normalisation).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from .delta_chunked import gated_delta_rule_chunked
from .delta_reference import gated_delta_rule_reference
from .delta_step import gated_delta_rule_step_torch
from .step import _use_triton, check_log_decay

BACKENDS = (None, "triton", "torch", "reference")

__all__ = ["gated_delta_rule", "gated_delta_rule_step", "BACKENDS"]


def _resolve_backend(backend: Optional[str], x: torch.Tensor) -> str:
    """``linearize.kernels``' rule (that module imports this one, so it is not imported back)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend is None:
        return "triton" if x.is_cuda else "torch"
    if backend == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 (set before importing triton)")
    return backend


def _check_gates(name: str, beta: torch.Tensor, log_decay: Optional[torch.Tensor], shape: tuple):
    """``beta`` and ``log_decay`` (``shape``: ``[B, T, Hk]`` or ``[B, Hk]``) checked; ``log_decay`` cast to float32
    (float64 kept). The values are not checked (that would read them back to the host)."""
    if not torch.is_tensor(beta) or not beta.is_floating_point() or tuple(beta.shape) != shape:
        got = f"{beta.dtype} {tuple(beta.shape)}" if torch.is_tensor(beta) else type(beta).__name__
        raise ValueError(f"{name}: beta must be a floating-point tensor of shape {list(shape)} "
                         f"(one per key/value head), got {got}")
    return check_log_decay(name, log_decay, shape)


def gated_delta_rule(
    q: torch.Tensor,  # [B, T, H, K], L2-normalised per head
    k: torch.Tensor,  # [B, T, Hk, K], L2-normalised per head
    v: torch.Tensor,  # [B, T, Hk, V]
    beta: torch.Tensor,  # [B, T, Hk], in (0, 1)
    log_decay: Optional[torch.Tensor],  # [B, T, Hk], <= 0 (None: no decay, the plain delta rule)
    *,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,  # [B, Hk, K, V] fp32
    output_final_state: bool = False,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated delta rule over a sequence.

    Per KV head ``S_t = e^{log_decay_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`` from ``S_{-1} =
    initial_state`` (zeros without one), ``o_t = S_t^T (scale q_t)`` with ``scale`` defaulting to ``K ** -0.5``.
    The state belongs to the key/value heads: query head ``h`` reads KV head ``h // (H / Hk)``. ``K != V`` is
    allowed. Returns ``(o [B, T, H, V] in v's dtype, S_{T-1} [B, Hk, K, V] fp32 or None)``; two calls, the second
    from the first's final state, equal one. Gradients reach ``q, k, v, beta, log_decay`` and ``initial_state`` on
    every backend.
    """
    name = "gated_delta_rule"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{name}: q, k, v must be [B, T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, T, H, K = q.shape
    Hk, V = k.shape[2], v.shape[-1]
    if k.shape[:2] != (B, T) or v.shape[:3] != (B, T, Hk) or k.shape[3] != K:
        raise ValueError(f"{name}: shape mismatch q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if H % Hk:
        raise ValueError(f"{name}: query heads ({H}) must be a multiple of key/value heads ({Hk})")
    log_decay = _check_gates(name, beta, log_decay, (B, T, Hk))
    if initial_state is not None and tuple(initial_state.shape) != (B, Hk, K, V):
        raise ValueError(f"{name}: initial_state must be [B, Hk, K, V]={[B, Hk, K, V]}, "
                         f"got {tuple(initial_state.shape)}")
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state)
    be = _resolve_backend(backend, q)
    if be == "reference":
        return gated_delta_rule_reference(q, k, v, beta, log_decay, **kw)
    if be == "torch":
        return gated_delta_rule_chunked(q, k, v, beta, log_decay, **kw)
    from .triton_delta import gated_delta_rule_triton  # triton is optional: imported only on the Triton path

    return gated_delta_rule_triton(q, k, v, beta, log_decay, **kw)


def gated_delta_rule_step(
    q: torch.Tensor,  # [B, H, K]
    k: torch.Tensor,  # [B, Hk, K]
    v: torch.Tensor,  # [B, Hk, V]
    beta: torch.Tensor,  # [B, Hk]
    log_decay: Optional[torch.Tensor],  # [B, Hk], <= 0 (None: no decay)
    state: torch.Tensor,  # [B, Hk, K, V] fp32, updated in place
    *,
    scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,  # [B, H, V]
    backend: Optional[str] = None,
) -> torch.Tensor:
    """One decode token of :func:`gated_delta_rule`: ``state`` becomes ``S_t`` in place and ``o_t`` ``[B, H, V]``
    is returned (written into ``out`` when given). Nothing is allocated but the output and nothing is read back to
    the host, so a CUDA graph can capture the call. ``None`` / ``"triton"`` run one Triton kernel on CUDA, the
    other backends in-place PyTorch ops."""
    name = "gated_delta_rule_step"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"{name}: q, k, v must be [B, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, H, K = q.shape
    Hk, V = k.shape[1], v.shape[-1]
    if k.shape != (B, Hk, K) or v.shape[:2] != (B, Hk):
        raise ValueError(f"{name}: shape mismatch q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if H % Hk:
        raise ValueError(f"{name}: query heads ({H}) must be a multiple of key/value heads ({Hk})")
    log_decay = _check_gates(name, beta, log_decay, (B, Hk))
    if tuple(state.shape) != (B, Hk, K, V) or state.dtype not in (torch.float32, torch.float64) \
            or not state.is_contiguous():
        raise ValueError(f"{name}: state must be a contiguous float32 tensor [B, Hk, K, V]={[B, Hk, K, V]} "
                         f"(updated in place), got {state.dtype} {tuple(state.shape)}")
    scale = K ** -0.5 if scale is None else float(scale)
    if _use_triton(q, backend) and state.dtype == torch.float32:
        from .triton_delta_step import gated_delta_rule_step_triton  # triton is optional: imported only on the Triton path

        return gated_delta_rule_step_triton(q, k, v, beta, log_decay, state, scale=scale, out=out)
    return gated_delta_rule_step_torch(q, k, v, beta, log_decay, state, scale, out)

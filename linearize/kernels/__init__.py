"""linearize.kernels: linear attention and the LoLCATs window hybrid.

Layout ``[B, T, H, D]`` (like flash-attn / fla). Public entry points:

- :func:`linear_attention` -- causal (normalised) linear attention, chunked.
- :func:`window_linear_attention` -- exact softmax over the last ``W`` tokens plus
  linear attention over older ones, one shared normaliser (LoLCATs layer).
- :func:`linear_attention_hedgehog`, :func:`window_linear_attention_hedgehog` -- the same with
  Hedgehog feature maps computed inside the forward kernel from ``q``, ``k`` (inference).
- :func:`linear_attention_step`, :func:`window_linear_attention_step` -- one decode
  token, state updated in place (CUDA-graph friendly); :func:`linear_attention_step_hedgehog`,
  :func:`window_linear_attention_step_hedgehog` with the Hedgehog features computed inside the step kernel.
- :func:`hedgehog_feature_map` -- the Hedgehog features alone (a Triton kernel for inference on the GPU).
- :func:`rotary_embedding` -- rotary position embedding of queries and keys (one Triton kernel, with backward).
- :func:`rms_norm` -- RMS normalisation in a family's rounding order (one Triton kernel; inference).
- :func:`gated_delta_rule`, :func:`gated_delta_rule_step` -- the gated delta rule (Gated DeltaNet), a sequence
  and one decode token (:mod:`linearize.kernels.delta`).
- attention sinks (``sink_mask=`` on :func:`window_linear_attention`; the pieces a layer with a cache uses are in
  :mod:`linearize.kernels.sinks`: :class:`Sinks`, :func:`merge_sinks`).
- :func:`window_state_from_prefill`, :func:`empty_window_state`,
  :func:`empty_linear_state` -- decode-state helpers.

``backend``: ``None`` picks Triton for CUDA tensors and the chunked PyTorch path
elsewhere; ``"triton"`` forces Triton (works on CPU under ``TRITON_INTERPRET=1``),
``"torch"`` the chunked PyTorch path, ``"reference"`` the naive quadratic spec.
Every path supports autograd. The math is in ``kernels/README.md``.

``log_decay`` (gated linear attention): ``[B, T, Hk]`` (steps: ``[B, Hk]``) per-token, per-KV-head log decays
``<= 0``, float32 (other floating dtypes are cast; float64 stays float64). The linear state decays by
``e^{log_decay_t}`` at each token: ``S_t = e^{log_decay_t} S_{t-1} + k_t v_t^T`` (and ``z``), so key ``j`` weighs
``e^{b_t - b_j}`` at query ``t`` and the initial state ``e^{b_t}`` (``b`` = cumulative sum within the call). In
the window hybrid only the linear part decays: the decay applies to the tokens older than the window; it accrues
from each key's own position, so a token leaving the window has already decayed by the window's W steps.
``None`` is the ungated computation, unchanged. Gradients reach ``log_decay`` on every path. A Triton entry point
that does not take ``log_decay`` yet leaves gated calls to the chunked PyTorch path (steps: the PyTorch step).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from .chunked import linear_attention_chunked, window_linear_attention_chunked
from .delta import gated_delta_rule, gated_delta_rule_step
from .sinks import Sinks, gather_sinks, merge_sinks, sink_visibility
from .reference import (
    needs_grad,
    drop_decay,
    drop_keys,
    hedgehog_features,
    hedgehog_features_rounded,
    linear_attention_reference,
    RMS_NORM_FORMS,
    rms_norm_reference,
    rotary_reference,
    window_linear_attention_reference,
)
from .step import (
    WindowState,
    check_linear_state,
    check_log_decay,
    empty_linear_state,
    empty_window_state,
    fold_tokens,
    linear_attention_step,
    window_linear_attention_step,
    takes_log_decay,
    window_state_from_prefill,
)

State = Tuple[torch.Tensor, torch.Tensor]

__all__ = [
    "linear_attention",
    "window_linear_attention",
    "window_linear_attention_hedgehog",
    "linear_attention_hedgehog",
    "hedgehog_features",
    "hedgehog_feature_map",
    "rotary_embedding",
    "rms_norm",
    "rms_norm_reference",
    "RMS_NORM_FORMS",
    "gated_delta_rule",
    "gated_delta_rule_step",
    "Sinks",
    "merge_sinks",
    "linear_attention_step",
    "window_linear_attention_step",
    "window_linear_attention_step_hedgehog",
    "linear_attention_step_hedgehog",
    "window_state_from_prefill",
    "fold_tokens",
    "empty_window_state",
    "empty_linear_state",
    "WindowState",
    "linear_attention_reference",
    "window_linear_attention_reference",
    "linear_attention_chunked",
    "window_linear_attention_chunked",
    "triton_available",
]

BACKENDS = (None, "triton", "torch", "reference")


def triton_available() -> bool:
    """True if the Triton kernels can be imported."""
    try:
        import triton  # noqa: F401 - triton is optional: is it installed?
    except Exception:  # pragma: no cover - depends on the platform
        return False
    return True


def _resolve_backend(backend: Optional[str], x: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend is None:
        return "triton" if (x.is_cuda and triton_available()) else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' requested but triton is not installed")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 (set before importing triton)")
    return backend


def _check(name: str, q, k, v, initial_state, qk_dim_pairs=()):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{name}: q, k, v must be [B, T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, T, H, _ = q.shape
    Hk = k.shape[2]
    if k.shape[:2] != (B, T) or v.shape[:3] != (B, T, Hk):
        raise ValueError(f"{name}: shape mismatch q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if H % Hk:
        raise ValueError(f"{name}: query heads ({H}) must be a multiple of key/value heads ({Hk})")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{name}: q and k feature dims differ ({q.shape[-1]} vs {k.shape[-1]})")
    if initial_state is not None:
        S0, z0 = initial_state
        Kd = k.shape[-1] if not qk_dim_pairs else qk_dim_pairs[0]
        if tuple(S0.shape) != (B, Hk, Kd, v.shape[-1]) or tuple(z0.shape) != (B, Hk, Kd):
            raise ValueError(
                f"{name}: initial_state must be (S [B,Hk,K,V]={(B, Hk, Kd, v.shape[-1])}, z [B,Hk,K]), "
                f"got {tuple(S0.shape)}, {tuple(z0.shape)}"
            )


def _check_key_mask(name: str, key_mask: torch.Tensor, k: torch.Tensor) -> None:
    if key_mask.dtype != torch.bool or tuple(key_mask.shape) != tuple(k.shape[:2]):
        raise ValueError(f"{name}: key_mask must be a bool [B, T]={tuple(k.shape[:2])} tensor, "
                         f"got {key_mask.dtype} {tuple(key_mask.shape)}")


def linear_attention(
    q: torch.Tensor,  # [B, T, H, K]  feature-mapped, non-negative
    k: torch.Tensor,  # [B, T, Hk, K] feature-mapped, non-negative
    v: torch.Tensor,  # [B, T, Hk, V]
    *,
    normalize: bool = True,
    eps: float = 1e-6,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    backend: Optional[str] = None,
    key_mask: Optional[torch.Tensor] = None,  # [B, T] bool, False = a padding token
    log_decay: Optional[torch.Tensor] = None,  # [B, T, Hk], <= 0
) -> Tuple[torch.Tensor, Optional[State]]:
    """Causal linear attention.

    ``o_t = q_t . S_t / (q_t . z_t + eps)`` with ``S_t = S_0 + sum_{j<=t} k_j v_j^T``,
    ``z_t = z_0 + sum_{j<=t} k_j`` (numerator only if ``normalize=False``). Query head
    ``h`` reads KV head ``h // (H // Hk)``. Returns ``(o [B,T,H,V] in v.dtype, state)``
    with ``state = (S [B,Hk,K,V] fp32, z [B,Hk,K] fp32)`` if ``output_final_state``.
    Tokens where ``key_mask`` is False (padding) are left out of every sum and of the state.

    ``log_decay`` (gated): ``S_t = e^{log_decay_t} S_{t-1} + k_t v_t^T``, ``z`` alike, from ``(S_0, z_0)``; the
    final state is ``(S_{T-1}, z_{T-1})``, so two halves (the second from the first's state) equal one call.
    Padding tokens do not decay.
    """
    _check("linear_attention", q, k, v, initial_state)
    log_decay = check_log_decay("linear_attention", log_decay, (*k.shape[:3],))
    if key_mask is not None:
        _check_key_mask("linear_attention", key_mask, k)
        k, v = drop_keys(key_mask, k, v)
        if log_decay is not None:
            log_decay = drop_decay(key_mask, log_decay)
    be = _resolve_backend(backend, q)
    kw = dict(normalize=normalize, eps=eps, initial_state=initial_state, output_final_state=output_final_state)
    if log_decay is not None:
        kw["log_decay"] = log_decay
    if be == "reference":
        return linear_attention_reference(q, k, v, **kw)
    if be == "torch":
        return linear_attention_chunked(q, k, v, **kw)
    from .triton_linear import linear_attention_triton  # triton is optional: imported only on the Triton path

    if log_decay is not None and not takes_log_decay(linear_attention_triton):
        return linear_attention_chunked(q, k, v, **kw)
    return linear_attention_triton(q, k, v, **kw)


def window_linear_attention(
    q: torch.Tensor,  # [B, T, H, D]  raw post-rotary queries
    k: torch.Tensor,  # [B, T, Hk, D] raw post-rotary keys
    fq: torch.Tensor,  # [B, T, H, K]  feature-mapped queries
    fk: torch.Tensor,  # [B, T, Hk, K] feature-mapped keys
    v: torch.Tensor,  # [B, T, Hk, V]
    window_factor: torch.Tensor,  # [H], in (0, 1) (already sigmoid-ed)
    *,
    window: int = 64,
    scale: Optional[float] = None,
    eps: float = 1e-12,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    backend: Optional[str] = None,
    key_mask: Optional[torch.Tensor] = None,  # [B, T] bool, False = a padding token
    log_decay: Optional[torch.Tensor] = None,  # [B, T, Hk], <= 0
    sink_mask: Optional[torch.Tensor] = None,  # [B, T] bool, True = an attention sink
    return_lse: bool = False,
):
    """LoLCATs sliding-window hybrid attention.

    Query ``i``: softmax weights ``exp(scale q_i.k_j)`` over the window
    ``{j : i-W < j <= i}`` mixed with linear weights ``fq_i.fk_j`` over ``{j <= i-W}``
    (and the ``initial_state``, tokens before this sequence), one shared normaliser::

        o_i = (w sum_win e^{s_ij} v_j + (1-w) sum_lin (fq_i.fk_j) v_j)
              / (w sum_win e^{s_ij} + (1-w) sum_lin fq_i.fk_j + eps)

    computed stably (shift by ``m_i = max(0, max_win s_ij)``). The final state covers
    tokens ``j <= T-1-W`` (the linear set of the last query). To continue a sequence,
    prepend the previous ``W`` tokens yourself and pass the state returned for the
    tokens before them. The Triton backend runs ``W <= 4096`` in its own kernels (windows over 128, and fp32 ones
    over 64, walk several 64-token key blocks per chunk; with ``log_decay``: ``W <= 128``) and wider windows on
    the chunked PyTorch path.

    Keys where ``key_mask`` is False (padding, e.g. the left padding of a batch of prompts) take part in
    neither the window nor the linear sum nor the final state; the window still spans ``W`` positions, so a
    left-padded row gets exactly the outputs of its unpadded sequence. On the Triton backend a ``key_mask``
    runs the two-pass forward for ``W <= 64`` and ``128 < W <= 4096`` (fp32: ``64 < W <= 4096`` too) without
    gradients, the chunked PyTorch path otherwise.

    ``log_decay`` (gated): the softmax part is unchanged; the linear weights become ``(fq_i.fk_j) e^{b_i - b_j}``
    and the initial state's ``e^{b_i}`` (``b`` = cumulative sum of ``log_decay`` in this call): the decay applies
    to the tokens older than the window; it accrues from each key's own position, so a token leaving the window
    has already decayed by the window's W steps. The final state is the linear state of tokens ``j <= T-1-W``
    decayed to position ``T-1-W`` (``initial_state`` unchanged if ``T <= W``); to continue, prepend the
    previous ``W`` tokens with their ``log_decay`` as above. Padding tokens do not decay.

    ``sink_mask`` (attention sinks, :mod:`linearize.kernels.sinks`): those keys are in the softmax part of every
    later query, inside the window or not, and in no linear sum or final state (their ``fk`` is ignored). The
    kernels run with the sinks' features zeroed and the sinks out of each window are merged after them.
    ``return_lse``: also return ``lse [B, T, H]`` fp32, the log of each query's normaliser (``(o, state, lse)``).
    """
    _check("window_linear_attention(q,k,v)", q, k, v, None)
    _check("window_linear_attention(fq,fk,v)", fq, fk, v, initial_state)
    log_decay = check_log_decay("window_linear_attention", log_decay, (*k.shape[:3],))
    if tuple(window_factor.shape) != (q.shape[2],):
        raise ValueError(f"window_factor must have shape [H]=[{q.shape[2]}], got {tuple(window_factor.shape)}")
    if int(window) < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    be = _resolve_backend(backend, q)
    kw = dict(
        window=int(window), scale=scale, eps=eps, initial_state=initial_state, output_final_state=output_final_state
    )
    if key_mask is not None:
        _check_key_mask("window_linear_attention", key_mask, k)
        kw["key_mask"] = key_mask
    if log_decay is not None:
        kw["log_decay"] = log_decay
    if be == "reference":
        return window_linear_attention_reference(q, k, fq, fk, v, window_factor, sink_mask=sink_mask,
                                                 return_lse=return_lse, **kw)
    if sink_mask is not None:
        if tuple(sink_mask.shape) != tuple(k.shape[:2]) or sink_mask.dtype != torch.bool:
            raise ValueError(f"window_linear_attention: sink_mask must be a bool [B, T]={tuple(k.shape[:2])} "
                             f"tensor, got {sink_mask.dtype} {tuple(sink_mask.shape)}")
        if key_mask is not None:
            sink_mask = sink_mask & key_mask
        (fk,) = drop_keys(~sink_mask, fk)  # the sinks stay out of every linear sum
    kw["return_lse"] = return_lse or sink_mask is not None
    if be == "torch":
        out = window_linear_attention_chunked(q, k, fq, fk, v, window_factor, **kw)
    else:
        from .triton_window import window_linear_attention_triton  # triton is optional: imported only on the Triton path

        if log_decay is not None and not takes_log_decay(window_linear_attention_triton):
            out = window_linear_attention_chunked(q, k, fq, fk, v, window_factor, **kw)
        else:
            out = window_linear_attention_triton(q, k, fq, fk, v, window_factor, **kw)
    if sink_mask is None:
        return out
    o, state, lse = out
    n = int(sink_mask.sum(1).max())  # the most sinks of any row
    if n:
        found = gather_sinks(sink_mask, n, k, v)
        seen = sink_visibility(found, torch.arange(q.shape[1], device=q.device), int(window))
        o, lse = merge_sinks(o, lse, q, found, seen, window_factor, q.shape[-1] ** -0.5 if scale is None else scale)
    return (o, state, lse) if return_lse else (o, state)


def window_linear_attention_hedgehog(
    q: torch.Tensor,  # [B, T, H, D]  raw post-rotary queries
    k: torch.Tensor,  # [B, T, Hk, D] raw post-rotary keys
    v: torch.Tensor,  # [B, T, Hk, V]
    window_factor: torch.Tensor,  # [H], in (0, 1)
    weight_q: torch.Tensor,  # [H, D, f]  Hedgehog projection of the queries
    weight_k: torch.Tensor,  # [Hk, D, f] Hedgehog projection of the keys
    *,
    fk: Optional[torch.Tensor] = None,  # [B, T, Hk, 2f] key features, when the caller has them already
    window: int = 64,
    scale: Optional[float] = None,
    eps: float = 1e-12,
    feature_eps: float = 1e-12,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    backend: Optional[str] = None,
    log_decay: Optional[torch.Tensor] = None,  # [B, T, Hk], <= 0
) -> Tuple[torch.Tensor, Optional[State]]:
    """:func:`window_linear_attention` with ``fq = hedgehog_features(q, weight_q)`` and
    ``fk = hedgehog_features(k, weight_k)`` (computed in fp32, rounded to ``q``'s dtype, clamped to
    ``>= feature_eps``).

    On the Triton path, when no gradient is needed, the features are computed inside the forward kernel from
    the ``q``, ``k`` tiles it loads anyway, so ``fq`` (and ``fk`` unless given) never reach memory; key
    features are still materialised for a segmented launch (long ``T``, few heads) and for the final state.
    Otherwise (gradients, or the ``torch`` / ``reference`` backends) the features are computed first and
    :func:`window_linear_attention` runs as usual, so autograd works. The kernel rounds the projections to
    ``q``'s dtype (a bf16 model's own weights are bf16 already). With ``log_decay`` the features are always
    computed first (the fused kernel has no decay).
    """
    H = q.shape[2]
    K = _hedgehog_shapes("window_linear_attention_hedgehog", q, k, weight_q, weight_k)
    be = _resolve_backend(backend, q)
    kw = dict(window=int(window), scale=scale, eps=eps, initial_state=initial_state,
              output_final_state=output_final_state)
    if log_decay is not None or be != "triton" or \
            needs_grad(q, k, v, window_factor, weight_q, weight_k, fk, *(initial_state or ())) or \
            not _projection_fits(q.shape[-1], K, q.dtype):
        fq, fk = _features_first(q, k, weight_q, weight_k, feature_eps, fk)
        return window_linear_attention(q, k, fq, fk, v, window_factor, backend=backend, log_decay=log_decay, **kw)
    _check("window_linear_attention_hedgehog(q,k,v)", q, k, v, initial_state, qk_dim_pairs=(K,))
    if fk is not None and tuple(fk.shape) != (*k.shape[:3], K):
        raise ValueError(f"fk must have shape [B, T, Hk, 2f]={(*k.shape[:3], K)}, got {tuple(fk.shape)}")
    if tuple(window_factor.shape) != (H,):
        raise ValueError(f"window_factor must have shape [H]=[{H}], got {tuple(window_factor.shape)}")
    if int(window) < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    from .triton_window import window_linear_attention_hedgehog_triton  # triton is optional: imported only on the Triton path

    return window_linear_attention_hedgehog_triton(q, k, v, window_factor, weight_q, weight_k, fk=fk,
                                                   feature_eps=feature_eps, **kw)


def linear_attention_step_hedgehog(
    q: torch.Tensor,  # [B, H, D] raw query
    k: torch.Tensor,  # [B, Hk, D]
    v: torch.Tensor,  # [B, Hk, V]
    weight_q: torch.Tensor,  # [H, D, f]
    weight_k: torch.Tensor,  # [Hk, D, f]
    state: State,  # (S [B, Hk, 2f, V] fp32, z [B, Hk, 2f] fp32), updated in place
    *,
    normalize: bool = True,
    eps: float = 1e-6,
    feature_eps: float = 1e-12,
    out: Optional[torch.Tensor] = None,  # [B, H, V]
    backend: Optional[str] = None,
    signed: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    log_decay: Optional[torch.Tensor] = None,  # [B, Hk], <= 0
) -> torch.Tensor:
    """:func:`linear_attention_step` of the Hedgehog features of ``q`` and ``k``, computed inside the step kernel
    on the Triton path (see :func:`window_linear_attention_step_hedgehog`), first elsewhere and with
    ``log_decay``."""
    features = _hedgehog_shapes("linear_attention_step_hedgehog", q.unsqueeze(1), k.unsqueeze(1), weight_q, weight_k)

    def features_first():  # off Triton, gated, or where the projections do not fit the kernel's shared memory
        fq, fk = _features_first(q.unsqueeze(1), k.unsqueeze(1), weight_q, weight_k, feature_eps)
        return linear_attention_step(fq[:, 0], fk[:, 0], v, state, normalize=normalize, eps=eps, out=out,
                                     backend=backend, log_decay=log_decay)

    if log_decay is not None or _resolve_backend(backend, q) != "triton":
        return features_first()
    from .triton_common import signed_projections, triton_or_fallback  # triton is optional: imported only on the Triton path
    from .triton_step import linear_step_triton  # triton is optional: imported only on the Triton path

    S, z = check_linear_state("linear_attention_step_hedgehog", state)
    wqx, wkx = signed if signed is not None else signed_projections(weight_q, weight_k, q.dtype)
    return triton_or_fallback(
        ("linear_step_hedgehog", tuple(q.shape), tuple(k.shape), tuple(weight_q.shape), v.shape[-1], q.dtype),
        lambda: linear_step_triton(q, k, v, S, z, normalize=normalize, eps=eps, out=out, wqx=wqx, wkx=wkx,
                                   feps=feature_eps), features_first,
        fits=_projection_fits(q.shape[-1], features, q.dtype))


def window_linear_attention_step_hedgehog(
    q: torch.Tensor,  # [B, H, D] raw post-rotary query
    k: torch.Tensor,  # [B, Hk, D]
    v: torch.Tensor,  # [B, Hk, V]
    window_factor: torch.Tensor,  # [H] in (0, 1)
    weight_q: torch.Tensor,  # [H, D, f]
    weight_k: torch.Tensor,  # [Hk, D, f]
    state: WindowState,  # updated in place
    *,
    scale: Optional[float] = None,
    eps: float = 1e-12,
    feature_eps: float = 1e-12,
    out: Optional[torch.Tensor] = None,  # [B, H, V]
    backend: Optional[str] = None,
    signed: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    log_decay: Optional[torch.Tensor] = None,  # [B, Hk], <= 0
    sinks: Optional[Sinks] = None,
) -> torch.Tensor:
    """:func:`window_linear_attention_step` of ``hedgehog_features(q, weight_q)``, ``hedgehog_features(k,
    weight_k)``. On the Triton path the step kernel computes both from the raw rows (no feature tensors, no
    separate launches for the maps); ``signed`` passes ``signed_projections(weight_q, weight_k, q.dtype)``
    when the caller keeps them (otherwise they are made per call). Elsewhere, and with ``log_decay``, the
    features are computed first.
    """
    features = _hedgehog_shapes("window_linear_attention_step_hedgehog", q.unsqueeze(1), k.unsqueeze(1), weight_q,
                                weight_k)

    def features_first():  # off Triton, gated, or where the projections do not fit the kernel's shared memory
        fq, fk = _features_first(q.unsqueeze(1), k.unsqueeze(1), weight_q, weight_k, feature_eps)
        return window_linear_attention_step(q, k, fq[:, 0], fk[:, 0], v, window_factor, state, scale=scale, eps=eps,
                                            out=out, backend=backend, log_decay=log_decay, sinks=sinks)

    if log_decay is not None or _resolve_backend(backend, q) != "triton":
        return features_first()
    from .triton_common import signed_projections, triton_or_fallback  # triton is optional: imported only on the Triton path
    from .triton_step import window_step_triton  # triton is optional: imported only on the Triton path

    wqx, wkx = signed if signed is not None else signed_projections(weight_q, weight_k, q.dtype)
    return triton_or_fallback(
        ("window_step_hedgehog", tuple(q.shape), tuple(k.shape), tuple(weight_q.shape), v.shape[-1], q.dtype),
        lambda: window_step_triton(q, k, None, None, v, window_factor, WindowState(*state),
                                   scale=q.shape[-1] ** -0.5 if scale is None else scale, eps=eps, out=out,
                                   wqx=wqx, wkx=wkx, feps=feature_eps, sinks=sinks), features_first,
        fits=_projection_fits(q.shape[-1], features, q.dtype))


def _hedgehog_shapes(name: str, q, k, weight_q, weight_k) -> int:
    """Check the Hedgehog projections against ``q``, ``k``; return the feature count ``2f``."""
    H, D, Hk = q.shape[2], q.shape[3], k.shape[2]
    if weight_q.dim() != 3 or tuple(weight_q.shape[:2]) != (H, D):
        raise ValueError(f"{name}: weight_q must have shape [H={H}, D={D}, f], got {tuple(weight_q.shape)}")
    if tuple(weight_k.shape) != (Hk, D, weight_q.shape[2]):
        raise ValueError(f"{name}: weight_k must have shape [Hk={Hk}, D={D}, f={weight_q.shape[2]}], "
                         f"got {tuple(weight_k.shape)}")
    return 2 * weight_q.shape[2]


def _projection_fits(D: int, features: int, dtype: torch.dtype) -> bool:
    """:func:`triton_common.projection_fits` (imported late: ``triton`` is optional off the GPU path)."""
    from .triton_common import projection_fits  # triton is optional: imported only on the Triton path

    return projection_fits(D, features, dtype)


def hedgehog_feature_map(
    x: torch.Tensor,  # [B, T, H, D]
    weight: torch.Tensor,  # [H, D, f]
    *,
    eps: float = 1e-12,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Hedgehog features ``[softmax(x W), softmax(-x W)]`` per head, clamped to ``>= eps``: ``[B, T, H, 2f]`` in
    ``x``'s dtype, as :class:`linearize.model.feature_maps.HedgehogFeatureMap` computes them (fp32 math, or fp64 for
    fp64 inputs). The Triton path is one kernel that reads ``x`` once and writes the features once (fp32
    accumulation of a product with the weight rounded to ``x``'s dtype); it has no backward, so when a
    gradient is needed the features are computed by PyTorch on every backend."""
    if x.dim() != 4 or weight.dim() != 3 or weight.shape[:2] != (x.shape[2], x.shape[3]):
        raise ValueError(f"hedgehog_feature_map: x [B,T,H,D] and weight [H,D,f] expected, got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if _resolve_backend(backend, x) != "triton" or needs_grad:
        return hedgehog_features_rounded(x, weight, eps)
    from .triton_common import triton_or_fallback  # triton is optional: imported only on the Triton path
    from .triton_features import hedgehog_feature_map_triton  # triton is optional: imported only on the Triton path

    return triton_or_fallback(("feature_map", x.shape[2:], tuple(weight.shape), x.dtype),
                              lambda: hedgehog_feature_map_triton(x, weight, eps),
                              lambda: hedgehog_features_rounded(x, weight, eps),
                              fits=_projection_fits(x.shape[-1], 2 * weight.shape[-1], x.dtype))


def rotary_embedding(
    q: torch.Tensor,  # [B, T, H, D]
    k: torch.Tensor,  # [B, T, Hk, D]
    cos: torch.Tensor,  # [B or 1, T, R], R <= D (R < D: partial rotary)
    sin: torch.Tensor,  # [B or 1, T, R]
    *,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding ``x * cos + rotate_half(x) * sin`` of queries and keys (the Llama convention);
    tables narrower than the heads turn their first ``R`` dims and pass the rest through (Phi-4-mini).
    The Triton path rotates both in one kernel (fp32 arithmetic, one rounding; the backward is the transposed
    rotation); ``"torch"`` / ``"reference"``, and tables that need a gradient or are not ``[B or 1, T, R]`` with an
    even ``R <= D``, compute the formula in the inputs' dtype as the original attention modules do."""
    be = _resolve_backend(backend, q)
    B, T, _, D = q.shape
    R = cos.shape[-1]
    plain = (cos.dim() == 3 and cos.shape == sin.shape and cos.shape[0] in (1, B) and cos.shape[1] == T
             and 0 < R <= D and R % 2 == 0)
    if be != "triton" or not plain or cos.requires_grad or sin.requires_grad:
        return rotary_reference(q, k, cos, sin)
    from .triton_rotary import RotaryTriton  # triton is optional: imported only on the Triton path

    return RotaryTriton.apply(q, k, cos, sin)


def rms_norm(
    x: torch.Tensor,  # [..., N]
    weight: torch.Tensor,  # [N]
    eps: float,
    *,
    form: str = "llama",
    backend: Optional[str] = None,
) -> torch.Tensor:
    """RMS norm of ``x`` in the rounding order ``form`` (:data:`RMS_NORM_FORMS`: ``llama``, ``olmo2``, ``gemma``;
    :func:`rms_norm_reference` spells them out), as a family's own module computes it. The Triton path normalises a
    row per program in one launch, where PyTorch runs seven kernels (outputs agree to a unit in the last place);
    it has no backward, so a call that needs gradients, and the ``"torch"`` / ``"reference"`` backends, compute
    the reference."""
    if form not in RMS_NORM_FORMS:
        raise ValueError(f"form must be one of {RMS_NORM_FORMS}, got {form!r}")
    if x.shape[-1] != weight.numel():
        raise ValueError(f"rms_norm: x has {x.shape[-1]} channels and weight {weight.numel()}")
    if _resolve_backend(backend, x) != "triton" or needs_grad(x, weight) or x.dtype == torch.float64:
        return rms_norm_reference(x, weight, eps, form)
    from .triton_norm import rms_norm_triton  # triton is optional: imported only on the Triton path

    return rms_norm_triton(x, weight, eps, form)


def _features_first(q, k, weight_q, weight_k, feature_eps, fk=None):
    """:func:`hedgehog_features_rounded` of ``q`` and ``k``; ``fk`` when the caller already has the key features."""
    fq = hedgehog_features_rounded(q, weight_q, feature_eps)
    return fq, (fk if fk is not None else hedgehog_features_rounded(k, weight_k, feature_eps))


def linear_attention_hedgehog(
    q: torch.Tensor,  # [B, T, H, D]  raw queries
    k: torch.Tensor,  # [B, T, Hk, D] raw keys
    v: torch.Tensor,  # [B, T, Hk, V]
    weight_q: torch.Tensor,  # [H, D, f]
    weight_k: torch.Tensor,  # [Hk, D, f]
    *,
    normalize: bool = True,
    eps: float = 1e-6,
    feature_eps: float = 1e-12,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    backend: Optional[str] = None,
    log_decay: Optional[torch.Tensor] = None,  # [B, T, Hk], <= 0
) -> Tuple[torch.Tensor, Optional[State]]:
    """:func:`linear_attention` of ``hedgehog_features(q, weight_q)``, ``hedgehog_features(k, weight_k)``.

    On the Triton path without gradients the features are computed inside the forward kernel, so only the
    raw ``q``, ``k`` (``D`` wide instead of ``2f``) are read; key features are materialised only for a
    segmented launch (long ``T``, few heads). Otherwise, and with ``log_decay`` (the fused kernel has no
    decay), the features are computed first (autograd works).
    The kernel rounds the projections to ``q``'s dtype (a bf16 model's own weights are bf16 already).
    """
    K = _hedgehog_shapes("linear_attention_hedgehog", q, k, weight_q, weight_k)
    be = _resolve_backend(backend, q)
    kw = dict(normalize=normalize, eps=eps, initial_state=initial_state, output_final_state=output_final_state)
    if log_decay is not None or be != "triton" or needs_grad(q, k, v, weight_q, weight_k, *(initial_state or ())) \
            or not _projection_fits(q.shape[-1], K, q.dtype):
        fq, fk = _features_first(q, k, weight_q, weight_k, feature_eps)
        return linear_attention(fq, fk, v, backend=backend, log_decay=log_decay, **kw)
    _check("linear_attention_hedgehog(q,k,v)", q, k, v, initial_state, qk_dim_pairs=(K,))
    from .triton_linear import linear_attention_hedgehog_triton  # triton is optional: imported only on the Triton path

    return linear_attention_hedgehog_triton(q, k, v, weight_q, weight_k, feature_eps=feature_eps, **kw)

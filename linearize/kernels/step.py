"""One-token decode steps for linear attention and the window hybrid.

Both update their state in place and allocate nothing but the output (pass
``out=`` to avoid even that), so a captured CUDA graph can replay them. On CUDA
tensors they run one fused Triton kernel (``triton_step.py``); elsewhere a few
in-place PyTorch ops that never read the step counter back to the host. Gated
steps (``log_decay``) run the Triton kernel only once it takes ``log_decay``
(:func:`takes_log_decay`), the PyTorch ops otherwise.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from .reference import drop_decay, drop_keys

State = Tuple[torch.Tensor, torch.Tensor]


class WindowState(NamedTuple):
    """Decode state of one window-hybrid layer.

    ``S`` [B, Hk, K, V] fp32 and ``z`` [B, Hk, K] fp32: linear state of every token
    older than the window; ``k_ring`` [B, Hk, W, D], ``fk_ring`` [B, Hk, W, K],
    ``v_ring`` [B, Hk, W, V]: the last ``W`` tokens, token ``t`` in slot ``t % W``;
    ``seen`` int64 [1]: tokens processed so far (lives on the device); ``keep`` bool [B, W]: False where a
    slot holds a padding token of the prefill (left out of the window; its features are zero in the rings, so
    it adds nothing when it leaves the window either); ``ld_ring`` [B, Hk, W] (``S``'s dtype) for a gated layer:
    the log decays of the tokens in the window (0 in empty and padding slots), ``[B, Hk, 0]`` without decay. With
    decay, ``S`` and ``z`` are the state of the tokens older than the window decayed to the position of the
    newest of them.
    """

    S: torch.Tensor
    z: torch.Tensor
    k_ring: torch.Tensor
    fk_ring: torch.Tensor
    v_ring: torch.Tensor
    seen: torch.Tensor
    keep: torch.Tensor
    ld_ring: torch.Tensor

    @property
    def window(self) -> int:
        return self.k_ring.shape[2]

    @property
    def gated(self) -> bool:
        """Whether the state carries log decays (built with ``log_decay`` / ``gated=True``)."""
        return self.ld_ring.shape[2] > 0


def empty_linear_state(
    batch: int, kv_heads: int, key_dim: int, value_dim: int, *, device=None, dtype=torch.float32
) -> State:
    """Zero linear-attention state ``(S [B,Hk,K,V], z [B,Hk,K])``."""
    S = torch.zeros(batch, kv_heads, key_dim, value_dim, device=device, dtype=dtype)
    z = torch.zeros(batch, kv_heads, key_dim, device=device, dtype=dtype)
    return S, z


def empty_window_state(
    batch: int,
    kv_heads: int,
    head_dim: int,
    feature_dim: int,
    value_dim: int,
    window: int = 64,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device=None,
    state_dtype: torch.dtype = torch.float32,
    gated: bool = False,
) -> WindowState:
    """Zero window-hybrid decode state (nothing seen yet). ``dtype`` is the ring's, ``state_dtype``
    that of ``S``, ``z`` and the log-decay ring (fp32; float64 only for float64 models); ``gated``: steps take
    ``log_decay`` (the ring of log decays is allocated)."""
    S, z = empty_linear_state(batch, kv_heads, feature_dim, value_dim, device=device, dtype=state_dtype)
    return WindowState(
        S=S,
        z=z,
        k_ring=torch.zeros(batch, kv_heads, window, head_dim, device=device, dtype=dtype),
        fk_ring=torch.zeros(batch, kv_heads, window, feature_dim, device=device, dtype=dtype),
        v_ring=torch.zeros(batch, kv_heads, window, value_dim, device=device, dtype=dtype),
        seen=torch.zeros(1, device=device, dtype=torch.int64),
        keep=torch.ones(batch, window, device=device, dtype=torch.bool),
        ld_ring=torch.zeros(batch, kv_heads, window if gated else 0, device=device, dtype=state_dtype),
    )


@torch.no_grad()
def window_state_from_prefill(
    k: torch.Tensor,  # [B, T, Hk, D] raw keys of the prefill
    fk: torch.Tensor,  # [B, T, Hk, K]
    v: torch.Tensor,  # [B, T, Hk, V]
    final_state: Optional[State],
    window: int = 64,
    *,
    offset: int = 0,
    key_mask: Optional[torch.Tensor] = None,  # [B, T] bool, False = a padding token
    log_decay: Optional[torch.Tensor] = None,  # [B, T, Hk], <= 0
) -> WindowState:
    """Build the decode state after a prefill.

    ``final_state`` is what ``window_linear_attention(..., output_final_state=True)``
    returned for the same ``k, fk, v`` (and ``key_mask``, ``log_decay``; ``None`` means zeros). The last ``W``
    tokens go to ring slots ``position % W`` (their log decays to ``ld_ring``); ``seen = offset + T``.
    ``offset`` is the absolute position of ``k[:, 0]`` (0 for a fresh sequence). Prefill of T tokens followed by
    N steps (with ``log_decay`` on each step when the prefill had it) then equals one forward over T + N
    tokens; padding tokens (``key_mask`` False) stay out of the window of every step and do not decay.
    """
    B, T, Hk, D = k.shape
    W = int(window)
    log_decay = check_log_decay("window_state_from_prefill", log_decay, (B, T, Hk))
    state_dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
    st = empty_window_state(B, Hk, D, fk.shape[-1], v.shape[-1], W, dtype=k.dtype, device=k.device,
                            state_dtype=state_dtype, gated=log_decay is not None)
    n = min(T, W)
    if key_mask is not None:
        k, fk, v = drop_keys(key_mask, k, fk, v)
        if log_decay is not None:
            log_decay = drop_decay(key_mask, log_decay)
    if n:
        slots = (torch.arange(T - n, T, device=k.device) + offset) % W
        if key_mask is not None:
            st.keep[:, slots] = key_mask[:, T - n :]
        st.k_ring[:, :, slots] = k[:, T - n :].transpose(1, 2).to(st.k_ring.dtype)
        st.fk_ring[:, :, slots] = fk[:, T - n :].transpose(1, 2).to(st.fk_ring.dtype)
        st.v_ring[:, :, slots] = v[:, T - n :].transpose(1, 2).to(st.v_ring.dtype)
        if log_decay is not None:
            st.ld_ring[:, :, slots] = log_decay[:, T - n :].transpose(1, 2).to(st.ld_ring.dtype)
    if final_state is not None:
        st.S.copy_(final_state[0].detach())
        st.z.copy_(final_state[1].detach())
    st.seen.fill_(offset + T)
    return st


def _use_triton(x: torch.Tensor, backend: Optional[str]) -> bool:
    if backend == "triton":
        return True
    if backend in ("torch", "reference"):
        return False
    if backend is not None:
        raise ValueError(f"backend must be None, 'triton', 'torch' or 'reference', got {backend!r}")
    return x.is_cuda


@lru_cache(maxsize=None)
def takes_log_decay(fn: Callable) -> bool:
    """Whether a kernel entry point accepts ``log_decay=`` (gated inputs go to a Triton path only then; the
    PyTorch path otherwise)."""
    return "log_decay" in inspect.signature(fn).parameters


# ---------------------------------------------------------------------------
# linear attention step


def _linear_step_torch(q, k, v, S, z, normalize, eps, out, log_decay=None):
    B, H, K = q.shape
    Hk, V = k.shape[1], v.shape[-1]
    G = H // Hk
    dt = S.dtype
    kf, vf = k.to(dt), v.to(dt)
    if log_decay is not None:  # S <- e^{ld} S + k v^T
        keep = log_decay.to(dt).exp()  # [B, Hk]
        S.mul_(keep[..., None, None])
        z.mul_(keep[..., None])
    S.view(B * Hk, K, V).baddbmm_(kf.reshape(B * Hk, K, 1), vf.reshape(B * Hk, 1, V))
    z.add_(kf)
    qf = q.to(dt).reshape(B, Hk, G, K)
    o = qf @ S  # [B, Hk, G, V]
    if normalize:
        o = o / ((qf @ z.unsqueeze(-1)) + eps)
    o = o.reshape(B, H, V)
    if out is None:
        return o.to(v.dtype)
    out.copy_(o)
    return out


def fold_tokens(
    S: torch.Tensor,  # [B, Hk, K, V] state of a prefix of the stream
    z: torch.Tensor,  # [B, Hk, K]
    fk: torch.Tensor,  # [B, n, Hk, K] key features of the next n tokens
    v: torch.Tensor,  # [B, n, Hk, V]
    log_decay: Optional[torch.Tensor] = None,  # [B, n, Hk], <= 0
    key_mask: Optional[torch.Tensor] = None,  # [B, n] bool, False = a padding token
) -> State:
    """The state after ``n`` more tokens, as new tensors in ``S``'s dtype: ``S <- e^{ld_t} S + fk_t v_t^T`` (and
    ``z``) for each token in order, in closed form (one product per token's suffix decay). Padding tokens add
    nothing and do not decay. Used to rebuild a state from a snapshot when a cache takes tokens back."""
    dt = S.dtype
    if key_mask is not None:
        fk, v = drop_keys(key_mask, fk, v)
        if log_decay is not None:
            log_decay = drop_decay(key_mask, log_decay)
    fk, v = fk.to(dt), v.to(dt)
    if log_decay is None:
        return S + torch.einsum("bnhk,bnhv->bhkv", fk, v), z + fk.sum(1)
    ld = log_decay.to(dt)
    after = ld.flip(1).cumsum(1).flip(1) - ld  # [B, n, Hk]: the decay of each token by the ones after it
    w = after.exp()
    total = ld.sum(1).exp()  # [B, Hk]
    S = total[..., None, None] * S + torch.einsum("bnh,bnhk,bnhv->bhkv", w, fk, v)
    z = total[..., None] * z + torch.einsum("bnh,bnhk->bhk", w, fk)
    return S, z


def check_linear_state(name: str, state: State) -> State:
    """``(S, z)``, which a step updates in place: both must be contiguous."""
    S, z = state
    if not (S.is_contiguous() and z.is_contiguous()):
        raise ValueError(f"{name}: state tensors must be contiguous (updated in place)")
    return S, z


def check_log_decay(name: str, log_decay: Optional[torch.Tensor], shape: Tuple[int, ...]) -> Optional[torch.Tensor]:
    """``log_decay`` checked against ``shape`` (``[B, T, Hk]`` for a forward, ``[B, Hk]`` for a step) and cast to
    float32 (float64 stays float64); ``None`` passes through. The values (``<= 0``) are not checked: that would
    read them back to the host."""
    if log_decay is None:
        return None
    if not torch.is_tensor(log_decay) or not log_decay.is_floating_point() or tuple(log_decay.shape) != shape:
        got = f"{log_decay.dtype} {tuple(log_decay.shape)}" if torch.is_tensor(log_decay) else type(log_decay).__name__
        raise ValueError(f"{name}: log_decay must be a floating-point tensor of shape {list(shape)} "
                         f"(one per key/value head), got {got}")
    return log_decay if log_decay.dtype in (torch.float32, torch.float64) else log_decay.float()


def linear_attention_step(
    q: torch.Tensor,  # [B, H, K]
    k: torch.Tensor,  # [B, Hk, K]
    v: torch.Tensor,  # [B, Hk, V]
    state: State,  # (S [B, Hk, K, V] fp32, z [B, Hk, K] fp32), updated in place
    *,
    normalize: bool = True,
    eps: float = 1e-6,
    out: Optional[torch.Tensor] = None,  # [B, H, V]
    backend: Optional[str] = None,
    log_decay: Optional[torch.Tensor] = None,  # [B, Hk], <= 0
) -> torch.Tensor:
    """One decode token: ``S += k v^T; z += k`` in place, then ``o = q.S / (q.z + eps)``; with ``log_decay``
    ``S <- e^{log_decay} S + k v^T`` (and ``z``)."""
    S, z = check_linear_state("linear_attention_step", state)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    log_decay = check_log_decay("linear_attention_step", log_decay, tuple(k.shape[:2]))
    if _use_triton(q, backend):
        from .triton_step import linear_step_triton  # triton is optional: imported only on the Triton path

        if log_decay is None:
            return linear_step_triton(q, k, v, S, z, normalize=normalize, eps=eps, out=out)
        if takes_log_decay(linear_step_triton):
            return linear_step_triton(q, k, v, S, z, normalize=normalize, eps=eps, out=out, log_decay=log_decay)
    return _linear_step_torch(q, k, v, S, z, normalize, eps, out, log_decay)


# ---------------------------------------------------------------------------
# window hybrid step


def _window_step_torch(q, k, fq, fk, v, wf, st: WindowState, scale, eps, out, log_decay=None, sinks=None):
    S, z, kr, fkr, vr, seen, keep, ldr = st
    B, H, D = q.shape
    Hk, W = kr.shape[1], kr.shape[2]
    K, V = fkr.shape[-1], vr.shape[-1]
    G = H // Hk
    dt = S.dtype
    slot = seen % W  # [1]
    # fold the token leaving the window (t - W, in slot t % W) into the linear state
    leaving = (seen >= W).to(dt)
    f_old = fkr.index_select(2, slot).to(dt) * leaving  # [B, Hk, 1, K]
    v_old = vr.index_select(2, slot).to(dt)  # [B, Hk, 1, V]
    if log_decay is not None:  # the state moves to the leaving token's position: S <- e^{ld_old} S + fk v^T
        keep_old = (ldr.index_select(2, slot)[..., 0] * leaving).exp()  # [B, Hk]
        S.mul_(keep_old[..., None, None])
        z.mul_(keep_old[..., None])
        ldr.index_copy_(2, slot, log_decay.unsqueeze(2).to(ldr.dtype))
    S.view(B * Hk, K, V).baddbmm_(f_old.reshape(B * Hk, K, 1), v_old.reshape(B * Hk, 1, V))
    z.add_(f_old.reshape(B, Hk, K))
    kr.index_copy_(2, slot, k.unsqueeze(2).to(kr.dtype))
    fkr.index_copy_(2, slot, fk.unsqueeze(2).to(fkr.dtype))
    vr.index_copy_(2, slot, v.unsqueeze(2).to(vr.dtype))
    keep.index_fill_(1, slot, True)
    valid = (torch.arange(W, device=q.device) <= seen) & keep.view(B, 1, 1, W)  # slots written so far, no padding
    qf = q.to(dt).reshape(B, Hk, G, D)
    fqf = fq.to(dt).reshape(B, Hk, G, K)
    s = (qf @ kr.to(dt).transpose(-1, -2)) * scale  # [B, Hk, G, W]
    s = s.masked_fill(~valid, float("-inf"))
    values = vr.to(dt)  # [B, Hk, W, V]
    if sinks is not None:  # the sinks out of this token's window join the softmax part
        ss = (qf @ sinks.k.to(dt).permute(0, 2, 3, 1)) * scale  # [B, Hk, G, N]
        out_of_window = sinks.valid & (seen - sinks.pos >= W)  # [B, N]
        s = torch.cat([s, ss.masked_fill(~out_of_window.view(B, 1, 1, -1), float("-inf"))], -1)
        values = torch.cat([values, sinks.v.to(dt).transpose(1, 2)], 2)
    m = s.amax(-1, keepdim=True).clamp_min(0.0)
    em = torch.exp(-m)
    p = torch.exp(s - m)
    w = wf.to(dt).reshape(1, Hk, G, 1)
    lin = (1 - w) * em  # [B, Hk, G, 1]
    if log_decay is not None:  # the state decays by the window's log decays (the tokens after its position)
        lin = lin * ldr.sum(-1).exp()[..., None, None]
    num = w * (p @ values) + lin * (fqf @ S)
    den = w * p.sum(-1, keepdim=True) + lin * (fqf @ z.unsqueeze(-1)) + eps * em
    seen.add_(1)
    o = (num / den).reshape(B, H, V)
    if out is None:
        return o.to(v.dtype)
    out.copy_(o)
    return out


def window_linear_attention_step(
    q: torch.Tensor,  # [B, H, D] raw post-rotary query
    k: torch.Tensor,  # [B, Hk, D]
    fq: torch.Tensor,  # [B, H, K]
    fk: torch.Tensor,  # [B, Hk, K]
    v: torch.Tensor,  # [B, Hk, V]
    window_factor: torch.Tensor,  # [H] in (0, 1)
    state: WindowState,  # updated in place
    *,
    scale: Optional[float] = None,
    eps: float = 1e-12,
    out: Optional[torch.Tensor] = None,  # [B, H, V]
    backend: Optional[str] = None,
    log_decay: Optional[torch.Tensor] = None,  # [B, Hk], <= 0
    sinks=None,  # linearize.kernels.sinks.Sinks: attention sinks of the sequence
) -> torch.Tensor:
    """One decode token of the window hybrid (token index ``t = state.seen``).

    If ``t >= W`` the token in slot ``t % W`` (token ``t - W``) is first folded into
    ``S, z``; the new token is written to that slot; the output mixes softmax over
    the valid ring slots with linear attention over ``S, z``; then ``seen += 1``.
    With ``log_decay`` (the new token's): the fold is ``S <- e^{ld_{t-W}} S + fk v^T`` (the leaving token's log
    decay, from ``ld_ring``), the new token's goes to its slot, and the linear part is scaled by
    ``e^{sum of ld_ring}`` (the decay from the state's position to ``t``).
    ``sinks`` (:class:`~linearize.kernels.sinks.Sinks`): the valid sinks at positions ``<= t - W`` join the softmax
    part (younger ones are in the ring); the caller keeps their features out of the rings.
    """
    st = WindowState(*state)
    log_decay = check_log_decay("window_linear_attention_step", log_decay, tuple(k.shape[:2]))
    if st.gated != (log_decay is not None):
        raise ValueError("window_linear_attention_step: " + (
            "log_decay given for a state without decay (build it with empty_window_state(..., gated=True) or "
            "window_state_from_prefill(..., log_decay=...))" if log_decay is not None else
            "this state carries log decays: pass log_decay on every step"))
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if _use_triton(q, backend):
        from .triton_step import window_step_triton  # triton is optional: imported only on the Triton path

        if log_decay is None:
            return window_step_triton(q, k, fq, fk, v, window_factor, st, scale=scale, eps=eps, out=out, sinks=sinks)
        if takes_log_decay(window_step_triton):
            return window_step_triton(q, k, fq, fk, v, window_factor, st, scale=scale, eps=eps, out=out,
                                      log_decay=log_decay, sinks=sinks)
    return _window_step_torch(q, k, fq, fk, v, window_factor, st, scale, eps, out, log_decay, sinks)

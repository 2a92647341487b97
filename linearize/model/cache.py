"""The hybrid generation cache (transformers Cache API).

Softmax layers keep a growing KV cache (``DynamicLayer``; ``DynamicSlidingWindowLayer`` where the base model's
layer has a sliding window, as the original's cache does); linear layers keep a fixed-size
recurrent state ``(S, z)`` and, for window-hybrid layers, a ring buffer of the last W tokens
(``linearize.kernels.WindowState``); gated delta layers keep their state ``S`` (:class:`DeltaStateLayer`). Every
layer reports the number of tokens seen, so masks and position ids come out as for a plain dynamic cache.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from ..kernels import fold_tokens, gated_delta_rule, window_state_from_prefill
from ..kernels.sinks import Sinks
from .layout import FULL, GATED_DELTA

#: tokens a :meth:`HybridCache.crop` may take back (assisted / speculative decoding drafts are far shorter)
CROP_TOKENS = 256
#: whether this transformers release crops to a length to keep (``crop(max_length)``, older releases) rather than
#: by minus the number of tokens to remove (``crop(tokens_to_remove)``, 5.24)
_CROP_TAKES_LENGTH = "max_length" in inspect.signature(DynamicLayer.crop).parameters


def softmax_windows(config: Any) -> list[int | None]:
    """Per decoder layer, the sliding window of the base model's own softmax attention (None: every earlier token),
    read as transformers reads it: ``sliding_attention`` entries of the base ``layer_types`` take ``sliding_window``
    (Gemma 2 / 3, Qwen2 / 3 with sliding layers); without ``layer_types`` a ``sliding_window`` covers every layer
    (Mistral). A hybrid's config answers for its base model."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if getattr(config, "model_type", None) == "linearize":
        types = getattr(config, "base_layer_types", None)
    else:
        types = getattr(config, "layer_types", None)
    if not window:
        return [None] * n
    if types is None:
        return [int(window)] * n
    return [int(window) if t == "sliding_attention" else None for t in types]


class LinearStateLayer(CacheLayerMixin):
    """Cache of one linear-attention layer: a kernel state object and a token counter."""

    is_sliding = False
    is_compileable = False

    def __init__(self, **kwargs):
        super().__init__()
        self.state: Any = None  # (S, z) tuple or a WindowState
        self.seen = 0
        self.record_past = False  # keep the recent tokens so that crop() can take them back
        self.keep = CROP_TOKENS  # how many of them (besides the window)
        # while recording: (k, fk, v [B, n, Hk, *], keep [B, n], log decay [B, n, Hk]) of the last n tokens (a
        # delta layer: its kernel inputs), and (position a, *state): the state of the first a tokens, from which
        # crop() replays the rest
        self.history: tuple[torch.Tensor, ...] | None = None
        self.snapshot: tuple[int, torch.Tensor, ...] | None = None
        self.gated = False  # whether recorded tokens carried log decays
        self.sinks: Sinks | None = None  # a window layer's attention sinks (attention.sinks > 0)
        self.sinks_full = False  # whether every row has all its sinks (decode steps then add none)

    def lazy_initialization(self, key_states=None, value_states=None) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("a linear-attention layer keeps a recurrent state, not keys and values")

    def set_state(self, state: Any, new_tokens: int) -> None:
        """Record the layer's state after processing ``new_tokens`` more tokens."""
        self.state = state
        self.seen += int(new_tokens)
        self.is_initialized = True
        if isinstance(state, tuple) and len(state) and torch.is_tensor(state[0]):
            self.device = state[0].device

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        if torch.is_tensor(query_length):  # older transformers pass cache_position
            query_length = query_length.shape[0]
        return self.seen + int(query_length), 0

    def get_seq_length(self, *args) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state = None
        self.seen = 0
        self.history = None
        self.snapshot = None
        self.gated = False
        self.sinks = None
        self.sinks_full = False
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state = type(self.state)(*(
                t if t.dim() == 1 else t.index_select(0, beam_idx.to(t.device)) for t in self.state
            )) if hasattr(self.state, "_fields") else tuple(t.index_select(0, beam_idx.to(t.device)) for t in self.state)
        self.reorder_recording(beam_idx)
        if self.sinks is not None:
            self.sinks = Sinks(*(t.index_select(0, beam_idx.to(t.device)) for t in self.sinks))

    # -- taking tokens back (assisted / speculative decoding) ------------------------------------
    def reorder_recording(self, beam_idx: torch.LongTensor) -> None:
        """The history and the snapshot follow a beam reordering."""
        def pick(t):
            return t.index_select(0, beam_idx.to(t.device))
        if self.history is not None:
            self.history = tuple(map(pick, self.history))
        if self.snapshot is not None:
            a, *state = self.snapshot
            self.snapshot = (a, *map(pick, state))

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """Keep the last ``window + max(CROP_TOKENS, recurrent_states_to_keep)`` tokens' keys, key features and values
        from now on (transformers 5.25 passes the longest draft it may take back; older releases pass nothing)."""
        self.record_past = True
        self.keep = max(self.keep, int(recurrent_states_to_keep or 0))

    @property
    def recurrent_states_to_keep(self) -> int:
        """How many tokens :meth:`crop` can take back (transformers' ``Cache.get_recurrent_states_to_keep``)."""
        return self.keep if self.record_past else 0

    @property
    def is_croppable(self) -> bool:
        return self.record_past

    def record(self, k: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, window: int,
               log_decay: torch.Tensor | None = None) -> None:
        """Before a forward updates the state: append its tokens (``k [B, T, Hk, D]``, ``fk`` (sinks zeroed), ``v``,
        ``keep [B, T]`` or None, ``log_decay [B, T, Hk]`` or None) to the history, which holds the last
        ``window + self.keep``, and move the snapshot to the state of the tokens that no crop can take back: the
        first ``prefix(seen - self.keep)``, where ``prefix(p)`` is how many tokens the state ``S`` holds at stream
        position ``p`` (``p`` itself, or ``p - window`` for a window layer)."""
        B, T, Hk = k.shape[:3]
        W = int(window)
        dt = torch.float64 if k.dtype == torch.float64 else torch.float32  # the state's dtype, and the decays'
        ld = log_decay.detach().to(dt) if log_decay is not None else torch.zeros(B, T, Hk, dtype=dt, device=k.device)
        new = [k.detach(), fk.detach(), v.detach(),
               keep if keep is not None else torch.ones(B, T, dtype=torch.bool, device=k.device), ld]
        ring = None
        if self.history is None and hasattr(self.state, "_fields"):  # recording began after a forward: the ring
            n = min(self.seen, W)  # holds the tokens before it
            order = torch.arange(self.seen - n, self.seen, device=k.device) % W
            st = self.state
            ring = [st.k_ring[:, :, order].transpose(1, 2), st.fk_ring[:, :, order].transpose(1, 2),
                    st.v_ring[:, :, order].transpose(1, 2), st.keep[:, order],
                    (st.ld_ring[:, :, order].transpose(1, 2) if st.gated
                     else torch.zeros(B, n, Hk, dtype=dt, device=k.device))]
        self.gated = self.gated or log_decay is not None
        if self.state is not None:  # the state before this forward holds the first prefix(seen) tokens
            pre = (self.state.S, self.state.z) if hasattr(self.state, "_fields") else tuple(self.state)
        else:
            pre = (torch.zeros(B, Hk, fk.shape[-1], v.shape[-1], dtype=dt, device=k.device),
                   torch.zeros(B, Hk, fk.shape[-1], dtype=dt, device=k.device))
        self.remember(new, W, pre, before=ring)

    def remember(self, new: list, W: int, pre: tuple, before: list | None = None) -> None:
        """Keep a forward's tokens ``new`` (history layout, ``T`` of them) before it updates the state, and move the
        snapshot on: ``pre`` is the state before the forward, which holds the first ``prefix(seen)`` tokens
        (``prefix(p) = max(p - W, 0)``); ``before``, without a history yet, the tokens just before ``new`` that
        the state does not hold (a window ring). The snapshot moves to ``prefix(seen + T - keep)``, from ``pre``
        or, after a short forward, from the last snapshot."""
        T = new[0].shape[1]
        old = self.history if self.history is not None else before
        first = self.seen - (old[0].shape[1] if old is not None else 0)  # stream position of tokens[0]
        tokens = [torch.cat([h.to(x.dtype), x], dim=1) for h, x in zip(old, new)] if old is not None else new
        prefix = lambda p: max(p - W, 0)  # noqa: E731
        target = prefix(self.seen + T - self.keep)
        base = (prefix(self.seen), *pre)
        if base[0] > target and self.snapshot is not None and first <= self.snapshot[0] <= target:
            base = self.snapshot  # a short forward: move the last snapshot on instead
        a, *state = base
        target = max(target, a)  # recording began after a longer forward: crops reach back to its end only
        self.snapshot = (target, *self.fold(*state, tokens, a - first, target - first))
        cap = W + self.keep  # copies: a view would keep a long prompt's whole k, fk, v alive
        self.history = tuple(x[:, -cap:].clone() for x in tokens)

    def fold(self, S, z, tokens, lo: int, hi: int):
        """``(S, z)`` moved on by ``tokens[lo:hi]`` (history-layout tuple), as new tensors."""
        _, fk, v, keep, ld = (x[:, lo:hi] for x in tokens)
        return fold_tokens(S, z, fk, v, ld if self.gated else None, keep)

    def crop(self, tokens_to_remove: int) -> None:
        """Take back the last ``-tokens_to_remove`` tokens: the state is rebuilt from the snapshot and the history
        (equal to the state that never saw them, gated or not), and so is a window layer's ring."""
        r = -int(tokens_to_remove)
        if r <= 0 or self.state is None:
            return
        windowed = hasattr(self.state, "_fields")
        W = self.state.window if windowed else 0
        seen = self.seen - r
        lo = max(seen - W, 0)  # the state S holds the first lo tokens after the crop
        first, (S, z) = self.replay(r, lo)
        if not windowed:
            self.state = (S.contiguous(), z.contiguous())
        else:  # the new window's tokens go back into the ring
            k, fk, v, keep, ld = (x[:, lo - first:seen - first] for x in self.history)
            self.state = window_state_from_prefill(k, fk, v, (S, z), W, offset=lo, key_mask=keep,
                                                   log_decay=ld if self.state.gated else None)
        self.forget(r)
        if self.sinks is not None:  # sinks among the tokens taken back are gone
            self.sinks = self.sinks._replace(valid=self.sinks.valid & (self.sinks.pos < seen))
            self.sinks_full = bool(self.sinks.valid.all())

    def replay(self, r: int, lo: int) -> tuple[int, tuple]:
        """For a crop of ``r`` tokens: ``(first, state)``, the history's first stream position and the state of the
        first ``lo`` tokens, replayed from the snapshot (refused when the snapshot or history does not reach)."""
        held = 0 if self.history is None else self.history[0].shape[1]
        first = self.seen - held
        if not self.record_past or r > self.seen or self.snapshot is None or not first <= self.snapshot[0] <= lo:
            raise RuntimeError(f"a recurrent state can take back at most its last {self.keep} tokens, and only "
                               f"after activate_past_recording() (asked for {r}, {held} recorded)")
        a, *state = self.snapshot
        return first, self.fold(*state, self.history, a - first, lo - first)

    def forget(self, r: int) -> None:
        """Drop the last ``r`` tokens from the history and the count."""
        self.history = tuple(x[:, : x.shape[1] - r] for x in self.history)
        self.seen -= r

    def offload(self):  # states are small; nothing to offload
        pass

    def prefetch(self):
        pass

    @property
    def nbytes(self) -> int:
        """Bytes held by this layer's state."""
        if self.state is None:
            return 0
        held = tuple(self.state) + (tuple(self.sinks) if self.sinks is not None else ())
        return sum(t.numel() * t.element_size() for t in held)


class DeltaStateLayer(LinearStateLayer):
    """Cache of one gated delta layer: its state ``S`` ``[B, Hk, K, V]`` fp32 (a decode step updates it in place)
    and a token counter. Each write rescales what came before it, so taking tokens back replays the kept tokens
    from a snapshot (as for the other linear layers; there is no window)."""

    def set_state(self, state: torch.Tensor, new_tokens: int) -> None:
        """Record the layer's state after processing ``new_tokens`` more tokens."""
        self.state = state
        self.seen += int(new_tokens)
        self.is_initialized = True
        self.device = state.device

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state = self.state.index_select(0, beam_idx.to(self.state.device))
        self.reorder_recording(beam_idx)

    def record(self, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
               log_decay: torch.Tensor | None = None) -> None:
        """Before a forward updates the state: keep its kernel inputs (``k`` L2-normalised ``[B, T, Hk, K]``,
        ``v``, ``beta [B, T, Hk]``, ``log_decay`` or None; padding already has ``beta = 0`` and no decay) and move
        the snapshot on (:meth:`LinearStateLayer.remember`, no window)."""
        B, T, Hk = k.shape[:3]
        ld = log_decay.detach() if log_decay is not None else torch.zeros_like(beta)
        self.gated = self.gated or log_decay is not None
        pre = (self.state if self.state is not None
               else torch.zeros(B, Hk, k.shape[-1], v.shape[-1], dtype=torch.float32, device=k.device),)
        self.remember([k.detach(), v.detach(), beta.detach(), ld], 0, pre)

    def fold(self, S, tokens, lo: int, hi: int):
        """``(S,)`` moved on by ``tokens[lo:hi]`` (the delta rule's kernel from ``S``), as a new tensor."""
        if hi <= lo:
            return (S.clone(),)
        k, v, beta, ld = (x[:, lo:hi] for x in tokens)
        _, final = gated_delta_rule(k, k, v, beta, ld if self.gated else None, scale=1.0, initial_state=S,
                                    output_final_state=True)
        return (final,)

    def crop(self, tokens_to_remove: int) -> None:
        """Take back the last ``-tokens_to_remove`` tokens (replayed from the snapshot)."""
        r = -int(tokens_to_remove)
        if r <= 0 or self.state is None:
            return
        _, (S,) = self.replay(r, self.seen - r)
        self.state = S.contiguous()
        self.forget(r)

    @property
    def nbytes(self) -> int:
        """Bytes held by this layer's state."""
        return 0 if self.state is None else self.state.numel() * self.state.element_size()


def _accepted(fn, kwargs: dict) -> dict:
    """The part of ``kwargs`` that ``fn`` takes (all of it when ``fn`` has ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _cache_layer(layer_type: str, window: int | None) -> CacheLayerMixin:
    """The cache layer of one decoder layer: recurrent state for a converted layer (the delta rule's own for a gated
    delta one), KV for a softmax one (the last ``window`` tokens where the base layer slides)."""
    if layer_type == GATED_DELTA:
        return DeltaStateLayer()
    if layer_type != FULL:
        return LinearStateLayer()
    return DynamicSlidingWindowLayer(sliding_window=window) if window else DynamicLayer()


class HybridCache(Cache):
    """One cache layer per decoder layer: KV for ``full_attention`` (only the last ``windows[i]`` tokens where the
    base layer slides), recurrent state otherwise (:class:`DeltaStateLayer` for ``gated_delta``)."""

    def __init__(self, layer_types: list[str], windows: list[int | None] | None = None):
        windows = list(windows) if windows is not None else [None] * len(layer_types)
        super().__init__(layers=[_cache_layer(t, w) for t, w in zip(layer_types, windows)])
        self.layer_types = list(layer_types)
        self.windows = windows

    def linear_layer(self, idx: int) -> LinearStateLayer:
        layer = self.layers[idx]
        if not isinstance(layer, LinearStateLayer):
            raise RuntimeError(f"layer {idx} is a softmax layer in this cache")
        return layer

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        """Take back the last ``-tokens_to_remove`` tokens (transformers 5.24; releases whose layers crop to a length
        to keep pass that length, which is understood too). Linear layers need :meth:`activate_past_recording` first, which
        ``generate()`` calls for assisted decoding."""
        if _CROP_TAKES_LENGTH and tokens_to_remove >= 0:
            remove = self.get_seq_length() - tokens_to_remove
        else:
            remove = -tokens_to_remove
        for layer in self.layers:
            layer.crop(-remove if isinstance(layer, LinearStateLayer) else tokens_to_remove)

    def activate_past_recording(self, **kwargs) -> None:
        """Let :meth:`crop` take tokens back. ``kwargs`` (transformers 5.25: ``recurrent_states_to_keep``, the longest
        draft) reach each layer whose own method takes them; transformers' KV layers of older releases take none."""
        for layer in self.layers:
            fn = getattr(layer, "activate_past_recording", None)
            if fn is not None:
                fn(**_accepted(fn, kwargs))

    @property
    def is_croppable(self) -> bool:
        return all(getattr(layer, "is_croppable", True) for layer in self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes held: KV tensors of softmax layers plus states of linear layers."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, LinearStateLayer):
                total += layer.nbytes
            elif getattr(layer, "keys", None) is not None and layer.keys.numel():
                total += layer.keys.numel() * layer.keys.element_size() * 2
        return total

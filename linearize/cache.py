"""The hybrid generation cache (transformers Cache API).

Softmax layers keep a growing KV cache (``DynamicLayer``); linear layers keep a fixed-size
recurrent state ``(S, z)`` and, for window-hybrid layers, a ring buffer of the last W tokens
(``linearize.kernels.WindowState``). Every layer reports the number of tokens seen, so masks and
position ids come out as for a plain dynamic cache.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from .select import FULL


class LinearStateLayer(CacheLayerMixin):
    """Cache of one linear-attention layer: a kernel state object and a token counter."""

    is_sliding = False
    is_compileable = False

    def __init__(self, **kwargs):
        super().__init__()
        self.state: Any = None  # (S, z) tuple or a WindowState
        self.seen = 0

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
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state = type(self.state)(*(
                t if t.dim() == 1 else t.index_select(0, beam_idx.to(t.device)) for t in self.state
            )) if hasattr(self.state, "_fields") else tuple(t.index_select(0, beam_idx.to(t.device)) for t in self.state)

    def offload(self):  # states are small; nothing to offload
        pass

    def prefetch(self):
        pass

    @property
    def nbytes(self) -> int:
        """Bytes held by this layer's state."""
        if self.state is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.state)


class HybridCache(Cache):
    """One cache layer per decoder layer: KV for ``full_attention``, recurrent state otherwise."""

    def __init__(self, layer_types: list[str]):
        layers = [DynamicLayer() if t == FULL else LinearStateLayer() for t in layer_types]
        super().__init__(layers=layers)
        self.layer_types = list(layer_types)

    def linear_layer(self, idx: int) -> LinearStateLayer:
        layer = self.layers[idx]
        if not isinstance(layer, LinearStateLayer):
            raise RuntimeError(f"layer {idx} is a softmax layer in this cache")
        return layer

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a linear-attention state cannot be cropped (no speculative decoding)")

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

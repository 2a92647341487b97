"""Mask-free SDPA for the hybrid's softmax layers when their queries continue a cache without padding.

transformers' SDPA path builds no mask only where queries and keys have the same length (``is_causal=True``) or there
is one query. A piece of a chunked prefill after the first (:mod:`~linearize.model.prefill`), ``C`` queries over
``P + C`` keys, gets a boolean ``[B, 1, C, P + C]`` mask (8.6 GB for the last 8,192-token piece of a 128K x 8 prefill),
and flash attention refuses masks, so SDPA falls back to its memory-efficient or math kernel. Without padding that
mask is the causal one aligned to the bottom right (query ``i`` sees keys up to ``P + i``), which torch runs without
a mask tensor: ``attn_mask=causal_lower_right(C, P + C)`` dispatches to flash (or the memory-efficient kernel's own
causal variant).

So the hybrid runs ``sdpa`` as :data:`SDPA` (``linearize_sdpa``, :func:`attention_implementation`): an attention
function (transformers' ``AttentionInterface``) and a mask function (``AttentionMaskInterface``) registered under that
name. The mask function returns no mask for the plain causal mask (no sliding window, no overlay) when no key is padded
and the queries are the last keys; anything else is transformers' own ``sdpa_mask`` (sliding-window layers, padding,
packed sequences), which then never returns None for ``1 < queries < keys``, so that there a missing mask always means
the bottom-right causal one. The attention function runs that case and hands every other call to transformers'
``sdpa_attention_forward`` unchanged (one query, queries as long as the keys, a mask, non-causal layers).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention
from torch.nn.attention.bias import CausalBias, causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function
from transformers.masking_utils import sdpa_mask as transformers_sdpa_mask
from transformers.utils.import_utils import is_tracing

#: the attention implementation the hybrid's softmax layers run where the user asked for ``sdpa``
SDPA = "linearize_sdpa"
#: whether this torch's causal bias takes ``enable_gqa`` (releases without it dispatch the bias with KV heads repeated)
_BIAS_TAKES_GQA = "enable_gqa" in inspect.signature(getattr(CausalBias, "_dispatch", lambda: None)).parameters


def attention_implementation(impl: str) -> str:
    """The attention implementation the hybrid's softmax layers run for ``impl``: :data:`SDPA` (registered with
    transformers here) for ``sdpa``; any other (``eager``, ``flash_attention_*``, one of the user's) as it is."""
    if impl != "sdpa":
        return impl
    AttentionInterface.register(SDPA, sdpa_attention)  # idempotent; a bundled copy registers its own equal functions
    AttentionMaskInterface.register(SDPA, sdpa_mask)
    return SDPA


def _unpadded(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int) -> bool:
    """Whether no key of ``kv_offset .. kv_offset + kv_length - 1`` is padding in the 2-D ``attention_mask``
    ``[B, >= keys]``; False while a graph is traced or a stream captured (its values cannot be read then)."""
    if attention_mask is None:
        return True
    if is_tracing(attention_mask):
        return False
    keys = attention_mask[:, kv_offset:kv_offset + kv_length]  # [B, kv_length] bool
    return keys.shape[-1] == kv_length and bool(keys.all())


def sdpa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
              mask_function: Callable = causal_mask_function, attention_mask: torch.Tensor | None = None,
              local_size: int | None = None, allow_is_causal_skip: bool = True, **kwargs) -> torch.Tensor | None:
    """transformers' ``sdpa_mask`` (same arguments, same mask), except that ``1 < q_length < kv_length`` queries that
    are the last keys (``q_offset + q_length == kv_offset + kv_length``) of a plain causal mask without padding get
    None: :func:`sdpa_attention` runs them causally aligned to the bottom right."""
    if 1 < q_length < kv_length:
        last = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset + q_length == kv_offset + kv_length
        if (allow_is_causal_skip and mask_function is causal_mask_function and local_size is None and last
                and _unpadded(attention_mask, kv_length, kv_offset)):
            return None
        # transformers' own skip here (a static cache's empty tail) would mean the upper-left alignment
        allow_is_causal_skip = False
    return transformers_sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                                  kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                                  local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def _heads_as_they_are(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float) -> bool:
    """Whether torch's causal bias takes these grouped KV heads as they are: its flash kernel reads them per group
    of queries and its fallback (a ``[q, kv]`` mask) expands them itself; only its memory-efficient kernel, called
    directly, needs them repeated (this torch's bias may also predate ``enable_gqa``)."""
    if not _BIAS_TAKES_GQA:
        return False
    if can_use_flash_attention(SDPAParams(query, key, value, None, float(dropout), False, True)):
        return True
    repeated = SDPAParams(query[:, :key.shape[1]], key, value, None, float(dropout), False, False)  # as after repeat
    return not can_use_efficient_attention(repeated)


def causal_bottom_right(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float = 0.0,
                        scaling: float | None = None) -> torch.Tensor:
    """Causal SDPA of ``query`` ``[B, H, q, D]``, the last ``q`` of the ``kv`` positions of ``key`` / ``value``
    ``[B, Hk, kv, D]``, without a mask tensor: ``[B, q, H, D]``. Grouped KV heads stay as they are unless the
    memory-efficient kernel runs (then repeated, as transformers repeats them where it passes a mask)."""
    groups = query.shape[1] // key.shape[1]
    gqa = {}
    if groups > 1:
        if _heads_as_they_are(query, key, value, dropout):
            gqa["enable_gqa"] = True
        else:
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(query.shape[2], key.shape[2]),
                                         dropout_p=dropout, scale=scaling, **gqa)  # [B, H, q, D]
    return out.transpose(1, 2).contiguous()


def sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward`` (same arguments and output), except that a causal layer's
    ``1 < q < kv`` queries without a mask (:func:`sdpa_mask`'s None: the last keys, no padding) attend causally
    aligned to the bottom right without a mask tensor (:func:`causal_bottom_right`)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and causal and 1 < q_len < kv_len:
        if kwargs.get("position_bias") is None and kwargs.get("softcap") is None:
            return causal_bottom_right(query, key, value, dropout, scaling), None
        # a bias to add (transformers folds it into a mask): the same alignment as a dense mask
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)[None, None]
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)

"""Chunked prefill: a long inference forward of the hybrid as consecutive cached forwards of at most N tokens
(the batch's rows together).

Every decoder layer of the hybrid continues a cache exactly: a softmax layer appends to its KV cache (the last
``window`` tokens where the base layer slides), a linear layer carries its ``(S, z)`` state and window ring. So a
forward over ``T`` tokens equals, up to rounding, the same tokens fed to the cache in pieces, each piece given the
padding mask up to its end and its own position ids, as ``generate()`` feeds a continuation. Prefill in pieces never
holds a whole sequence's activations (the MLP's ``[B, T, intermediate]`` above all), only one piece's, so the prompt
length is bounded by the cache, not by the activations. :func:`chunked_forward` is that loop;
``LinearizeForCausalLM.forward`` decides when it runs (inference without gradients or labels, every converted layer
in linear mode, an input longer than one chunk).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: Tokens in one piece of a chunked prefill, all rows of the batch together (the config's ``prefill_chunk_tokens``;
#: 0: one whole forward): a batch of B rows runs pieces of ``prefill_chunk_tokens // B`` tokens per row
#: (:func:`row_chunk`), so a piece's activations are bounded whatever the batch. They are: at the Llama-3-8B shape
#: (hidden 4,096, MLP 14,336, bf16) one forward over 128K tokens holds 14.6 GiB beyond its weights and cache (an
#: H100, 2026-12-06: 33.7 GiB peak for 128K x 1 in one forward, 15.0 of weights and 4.1 of cache), 8.6 times that
#: for 128K x 8 or 1M x 1, which do not fit. Pieces are not free: a piece after the first attends bottom-right
#: aligned to the cache, which PyTorch's SDPA runs with flash attention 2 only, not cuDNN's faster kernel, so the
#: same 128K x 1 prefill ran at 24,555 tokens/s in one forward, 18,977 in 32K pieces and 17,590 in 8K pieces.
#: 131,072 keeps a 128K-token prompt at batch 1 in one forward and bounds every larger one to a piece's 14.6 GiB.
PREFILL_CHUNK_TOKENS = 131072


def row_chunk(budget: int, rows: int) -> int:
    """Tokens per row in one piece: ``budget`` tokens (the batch's rows together) split over ``rows``, at least 1;
    0 (no chunking) when ``budget`` is 0."""
    return max(1, budget // max(1, rows)) if budget else 0


def check_chunk_size(value: Any) -> int:
    """``value`` as a chunk size (an int >= 0; 0 means one whole forward), or a one-line ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"prefill_chunk_tokens={value!r}: expected a whole number of tokens >= 0 (0: no chunking)")
    return value


def kept_positions(logits_to_keep: int | torch.Tensor, T: int, start: int, end: int) -> tuple[Any, torch.Tensor | None]:
    """What ``logits_to_keep`` asks of positions ``start .. end-1`` of a ``T``-token forward: the chunk's own
    ``logits_to_keep`` (an int: its last n; a 1-D tensor: its positions; None: none of them) and, for a tensor, the
    indices into ``logits_to_keep`` that the chunk answers (in the order its logits come)."""
    if isinstance(logits_to_keep, int):
        if logits_to_keep == 0:
            return 0, None  # every position
        n = end - max(start, T - logits_to_keep)
        return (n if n > 0 else None), None
    if logits_to_keep.dtype == torch.bool:  # [T] bool: the positions marked
        wanted = logits_to_keep.nonzero().flatten()
    else:  # [n] positions; negative ones count from the end, as in a whole forward
        wanted = logits_to_keep.to(torch.long) % T
    inside = ((wanted >= start) & (wanted < end)).nonzero().flatten()
    return (wanted[inside] - start if inside.numel() else None), inside


def chunked_forward(step: Callable[..., Any], chunk: int, *, input_ids: torch.Tensor | None,
                    inputs_embeds: torch.Tensor | None, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor | None, past: int, logits_to_keep: int | torch.Tensor,
                    cache_position: torch.Tensor | None = None, return_cache: bool = True) -> Any:
    """Run ``step`` (one cached forward of the base family: ``step(input_ids=..., attention_mask=..., ...)`` returning
    a causal-LM output) over the input in pieces of ``chunk`` tokens and return one output for the whole input.

    ``past``: tokens already in the cache; ``attention_mask`` ``[B, past + T]`` (or None) covers them, so each piece
    gets the mask up to its own end; ``position_ids`` ``[*, T]`` and ``cache_position`` ``[T]`` (older transformers)
    are cut like the input. ``logits_to_keep`` (an int or a 1-D tensor of positions) means what it means for one
    forward: every piece computes only the logits asked of it, and the returned ``logits`` are theirs concatenated
    ``[B, n, vocab]``. The returned output is the last piece's with those logits, and without its cache unless
    ``return_cache``."""
    x = input_ids if input_ids is not None else inputs_embeds
    T = x.shape[1]
    logits, answered, last = [], [], None
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        keep, indices = kept_positions(logits_to_keep, T, start, end)
        pieces = {
            "input_ids": None if input_ids is None else input_ids[:, start:end],
            "inputs_embeds": None if inputs_embeds is None else inputs_embeds[:, start:end],
            "attention_mask": None if attention_mask is None else attention_mask[:, : past + end],
            "position_ids": None if position_ids is None else position_ids[..., start:end],
            "logits_to_keep": keep if keep is not None else x.new_zeros(0, dtype=torch.long),  # [0]: no position
        }
        if cache_position is not None:
            pieces["cache_position"] = cache_position[start:end]
        last = None  # the previous piece's output (its hidden states, its logits if unkept) is freed before the next
        last = step(**pieces)
        if keep is not None:
            logits.append(last.logits)
            if indices is not None:
                answered.append(indices)
    if not logits:  # an empty tensor of positions: every piece's logits are [B, 0, vocab]
        out = last.logits
    else:
        out = torch.cat(logits, dim=1) if len(logits) > 1 else logits[0]
    if answered:  # the pieces answer a tensor's positions in position order: back to the order asked
        out = out[:, torch.cat(answered).argsort()]
    dropped = ("logits",) if return_cache else ("logits", "cache", "past_key_values")
    fields = {k: v for k, v in last.items() if k not in dropped}
    return type(last)(logits=out, **fields)

"""Held-out text for the evaluations (prose haystacks, perplexity, agreement prompts), read
through :mod:`linearize.data`: its fixed ``heldout`` split never seen in training."""

from __future__ import annotations

import functools
import re

import torch

from .common import EvalError

HELDOUT_SPLIT = "heldout"
DEFAULT_DATA = "wiki"
_SENT_RE = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


@functools.lru_cache(maxsize=4)
def heldout_texts(spec: str | None = None) -> tuple[str, ...]:
    """Held-out documents of ``spec`` (default: the embedded corpus), in source order,
    whitespace normalised."""
    from linearize.data import iter_texts  # noqa: PLC0415

    texts = tuple(t for t in (" ".join(str(x).split()) for x in iter_texts(spec or DEFAULT_DATA, HELDOUT_SPLIT, seed=None)) if t)
    if not texts:  # pragma: no cover - data.py raises first
        raise EvalError(f"no held-out text found in {spec!r}")
    return texts


@functools.lru_cache(maxsize=1)
def prose_sentences() -> tuple[str, ...]:
    """Sentences of the held-out embedded corpus, in order (the prose haystack)."""
    out: list[str] = []
    for t in heldout_texts(DEFAULT_DATA):
        for s in _SENT_RE.split(t):
            s = s.strip()
            if len(s.split()) >= 3 and len(s) <= 600:
                out.append(s)
    return tuple(out)


def heldout_stream(tokenizer, spec: str | None, n_tokens: int, *, at_least: int | None = None) -> torch.Tensor:
    """Held-out tokens as one 1-D LongTensor (documents packed in a fixed order, EOS between).

    Returns ``n_tokens`` tokens; when the held-out split is smaller, returns all of it if that
    is still ``>= at_least``, else raises :class:`EvalError`."""
    from linearize.data import DataError, heldout_sequences  # noqa: PLC0415

    seq_len = 512
    try:
        x = heldout_sequences(tokenizer, spec or DEFAULT_DATA, seq_len=seq_len, n_seqs=-(-n_tokens // seq_len))
    except DataError:
        if at_least is None:
            raise
        x = heldout_sequences(tokenizer, spec or DEFAULT_DATA, seq_len=seq_len, n_seqs=None)
    flat = torch.as_tensor(x, dtype=torch.long).reshape(-1)[:n_tokens]
    need = n_tokens if at_least is None else at_least
    if flat.numel() < need:
        raise EvalError(f"the held-out split of {spec or DEFAULT_DATA!r} has only {flat.numel()} tokens and {need} are "
                        "needed: use shorter lengths or a larger data source (data= / --data)")
    return flat

"""Held-out text for the evaluations (prose haystacks, perplexity, agreement prompts), read
through :mod:`linearize.data`: its fixed ``heldout`` split never seen in training.

``--data`` (``EvalConfig.data``) is one data spec, a list ``wiki,code,docs`` or a weighted mixture:
ppl scores each of its specs on its own (:func:`data_specs`); copy and agreement read the whole
(a mixture's held-out rows are shared out by its weights, a plain list's equally).
"""

from __future__ import annotations

import functools
import re

import torch

from linearize.data.corpora import corpus_files
from linearize.data.mixture import parse_mixture
from linearize.data.packing import heldout_sequences
from linearize.data.specs import iter_texts, parse_spec, wiki_corpus_path
from linearize.errors import DataError

from .common import EvalError

HELDOUT_SPLIT = "heldout"
DEFAULT_DATA = "wiki"
_SENT_RE = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


@functools.lru_cache(maxsize=4)
def heldout_texts(spec: str | None = None) -> tuple[str, ...]:
    """Held-out documents of ``spec`` (default: the embedded corpus), in source order,
    whitespace normalised."""
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


def data_specs(data: str | None) -> list[str]:
    """The specs of ``--data`` one by one: ``"wiki,code"`` -> ``["wiki", "code"]`` (a mixture's parts; its
    weights do not matter here); ``None`` -> ``["wiki"]``."""
    return [p.spec for p in parse_mixture(data)] if data else [DEFAULT_DATA]


def check_data(data: str | None) -> None:
    """Resolve ``--data`` before any model loads: a malformed spec or mixture, a missing file, or a named corpus
    that is not installed (or another version) raises :class:`~linearize.errors.DataError` in one line."""
    if not data:
        return
    src = parse_spec(data)
    for part in [p for p, _ in src.parts] if src.kind == "mix" else [src]:
        if part.kind == "corpus":
            corpus_files(part.corpus)
        elif part.kind == "wiki":
            wiki_corpus_path()

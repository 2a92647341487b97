"""Tokenization and its cache.

Tokenization adds no special tokens and applies no chat template, except to the ``chat`` corpus, whose
conversations are rendered by the tokenizer's own template first (:func:`render_conversations`); each document is
followed by the tokenizer's EOS token where rows are packed (:mod:`linearize.data.packing`). Token ids of local
sources are cached per (tokenizer, source, split) under ``$LINEARIZE_CACHE/data`` (default
``~/.cache/linearize/data``), written atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from ..atomic import atomic_write
from ..errors import DataError
from ..settings import cache_root
from .corpora import CORPORA, CORPUS_FORMAT, conversation_messages, corpus_files
from .specs import DataSource, check_split, empty_split_error, parse_spec, source_documents, wiki_corpus_path

log = logging.getLogger("linearize.data")

#: bump when the cache format or the split rule changes
_CACHE_VERSION = 1


def data_cache_dir() -> Path:
    """``$LINEARIZE_CACHE/data`` (the root defaults to ``~/.cache/linearize``:
    :func:`linearize.settings.cache_root`)."""
    return cache_root() / "data"


def eos_id(tokenizer: Any) -> int:
    """The token that separates documents, or a one-line :class:`DataError` for a tokenizer without one."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has no EOS "
            "token to separate documents; set tokenizer.eos_token"
        )
    return int(eos)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of everything that decides token ids: the full backend tokenizer (or vocab) and EOS."""
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        h.update(backend.to_str().encode("utf-8"))  # vocab, merges, normalizer, pre-tokenizer
    except Exception:  # noqa: BLE001 - slow / custom tokenizers
        vocab = tokenizer.get_vocab()
        h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode("utf-8"))
    h.update(f"eos={eos_id(tokenizer)}".encode())
    return h.hexdigest()


def source_fingerprint(src: DataSource) -> dict[str, Any]:
    """What identifies a local source's text: its files' paths, sizes and modification times (a mixture: its parts')."""
    if src.kind == "mix":
        return {"kind": "mix", "parts": [[p.spec, w, source_fingerprint(p) if p.cacheable else None]
                                         for p, w in src.parts]}
    extra: dict[str, Any] = {}
    if src.kind == "wiki":
        files = [wiki_corpus_path()]
    elif src.kind == "corpus":
        files = list(corpus_files(src.corpus))
        extra = {"corpus": src.corpus, "format": CORPUS_FORMAT}
    else:
        files = list(src.paths)
    out = []
    for p in files:
        st = p.stat()
        out.append([str(p), st.st_size, st.st_mtime_ns])
    return {"kind": src.kind, "files": out, **extra}


def chat_template_of(tokenizer: Any) -> str | None:
    """The tokenizer's chat template as text (several named ones: all of them, sorted), or ``None``."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    return template if isinstance(template, str) else json.dumps(template, sort_keys=True)


def render_conversations(tokenizer: Any, doc: str) -> str:
    """A ``chat`` document (transcripts of conversations) rendered by the tokenizer's chat template: each
    conversation on its own (:func:`~linearize.data.corpora.conversation_messages`), joined in order.

    Raises a one-line :class:`DataError` when the template refuses a conversation."""
    parts = []
    for messages in conversation_messages(doc):
        try:
            parts.append(tokenizer.apply_chat_template(messages, tokenize=False))
        except Exception as e:  # noqa: BLE001 - jinja's TemplateError and whatever a template raises
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"the tokenizer's chat template cannot render a 'chat' conversation ({first}); "
                            "use 'dialogue' (the same conversations as plain transcripts)") from None
    return "".join(parts)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[-40:] or "x"


def encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text: no special tokens added (a rendered chat's turn markers, in its text, are read as
    the tokens they name)."""
    if not texts:
        return []
    out = tokenizer(
        texts, add_special_tokens=False, return_attention_mask=False, verbose=False
    )["input_ids"]
    return [list(ids) for ids in out]


def _tokenize_all(tokenizer: Any, docs: Iterable[str], batch: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    """Flat ids (no EOS) and offsets ``[n_docs + 1]``; doc i is ``ids[off[i]:off[i+1]]``."""
    chunks: list[np.ndarray] = []
    lengths: list[int] = []
    pending: list[str] = []

    def flush() -> None:
        for ids in encode(tokenizer, pending):
            chunks.append(np.asarray(ids, dtype=np.int64))
            lengths.append(len(ids))
        pending.clear()

    for doc in docs:
        pending.append(doc)
        if len(pending) >= batch:
            flush()
    flush()
    ids = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    dtype = np.int32 if ids.size == 0 or int(ids.max()) < 2**31 else np.int64
    return ids.astype(dtype), offsets


def tokenized_documents(
    tokenizer: Any, spec: str, split: str = "train", text_field: str = "text"
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of every document of a local source's split, in source order, cached.

    Returns ``(ids, offsets)``: ``ids`` is a flat int array without EOS tokens and document
    ``i`` is ``ids[offsets[i]:offsets[i + 1]]``. Cached under :func:`data_cache_dir` keyed by
    the tokenizer's fingerprint, the source files (path, size, mtime), split and text field;
    the cache file is written to a temporary name and renamed. Not available for ``hf:`` or a mixture.
    """
    check_split(split)
    src = parse_spec(spec)
    if src.kind == "mix":
        raise DataError(f"data spec {spec!r} is a mixture; it has no single token array (each part has one)")
    if not src.cacheable:
        raise DataError(f"data spec {spec!r} is streamed; it has no fixed token array")
    key_obj = {
        "v": _CACHE_VERSION,
        "tok": tokenizer_fingerprint(tokenizer),
        "src": source_fingerprint(src),
        "split": split,
        "heldout_per_mille": src.heldout_per_mille,
        "field": text_field if src.kind == "files" else None,
    }
    chat = src.kind == "corpus" and CORPORA[src.corpus].chat
    template = chat_template_of(tokenizer) if chat else None
    if chat:  # the rendered text depends on the template
        key_obj["chat_template"] = hashlib.sha256(template.encode("utf-8")).hexdigest() if template else None
    key = hashlib.sha256(json.dumps(key_obj, sort_keys=True).encode()).hexdigest()[:20]
    tok_name = _slug(Path(str(getattr(tokenizer, "name_or_path", "") or "tok")).name)
    name = f"{_slug(Path(src.spec).name if src.kind == 'files' else src.corpus or 'wiki')}-{split}-{tok_name}-{key}.npz"
    path = data_cache_dir() / name
    if path.is_file():
        try:
            with np.load(path) as z:
                ids, offsets = z["ids"], z["offsets"]
            if offsets.ndim == 1 and offsets.size >= 1 and offsets[-1] == ids.size:
                return ids, offsets
        except Exception:  # noqa: BLE001 - corrupt cache: rebuild
            log.warning("data cache %s is unreadable; rebuilding it", path)
    docs = source_documents(src, split, text_field)
    if template is not None:
        docs = (render_conversations(tokenizer, d) for d in docs)
    elif chat:
        log.warning("data %r: the tokenizer has no chat template; its conversations are read as plain transcripts",
                    src.spec)
    ids, offsets = _tokenize_all(tokenizer, docs)
    if offsets.size <= 1:
        raise empty_split_error(src, split)
    try:
        with atomic_write(path) as tmp, open(tmp, "wb") as fh:
            np.savez(fh, ids=ids, offsets=offsets)
    except OSError as e:
        log.warning("could not write data cache %s (%s); continuing without it", path, e)
    return ids, offsets


def count_tokens(
    tokenizer: Any, spec: str, split: str = "train", text_field: str = "text"
) -> int | None:
    """Tokens in one epoch of the source's split, counting one EOS per document (a mixture: of all its parts).

    ``None`` for streamed ``hf:`` sources, whose size is not known in advance.
    """
    src = parse_spec(spec)
    if not src.cacheable:
        return None
    if src.kind == "mix":
        return sum(count_tokens(tokenizer, p.spec, split, text_field) or 0 for p, _ in src.parts)
    ids, offsets = tokenized_documents(tokenizer, spec, split, text_field)
    return int(ids.size + offsets.size - 1)


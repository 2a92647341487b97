"""Training batches and held-out sequences: documents, each followed by EOS, packed back to back into
``seq_len`` rows (a document may span rows; rows are never padded)."""

from __future__ import annotations

import logging
from typing import Any, Iterator

import numpy as np
import torch

from ..errors import DataError
from ..units import UnitError, parse_tokens
from .augment import check_fraction, copy_augment, copy_rng
from .mixture import allocate, interleave, row_parts
from .specs import DataSource, check_positive, check_split, empty_split_error, hf_documents, parse_spec, permutation
from .tokens import encode, eos_id, tokenized_documents

log = logging.getLogger("linearize.data")

#: fixed shuffle seed of the evaluation sequences (independent of the training seed)
_HELDOUT_SEED = 1234


def _budget(tokens: int | str) -> int:
    """:func:`linearize.units.parse_tokens` (K = 1,000), failing with this module's :class:`DataError`."""
    try:
        return parse_tokens(tokens)
    except UnitError as e:
        raise DataError(str(e)) from None


def num_batches(tokens: int | str, seq_len: int, batch_size: int) -> int:
    """How many ``[batch_size, seq_len]`` batches :func:`packed_batches` yields for ``tokens``."""
    return _budget(tokens) // (seq_len * batch_size)

def _local_doc_stream(
    ids: np.ndarray, offsets: np.ndarray, eos: int, seed: int, spec: str, total: int
) -> Iterator[np.ndarray]:
    """Documents (each followed by EOS) in a reshuffled order per epoch, forever."""
    n = offsets.size - 1
    eos_arr = np.array([eos], dtype=np.int64)
    epoch = 0
    while True:
        if epoch > 0:
            log.info("data %r: all %d tokens used; starting epoch %d (reshuffled)", spec, total, epoch + 1)
        for i in permutation(n, seed, epoch):
            doc = ids[offsets[i]: offsets[i + 1]].astype(np.int64, copy=False)
            yield doc
            yield eos_arr
        epoch += 1


def _hf_doc_stream(
    tokenizer: Any, src: DataSource, split: str, text_field: str, seed: int, eos: int
) -> Iterator[np.ndarray]:
    eos_arr = np.array([eos], dtype=np.int64)
    epoch = 0
    while True:
        if epoch > 0:
            log.info("data %r: reached the end of the dataset; starting epoch %d (reshuffled)", src.spec, epoch + 1)
        n_docs = 0
        pending: list[str] = []
        docs = hf_documents(src, split, text_field, seed, epoch)
        while True:
            doc = next(docs, None)
            if doc is not None:
                pending.append(doc)
            if pending and (doc is None or len(pending) >= 256):
                for ids in encode(tokenizer, pending):
                    n_docs += 1
                    yield np.asarray(ids, dtype=np.int64)
                    yield eos_arr
                pending = []
            if doc is None:
                break
        if n_docs == 0:
            raise empty_split_error(src, split)
        epoch += 1


def _pack(stream: Iterator[np.ndarray], seq_len: int) -> Iterator[np.ndarray]:
    """Cut a stream of token arrays into contiguous ``[seq_len]`` rows (no padding)."""
    buf: list[np.ndarray] = []
    have = 0
    for piece in stream:
        buf.append(piece)
        have += piece.size
        if have < seq_len:
            continue
        flat = np.concatenate(buf)
        n_rows = flat.size // seq_len
        for r in range(n_rows):
            yield flat[r * seq_len: (r + 1) * seq_len]
        rest = flat[n_rows * seq_len:]
        buf = [rest] if rest.size else []
        have = rest.size


def packed_batches(
    tokenizer: Any,
    spec: str,
    *,
    seq_len: int,
    tokens: int | str,
    batch_size: int,
    seed: int,
    split: str = "train",
    text_field: str = "text",
    copy_fraction: float = 0.0,
) -> Iterator[torch.Tensor]:
    """Yield ``LongTensor [batch_size, seq_len]`` batches of packed text until ``tokens`` are used.

    Documents are shuffled deterministically by ``seed``, tokenized without special tokens or
    chat template, each followed by EOS, and concatenated into contiguous rows (a document may
    span rows; rows are never padded). Exactly ``num_batches(tokens, seq_len, batch_size) *
    batch_size * seq_len`` tokens are yielded: the budget is rounded down to whole batches (a
    final partial batch is dropped). When the budget exceeds the source, the corpus is looped
    in a new, reshuffled order per epoch (logged on ``linearize.data``). Raises
    :class:`DataError` when the budget is smaller than one batch.

    ``copy_fraction > 0`` applies :func:`copy_augment` to every batch: batch ``i`` (0-based) is
    augmented with :func:`copy_rng` ``(seed, i)``, so it depends only on the seed and its index.

    A mixture packs each part into rows of its own and takes each row from the part that
    :func:`linearize.data.mixture.row_parts` draws by the weights and ``seed``.

    The same arguments always give the same batches, so a resumed run can skip the batches it
    already consumed.
    """
    check_split(split)
    copy_fraction = check_fraction(copy_fraction)
    seq_len = check_positive("seq_len", seq_len)
    batch_size = check_positive("batch_size", batch_size)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise DataError(f"invalid seed {seed!r}: expected an integer")
    budget = _budget(tokens)
    n_batches = budget // (seq_len * batch_size)
    if n_batches == 0:
        raise DataError(
            f"--tokens {tokens} is smaller than one batch (batch_size {batch_size} x seq_len "
            f"{seq_len} = {batch_size * seq_len} tokens)"
        )
    src = parse_spec(spec)
    eos = eos_id(tokenizer)
    parts = src.parts if src.kind == "mix" else ((src, 1.0),)
    # local sources are tokenized (or read from the cache) now, so errors surface at the call
    docs = [tokenized_documents(tokenizer, p.spec, split, text_field) if p.cacheable else None for p, _ in parts]
    return _packed(tokenizer, parts, docs, split, text_field, seed, eos, seq_len, batch_size, n_batches,
                   copy_fraction)


def _source_rows(
    tokenizer: Any, src: DataSource, docs: tuple[np.ndarray, np.ndarray] | None, split: str,
    text_field: str, seed: int, eos: int, seq_len: int, wanted: int,
) -> Iterator[np.ndarray]:
    """Packed ``[seq_len]`` rows of one source, forever; ``wanted`` (the tokens it is expected to give) only
    decides the log line about repeating it."""
    if docs is not None:
        ids, offsets = docs
        total = int(ids.size + offsets.size - 1)
        if wanted > total:
            log.info(
                "data %r (%s): %d tokens requested, the source has %d; it will be repeated (%.1f epochs)",
                src.spec, split, wanted, total, wanted / total,
            )
        stream = _local_doc_stream(ids, offsets, eos, seed, src.spec, total)
    else:
        stream = _hf_doc_stream(tokenizer, src, split, text_field, seed, eos)
    return _pack(stream, seq_len)


def _mixed_rows(streams: list[Iterator[np.ndarray]], weights: list[float], seed: int) -> Iterator[np.ndarray]:
    """Rows of a mixture: each from the part :func:`linearize.data.mixture.row_parts` draws."""
    for i in row_parts(weights, seed):
        yield next(streams[i])


def _packed(
    tokenizer: Any, parts: tuple[tuple[DataSource, float], ...],
    docs: list[tuple[np.ndarray, np.ndarray] | None], split: str, text_field: str, seed: int, eos: int,
    seq_len: int, batch_size: int, n_batches: int, copy_fraction: float = 0.0,
) -> Iterator[torch.Tensor]:
    wanted = n_batches * batch_size * seq_len
    streams = [_source_rows(tokenizer, src, d, split, text_field, seed, eos, seq_len, round(wanted * w))
               for (src, w), d in zip(parts, docs)]
    rows = streams[0] if len(streams) == 1 else _mixed_rows(streams, [w for _, w in parts], seed)
    for index in range(n_batches):
        batch = torch.from_numpy(np.stack([next(rows) for _ in range(batch_size)])).long()  # [batch_size, seq_len]
        if copy_fraction > 0:
            batch = copy_augment(batch, copy_fraction, copy_rng(seed, index))
        yield batch


def heldout_sequences(
    tokenizer: Any,
    spec: str = "wiki",
    *,
    seq_len: int,
    n_seqs: int | None = None,
    text_field: str = "text",
    split: str = "heldout",
) -> torch.Tensor:
    """A fixed ``LongTensor [n_seqs, seq_len]`` of held-out text for evaluation.

    The held-out documents (never seen in training) are shuffled with a fixed seed (independent
    of any training seed), each followed by EOS, and packed; the first ``n_seqs`` rows are
    returned (``None``: every full row). Deterministic for a given tokenizer and source. Raises
    :class:`DataError` when the split holds fewer than ``n_seqs`` rows.

    A mixture shares ``n_seqs`` out by its weights (:func:`linearize.data.mixture.allocate`; ``None``: every
    full row of every part) and interleaves the parts' rows (:func:`linearize.data.mixture.interleave`).
    """
    check_split(split)
    seq_len = check_positive("seq_len", seq_len)
    if n_seqs is not None:
        n_seqs = check_positive("n_seqs", n_seqs)
    src = parse_spec(spec)
    if src.kind == "mix":
        counts = allocate(n_seqs, [w for _, w in src.parts]) if n_seqs is not None else [None] * len(src.parts)
        blocks = [heldout_sequences(tokenizer, p.spec, seq_len=seq_len, n_seqs=c, text_field=text_field, split=split)
                  if c != 0 else torch.zeros(0, seq_len, dtype=torch.long) for (p, _), c in zip(src.parts, counts)]
        order = interleave([b.shape[0] for b in blocks])
        return torch.stack([blocks[i][k] for i, k in order])  # [n_seqs, seq_len]
    eos = eos_id(tokenizer)
    if src.cacheable:
        ids, offsets = tokenized_documents(tokenizer, spec, split, text_field)
        total = int(ids.size + offsets.size - 1)
        available = total // seq_len
        want = available if n_seqs is None else n_seqs
        if want > available or available == 0:
            raise DataError(
                f"data {spec!r} split {split!r} has {total} tokens = {available} sequences of "
                f"{seq_len}; asked for {want}: use fewer or shorter sequences"
            )
        perm = permutation(offsets.size - 1, _HELDOUT_SEED, 0)
        pieces = []
        for i in perm:
            pieces.append(ids[offsets[i]: offsets[i + 1]].astype(np.int64, copy=False))
            pieces.append(np.array([eos], dtype=np.int64))
        flat = np.concatenate(pieces)[: want * seq_len]
        return torch.from_numpy(flat.reshape(want, seq_len)).long()  # [n_seqs, seq_len]
    if n_seqs is None:
        raise DataError(f"data spec {spec!r} is streamed; pass a number of sequences")
    rows = _pack(_hf_doc_stream_once(tokenizer, src, split, text_field, eos), seq_len)
    out = []
    for row in rows:
        out.append(row)
        if len(out) == n_seqs:
            break
    if len(out) < n_seqs:
        raise DataError(
            f"data {spec!r} split {split!r} has only {len(out)} sequences of {seq_len}; asked for {n_seqs}"
        )
    return torch.from_numpy(np.stack(out)).long()  # [n_seqs, seq_len]


def _hf_doc_stream_once(
    tokenizer: Any, src: DataSource, split: str, text_field: str, eos: int
) -> Iterator[np.ndarray]:
    """One pass over an hf source in its own order (no shuffle): fixed evaluation text."""
    eos_arr = np.array([eos], dtype=np.int64)
    pending: list[str] = []
    for doc in hf_documents(src, split, text_field, seed=None):
        pending.append(doc)
        if len(pending) >= 256:
            for ids in encode(tokenizer, pending):
                yield np.asarray(ids, dtype=np.int64)
                yield eos_arr
            pending = []
    for ids in encode(tokenizer, pending):
        yield np.asarray(ids, dtype=np.int64)
        yield eos_arr

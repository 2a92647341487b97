"""Shared pieces of the evaluation suite: errors, option parsing, the model handle,
greedy generation and string scoring.

Everything here is deterministic: sample RNGs are derived from string seeds
(``random.Random("niah:single:0:1024:0.5")``), so a prompt can be rebuilt from
its ``results.jsonl`` row alone.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from linearize.io.sources import input_device
from linearize.units import UnitError, parse_length

from .stats import wilson_interval

__all__ = [
    "EvalError",
    "EvalConfig",
    "ModelHandle",
    "Progress",
    "parse_lengths",
    "parse_depths",
    "parse_seeds",
    "parse_batch_sizes",
    "sample_rng",
    "greedy_generate",
    "substring_score",
    "prompt_sha1",
]


try:
    from linearize.errors import LinearizeError as _Base
except ImportError:  # pragma: no cover - errors.py ships with the package
    _Base = Exception


class EvalError(_Base, ValueError):
    """A mistake the user can fix (bad option, missing package, model limit).

    The message is a single line naming the bad value and what is allowed; the
    CLI prints it and exits non-zero without a traceback (it is a ``LinearizeError``).
    """

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


# --------------------------------------------------------------------------- parsing
# lengths and counts: :func:`linearize.units.parse_length` (K = 1,024)


def _split(value: Any) -> list:
    if isinstance(value, str):
        return [v for v in (s.strip() for s in value.split(",")) if v]
    if isinstance(value, (int, float)):
        return [value]
    return list(value)


def parse_lengths(value: Any) -> list[int]:
    """Context lengths in tokens: ``"1K,2K,4K"`` -> ``[1024, 2048, 4096]``; a list of ints or strings
    is accepted too. Sorted, duplicates removed."""
    items = _split(value)
    if not items:
        raise EvalError(f"bad lengths {value!r}: give at least one, e.g. 1K,2K,4K")
    try:
        return sorted({parse_length(v) for v in items})
    except UnitError as e:
        raise EvalError(str(e)) from None


def parse_batch_sizes(value: Any) -> list[int]:
    """Batch sizes for the speed task: ``"1,8"`` -> ``[1, 8]``."""
    items = _split(value)
    if not items:
        raise EvalError(f"bad batch sizes {value!r}: give at least one, e.g. 1,8")
    try:
        return sorted({parse_length(v, what="batch size") for v in items})
    except UnitError as e:
        raise EvalError(str(e)) from None


def parse_depths(value: Any) -> list[float]:
    """Needle depths as fractions of the haystack.

    An integer N (or ``"11"``) means N evenly spaced depths from 0 to 1 (N=1 means 0.5);
    a comma list (``"0,0.25,0.5"``) or sequence gives explicit fractions in [0, 1];
    values written with ``%`` (``"10%,50%"``) are percentages."""
    if isinstance(value, bool):
        raise EvalError(f"bad depths {value!r}: expected a count like 11 or fractions like 0,0.5,1")
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        n = int(value)
        if n <= 0 or n > 101:
            raise EvalError(f"bad depths {value!r}: a count must be between 1 and 101")
        if n == 1:
            return [0.5]
        return [round(i / (n - 1), 4) for i in range(n)]
    out = []
    for v in _split(value):
        s = str(v).strip()
        try:
            x = float(s[:-1]) / 100 if s.endswith("%") else float(s)
        except ValueError:
            raise EvalError(f"bad depth {v!r}: expected a fraction in [0, 1] or a percentage like 50%") from None
        if not (0.0 <= x <= 1.0) or math.isnan(x):
            raise EvalError(f"bad depth {v!r}: expected a fraction in [0, 1] or a percentage like 50%")
        out.append(round(x, 4))
    if not out:
        raise EvalError(f"bad depths {value!r}: give a count like 11 or fractions like 0,0.5,1")
    return sorted(set(out))


def parse_seeds(value: Any) -> list[int]:
    """An integer N means seeds ``0..N-1``; a comma list or sequence gives explicit seeds."""
    if isinstance(value, bool):
        raise EvalError(f"bad seeds {value!r}: expected a count like 3 or a list like 0,1,2")
    if isinstance(value, int):
        if value <= 0:
            raise EvalError(f"bad seeds {value!r}: the count must be positive")
        return list(range(value))
    items = _split(value)
    if isinstance(value, str) and len(items) == 1:
        try:
            return parse_seeds(int(items[0]))
        except ValueError:
            pass
    out = []
    for v in items:
        try:
            out.append(int(v))
        except (TypeError, ValueError):
            raise EvalError(f"bad seed {v!r}: expected an integer") from None
    if not out:
        raise EvalError(f"bad seeds {value!r}: expected a count like 3 or a list like 0,1,2")
    return list(dict.fromkeys(out))


def no_args(task: str, arg: str | None) -> dict:
    """``parse_args`` of a task that takes no ``:ARGS``: ``{}``, or one line naming the task."""
    if arg:
        raise EvalError(f"bad task '{task}:{arg}': {task} takes no arguments")
    return {}


def sample_rng(*parts: Any) -> random.Random:
    """A private RNG for one sample, seeded from its identifying parts (stable across runs)."""
    return random.Random(":".join(str(p) for p in parts))


def prompt_sha1(ids: Sequence[int]) -> str:
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- config / handle


@dataclass
class EvalConfig:
    """Resolved options shared by every task (see ``run_eval`` for their meaning)."""

    lengths: list[int]
    depths: list[float]
    seeds: list[int]
    chat_template: bool | None = None
    data: str | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    max_new_tokens: int | None = None
    gen_batch_size: int | None = None


@dataclass
class ModelHandle:
    """A loaded model plus what the tasks need to know about it."""

    spec: str
    role: str  # "model" or "against"
    model: Any
    tokenizer: Any
    chat: bool

    @property
    def device(self) -> torch.device:
        """Where inputs go: the embedding's device, or for a model dispatched by accelerate (``--max-memory``)
        its execution device (``next(parameters()).device`` is ``meta`` for offloaded weights)."""
        return input_device(self.model)

    @property
    def max_positions(self) -> int | None:
        cfg = getattr(self.model, "config", None)
        cfg = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
        n = getattr(cfg, "max_position_embeddings", None)
        return int(n) if n else None

    @property
    def eos_ids(self) -> list[int]:
        ids: list[int] = []
        gc = getattr(self.model, "generation_config", None)
        for src in (getattr(gc, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if src is None:
                continue
            for i in src if isinstance(src, (list, tuple)) else [src]:
                if i is not None and int(i) not in ids:
                    ids.append(int(i))
        return ids

    @property
    def pad_id(self) -> int:
        for i in (getattr(self.tokenizer, "pad_token_id", None), *self.eos_ids, 0):
            if i is not None:
                return int(i)
        return 0  # pragma: no cover


class Progress:
    """Minimal progress interface the tasks call; the runner supplies a rich-backed one."""

    def start(self, label: str, total: int) -> None:  # noqa: D401
        pass

    def advance(self, n: int = 1) -> None:
        pass

    def note(self, text: str) -> None:
        pass


# --------------------------------------------------------------------------- generation


AUTO_BATCH_TOKENS = 16384
AUTO_BATCH_MAX = 8


def auto_batch_size(length: int) -> int:
    """Default generation batch for prompts of ``length`` tokens: ``16384 // length`` clamped
    to 1..8 (8 at 2K and below, 1 from 16K up), so long contexts never multiply memory."""
    return max(1, min(AUTO_BATCH_MAX, AUTO_BATCH_TOKENS // max(1, length)))


@contextmanager
def eval_mode(model):
    """``model`` in eval mode for the block, then back in the mode it had (a check inside training)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@torch.no_grad()
def greedy_generate(handle: ModelHandle, prompts: list[list[int]], max_new_tokens: int, batch_size: int | None = None,
                    on_batch: Callable[[int], None] | None = None) -> list[list[int]]:
    """Greedy continuation of each prompt (token ids in, new token ids out).

    Prompts are only batched together when they have the same length (the tasks build prompts of exactly
    the requested length), so no compute goes to padding. ``batch_size`` None picks
    :func:`auto_batch_size` per prompt length."""
    # start-up time: transformers, only when a task generates
    from transformers import GenerationConfig

    model = handle.model
    model.eval()
    eos = handle.eos_ids
    gen_cfg = GenerationConfig(
        max_new_tokens=int(max_new_tokens), do_sample=False, num_beams=1,
        eos_token_id=eos or None, pad_token_id=handle.pad_id,
    )
    outs: list[list[int] | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    groups: list[list[int]] = []
    for i in order:
        bs = batch_size or auto_batch_size(len(prompts[i]))
        if groups and len(groups[-1]) < bs and len(prompts[groups[-1][0]]) == len(prompts[i]):
            groups[-1].append(i)
        else:
            groups.append([i])
    dev = handle.device
    for g in groups:
        ids = torch.tensor([prompts[i] for i in g], dtype=torch.long, device=dev)
        res = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
        new = res[:, ids.shape[1]:].tolist()
        for i, row in zip(g, new):
            # cut at the first end-of-sequence token (batched rows keep going with padding)
            for j, t in enumerate(row):
                if t in eos:
                    row = row[:j]
                    break
            outs[i] = row
        if on_batch:
            on_batch(len(g))
    return outs  # type: ignore[return-value]


# --------------------------------------------------------------------------- scoring


def substring_score(output: str, expected: Iterable[str]) -> float:
    """RULER's score: fraction of expected values found in the output (case-insensitive substring)."""
    exp = list(expected)
    if not exp:
        return 0.0
    low = output.lower()
    return sum(1 for e in exp if e.lower() in low) / len(exp)


def whole_match(output: str, value: str) -> bool:
    """``value`` occurs in ``output`` as a whole token (case-sensitive), i.e. not inside a longer
    run of letters/digits: '1234567' does not match '12345678'."""
    return re.search(r"(?<![0-9A-Za-z])" + re.escape(value) + r"(?![0-9A-Za-z])", output) is not None


# --------------------------------------------------------------------------- aggregation


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 6) if xs else None


def depth_key(d: float) -> str:
    """Stable JSON key for a depth fraction: 0.25 -> '0.25', 1.0 -> '1'."""
    return f"{d:.4f}".rstrip("0").rstrip(".") or "0"


#: generation tasks: how many missed samples the summary (and report.md) quotes, and how much of each output
MISS_EXAMPLES = 5
MISS_OUTPUT_CHARS = 120


def grid_summary(rows: list[dict], cfg: "EvalConfig", *, with_grid: bool = True) -> dict:
    """Aggregate per-sample rows (with ``length``, ``depth``, ``score``, ``strict``) into the
    summary shape: overall score/strict, ``by_length`` (with ``n_by_length`` prompts and the 95% Wilson
    ``interval_by_length``, :mod:`linearize.evals.stats`), ``by_depth`` and the length x depth grid; rows
    with an ``output`` also give ``misses``: the first :data:`MISS_EXAMPLES` samples scored below 1 (length,
    depth, seed, expected values, the output's first :data:`MISS_OUTPUT_CHARS` characters)."""
    out: dict = {
        "metric": "score",
        "higher_is_better": True,
        "score": _mean([r["score"] for r in rows]),
        "strict": _mean([r["strict"] for r in rows]),
        "n": len(rows),
        "by_length": {},
    }
    for L in cfg.lengths:
        sel = [r for r in rows if r["length"] == L]
        if sel:
            out["by_length"][str(L)] = _mean([r["score"] for r in sel])
    if with_grid:
        out["strict_by_length"] = {str(L): _mean([r["strict"] for r in rows if r["length"] == L])
                                   for L in cfg.lengths if any(r["length"] == L for r in rows)}
        out["n_by_length"] = {L: sum(r["length"] == int(L) for r in rows) for L in out["by_length"]}
        out["interval_by_length"] = {L: [round(x, 4) for x in wilson_interval(v, out["n_by_length"][L])]
                                     for L, v in out["by_length"].items()}  # 95%, evals.stats
        out["by_depth"] = {depth_key(d): _mean([r["score"] for r in rows if r["depth"] == d])
                           for d in cfg.depths if any(r["depth"] == d for r in rows)}
        out["grid"] = {
            str(L): {depth_key(d): _mean([r["score"] for r in rows if r["length"] == L and r["depth"] == d])
                     for d in cfg.depths if any(r["length"] == L and r["depth"] == d for r in rows)}
            for L in cfg.lengths if any(r["length"] == L for r in rows)
        }
    missed = [r for r in rows if "output" in r and r["score"] < 1]
    if with_grid and any("output" in r for r in rows):
        out["misses"] = [{"length": r["length"], "depth": r["depth"], "seed": r.get("seed"),
                          "expected": r.get("expected"), "output": str(r["output"])[:MISS_OUTPUT_CHARS]}
                         for r in missed[:MISS_EXAMPLES]]
        out["missed"] = len(missed)
    return out


# --------------------------------------------------------------------------- teacher forcing


@torch.no_grad()
def tail_logits(handle: ModelHandle, ids: Sequence[int] | torch.Tensor, k: int) -> torch.Tensor:
    """Logits of the last ``k`` positions of one sequence, as float32 ``[k, V]`` on the model's
    device (``logits_to_keep`` keeps the vocabulary projection to those positions)."""
    return tail_logits_rows(handle, torch.as_tensor(ids, dtype=torch.long).reshape(1, -1), k)[0]


def tail_logits_rows(handle: ModelHandle, rows: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`tail_logits` of ``rows`` ``[B, T]`` (sequences of one length, no padding) in one forward:
    float32 ``[B, k, V]``."""
    x = rows.to(device=handle.device, dtype=torch.long)
    k = min(int(k), x.shape[1])
    try:
        out = handle.model(input_ids=x, logits_to_keep=k, use_cache=False)
    except TypeError:  # a model without logits_to_keep
        out = handle.model(input_ids=x, use_cache=False)
    return out.logits[:, -k:].float()

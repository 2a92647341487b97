"""Weighted mixtures of data specs: ``wiki:0.5,code:0.3,DIR:0.2``, or in a recipe a YAML list of ``{data, weight}``.

A mixture is parts separated by commas; a part is a data spec (:func:`linearize.data.specs.parse_spec`) optionally
followed by ``:WEIGHT``, a positive number (the part's last ``:`` field, so ``hf:NAME:CONFIG:0.2`` works). Either
every part has a weight or none does (equal shares); weights are normalised to sum to 1. A value that is an existing
file or folder is always one spec, whatever commas or colons its name holds. One part is just that spec.

Training rows: each part is packed into rows of its own, and each row of a batch comes from part ``i`` with
probability ``weight_i``, drawn by a generator seeded with the run's seed only (:func:`row_parts`): the same seed
always gives the same rows, so a resumed run skips exactly the rows it consumed. Held-out rows are shared out by
:func:`allocate` (largest remainder) and interleaved by :func:`interleave`.

Errors a user can cause raise :class:`~linearize.errors.DataError` with a one-line message.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import DataError
from .corpora import CORPORA

__all__ = ["Part", "parse_mixture", "mixture_text", "row_parts", "allocate", "interleave"]

_EXAMPLE = "e.g. wiki:0.7,code:0.3"
_NUMBER = re.compile(r"[+-]?(?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9_]+)(?:e[+-]?[0-9]+)?|[+-]?(?:inf|nan)", re.IGNORECASE)
#: tags the mixture's row-draw random stream so it never coincides with the document shuffle or copy streams
_MIX_STREAM = 0x313C
_LIST_KEYS = ("data", "weight")


@dataclass(frozen=True)
class Part:
    """One part of a mixture: a data spec and its normalised share in (0, 1]."""

    spec: str
    weight: float


def _named(spec: str) -> bool:
    return spec.strip().lower() in ("wiki", *CORPORA)


def _exists(spec: str) -> bool:
    try:
        return Path(spec).expanduser().exists()
    except (OSError, ValueError):
        return False


def _weight(text: str) -> float | None:
    """The weight ``text`` names, or None when it is not a positive finite number."""
    try:
        w = float(text)
    except (TypeError, ValueError):
        return None
    return w if math.isfinite(w) and w > 0 else None


def _bad_weight(value: Any, text: str, spec: str) -> DataError:
    return DataError(f"data mixture {value!r}: the weight {text!r} of {spec!r} is not a positive number "
                     f"({_EXAMPLE})")


def _split_weight(part: str, value: Any) -> tuple[str, float | None]:
    """``"code:0.3"`` -> ``("code", 0.3)``; ``"code"`` -> ``("code", None)``."""
    if _exists(part):
        return part, None
    head, sep, tail = part.rpartition(":")
    head, tail = head.strip(), tail.strip()
    if not sep or not head:
        return part, None
    if _NUMBER.fullmatch(tail) or _named(head) or _exists(head):  # (these specs take no other ':' field)
        weight = _weight(tail)
        if weight is None:
            raise _bad_weight(value, tail, head)
        return head, weight
    return part, None


def _from_list(value: Sequence[Any]) -> list[tuple[str, float | None]]:
    if not value:
        raise DataError("the data list is empty; give one or more {data: SPEC, weight: NUMBER} items, "
                        "or one spec such as wiki")
    out = []
    for i, item in enumerate(value, 1):
        if not isinstance(item, dict):
            raise DataError(f"data list item {i} is {type(item).__name__} {item!r}; expected a mapping such as "
                            "{data: wiki, weight: 0.7}")
        unknown = sorted(str(k) for k in item if k not in _LIST_KEYS)
        if unknown:
            raise DataError(f"data list item {i}: unknown key {', '.join(map(repr, unknown))}; allowed: data, weight")
        spec = item.get("data")
        if not isinstance(spec, str) or not spec.strip():
            raise DataError(f"data list item {i}: 'data' must be a data spec such as wiki, code or a file, "
                            f"got {spec!r}")
        weight = item.get("weight")
        if weight is not None:
            number = None if isinstance(weight, bool) or not isinstance(weight, (int, float)) else _weight(weight)
            if number is None:
                raise DataError(f"data list item {i}: the weight {weight!r} of {spec.strip()!r} is not a positive "
                                "number")
            weight = number
        out.append((spec.strip(), weight))
    return out


def _raw_parts(value: Any) -> list[tuple[str, float | None]]:
    if isinstance(value, (list, tuple)):
        return _from_list(value)
    text = str(value).strip()
    if _exists(text) or "," not in text:
        return [_split_weight(text, value)]
    out = []
    for i, part in enumerate(text.split(","), 1):
        if not part.strip():
            raise DataError(f"data mixture {value!r}: part {i} is empty; expected SPEC:WEIGHT,SPEC:WEIGHT "
                            f"({_EXAMPLE})")
        out.append(_split_weight(part.strip(), value))
    return out


def parse_mixture(value: str | Sequence[dict]) -> tuple[Part, ...]:
    """The parts of a mixture with normalised weights; a plain spec is one part of weight 1.

    Specs are not resolved here (:func:`linearize.data.specs.parse_spec` does that). Raises :class:`DataError` for an
    empty part, a weight that is not a positive number, weights on some parts only, or a spec given twice.
    """
    raw = _raw_parts(value)
    weighted = [w is not None for _, w in raw]
    if len(raw) > 1 and any(weighted) and not all(weighted):
        raise DataError(f"data mixture {_text(raw) if isinstance(value, (list, tuple)) else value!r}: "
                        f"give every part a weight or none ({_EXAMPLE})")
    seen: set[str] = set()
    for spec, _ in raw:
        key = spec.lower() if _named(spec) else spec
        if key in seen:
            raise DataError(f"data mixture: {spec!r} is given twice; give each spec once with its whole weight")
        seen.add(key)
        if len(raw) > 1 and "," in spec:
            raise DataError(f"data mixture: the part {spec!r} holds a comma; a part of a mixture cannot")
    weights = [w if w is not None else 1.0 for _, w in raw]
    total = sum(weights)
    return tuple(Part(spec, w / total) for (spec, _), w in zip(raw, weights))


def mixture_text(value: str | Sequence[dict]) -> str:
    """The one-line form of a data value: a string as given (stripped), a list as ``SPEC:WEIGHT,...`` with the
    weights as written (``SPEC,...`` when none has one)."""
    if not isinstance(value, (list, tuple)):
        return str(value).strip()
    parse_mixture(value)  # a bad list raises here, and never becomes a string that reads otherwise
    return _text(_from_list(value))


def _text(parts: list[tuple[str, float | None]]) -> str:
    return ",".join(spec if w is None else f"{spec}:{format(w, '.12g')}" for spec, w in parts)


def row_parts(weights: Sequence[float], seed: int) -> Iterator[int]:
    """The part each packed training row comes from, forever: part ``i`` with probability ``weights[i]``, drawn
    by a generator that depends on ``seed`` only."""
    cum = np.cumsum(np.asarray(weights, dtype=np.float64))
    cum /= cum[-1]
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, _MIX_STREAM])
    last = len(cum) - 1
    while True:
        for i in np.searchsorted(cum, rng.random(1024), side="right").tolist():
            yield min(i, last)


def allocate(n: int, weights: Sequence[float]) -> list[int]:
    """``n`` rows shared out by ``weights`` (largest remainder; ties go to the earlier part)."""
    exact = [n * w / sum(weights) for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


def interleave(counts: Sequence[int]) -> list[tuple[int, int]]:
    """``(part, row)`` pairs of every part's rows, spread evenly: part ``i``'s ``k``-th row sits at ``(k + 0.5) /
    counts[i]`` of the way (ties in part order)."""
    slots = [((k + 0.5) / c, i, k) for i, c in enumerate(counts) for k in range(c)]
    return [(i, k) for _, i, k in sorted(slots)]

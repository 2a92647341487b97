"""Numbers with units on the command line and in recipes: token counts, sequence lengths, byte sizes.

The one rule:

* **Token counts** (training budgets: ``--tokens``, ``--distill-tokens``, ``--finetune-tokens``, a recipe's
  ``tokens``) use powers of 1000: ``256K`` = 256,000, ``20M`` = 20,000,000, ``1B`` (or ``1G``) = 10^9,
  ``1T`` = 10^12. Thousands separators ``,`` and ``_`` are ignored (``1,000``, ``1_000``).
* **Sequence lengths** (``--lengths``, ``--retrieval``, the LENGTH of ``--kv-budget``, and the counts the
  evaluation and benchmark options take next to them: ``--batch``, ``ppl:16K``, ``copy:32``, ``recall:8+16``,
  ``agreement:64``, ``speed:32``) use powers of 1024: ``1K`` = 1,024, ``4K`` = 4,096, ``128K`` = 131,072,
  ``1M`` = 1,048,576.
* **Byte sizes** (``--max-memory``, the BYTES of ``--kv-budget``): ``KiB``, ``MiB``, ``GiB``, ``TiB``, ``PiB``
  are powers of 1024; ``K``, ``M``, ``G``, ``T``, ``P`` with or without ``B`` (``KB``, ``MB``, ``GB``...) are powers
  of 1000; ``B`` or no unit is bytes. A byte size may be 0 and is rounded down to whole bytes (``1.5B`` = 1).

Units are case-insensitive; a number is ``12``, ``1.5``, ``.5`` or ``1e6``, with optional spaces before the
unit and ``_`` between digits. Token counts and lengths must come out positive and whole (``1.0001K`` is not
a length). Every parser raises :class:`UnitError` (a one-line :class:`~linearize.errors.LinearizeError`)
naming the accepted forms. The printers write what the parsers read: :func:`format_tokens` (``20M``),
:func:`format_length` (``4K``), :func:`format_bytes` (``1.5 KiB``).
"""

from __future__ import annotations

import math
import numbers
import re
from decimal import Decimal
from fractions import Fraction
from typing import Any

from .errors import LinearizeError

__all__ = [
    "UnitError",
    "TOKEN_FORMS",
    "LENGTH_FORMS",
    "BYTE_FORMS",
    "parse_tokens",
    "parse_length",
    "parse_bytes",
    "format_tokens",
    "format_length",
    "format_bytes",
]


class UnitError(LinearizeError, ValueError):
    """A token count, length or byte size that cannot be read; the message names the accepted forms."""


TOKEN_FORMS = "a positive whole number like 500K, 20M, 1B or 1_000 (K = 1,000, M = 10^6, B or G = 10^9, T = 10^12)"
LENGTH_FORMS = "a positive whole number like 512, 1K, 32K or 1.5K (K = 1,024, M = 1,048,576)"
BYTE_FORMS = ("a size like 512MB, 1.5GB, 2G or 40GiB (K, M, G, T, P with or without B: powers of 1,000; KiB, MiB, "
              "GiB, TiB, PiB: powers of 1,024; B or no unit: bytes)")

_TOKEN_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_LENGTH_UNITS = {"": 1, "k": 2**10, "m": 2**20}
_BYTE_UNITS = {"": 1, "b": 1, **{u + b: 1000**i for i, u in enumerate("kmgtp", 1) for b in ("", "b")},
               **{u + "ib": 1024**i for i, u in enumerate("kmgtp", 1)}}
_NUMBER = re.compile(r"^(\d+\.?\d*|\.\d+)(?:e(\d+))?\s*([a-z]*)$")


def _scaled(value: Any, units: dict[str, int], drop: str) -> Fraction | None:
    """The exact value of ``value`` (an int, a float or a string with one of ``units``), None if it is not one.
    Characters in ``drop`` are removed from a string first."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):  # int, numpy integers
        return Fraction(int(value))
    if isinstance(value, numbers.Real):
        return Fraction(float(value)) if math.isfinite(value) else None
    if not isinstance(value, str):
        return None
    text = value.strip().lower()
    for c in drop:
        text = text.replace(c, "")
    m = _NUMBER.match(text)
    if not m or m.group(3) not in units:
        return None
    number, exponent, unit = m.groups()
    return Fraction(number) * 10 ** int(exponent or 0) * units[unit]


def _positive_whole(value: Any, units: dict[str, int], drop: str, message: str) -> int:
    x = _scaled(value, units, drop)
    if x is None or x <= 0 or x.denominator != 1:
        raise UnitError(message)
    return int(x)


def parse_tokens(value: Any) -> int:
    """A token count (powers of 1000): ``500K`` -> 500,000, ``20M``, ``1B``, ``1.5M``, ``1_000``, ``1,000``,
    ``1e6``, ``2048`` or an int."""
    return _positive_whole(value, _TOKEN_UNITS, "_,", f"invalid token count {value!r}: expected {TOKEN_FORMS}")


def parse_length(value: Any, *, what: str = "length") -> int:
    """A sequence length or an evaluation count (powers of 1024): ``4K`` -> 4,096, ``1.5K`` -> 1,536, ``1M``,
    ``300`` or an int. ``what`` names the value in the error."""
    return _positive_whole(value, _LENGTH_UNITS, "_", f"bad {what} {value!r}: expected {LENGTH_FORMS}")


def parse_bytes(value: Any) -> int:
    """A byte size (see the module docstring): ``2GB`` -> 2 * 10^9, ``40GiB`` -> 40 * 2^30, ``1.5G``, ``512``;
    0 or more, rounded down to whole bytes."""
    x = _scaled(value, _BYTE_UNITS, "_")
    if x is None or x < 0:
        raise UnitError(f"bad size {value!r}: expected {BYTE_FORMS}")
    return math.floor(x)


def format_tokens(n: int) -> str:
    """``20_000_000`` -> ``"20M"``, ``159_744`` -> ``"159.744K"``, ``999`` -> ``"999"`` (exact; :func:`parse_tokens`
    reads it back)."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if abs(n) >= size:
            text = format(Decimal(int(n)) / size, "f")
            return (text.rstrip("0").rstrip(".") if "." in text else text) + unit
    return str(n)


def format_length(n: int) -> str:
    """``1024`` -> ``"1K"``, ``1048576`` -> ``"1M"``, ``1536`` -> ``"1536"`` (labels; :func:`parse_length` reads
    them back)."""
    if n % 2**20 == 0:
        return f"{n // 2**20}M"
    if n % 2**10 == 0:
        return f"{n // 2**10}K"
    return str(n)


def format_bytes(n: Any) -> str:
    """``1536`` -> ``"1.5 KiB"`` (powers of 1024, one decimal); anything but a number is returned as text."""
    if not isinstance(n, (int, float)):
        return str(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"

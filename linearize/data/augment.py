"""Copy augmentation of training batches (:func:`copy_augment`, the recipe's ``distill.copy_fraction`` /
``finetune.copy_fraction``): a span early in a row is repeated exactly far later in the same row, so the model is
trained on long-range exact copying. Held-out sequences are never augmented."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import DataError
from .specs import check_positive

#: copy augmentation: shortest and longest copied span (tokens); the longest is capped to fit the row
COPY_MIN_SPAN = 32
COPY_MAX_SPAN = 128
#: copy augmentation: the copy starts at least ``row length // COPY_GAP_DIVISOR`` tokens after its source ends
COPY_GAP_DIVISOR = 4
#: tags the copy-augmentation random stream so it never coincides with the document-shuffle stream
_COPY_STREAM = 0xC0B1


def check_fraction(value: Any) -> float:
    """A ``copy_fraction`` in [0, 1] as a float, else a one-line :class:`DataError`."""
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
    fraction = check_fraction(fraction)
    min_span = check_positive("copy min_span", min_span)
    max_span = check_positive("copy max_span", max_span)
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


"""How far a recall score can be trusted: intervals for one model, paired counts for two.

A passkey or needle score per length is the mean over a few prompts (20 at ``--depths 5 --seeds 4``), so one
prompt moves it by 5 points. Two numbers say how much of a difference that is:

* :func:`wilson_interval`: the 95% Wilson score interval of a mean of per-prompt scores in [0, 1], read as
  successes out of ``n`` (exact for the usual 0 / 1 scores). At 20 prompts a score of 70% spans 48-85%.
* :func:`paired_by_length`: with the original evaluated on the same prompts, the prompts on which the model
  scored higher and lower than the original, and the exact two-sided sign test of those counts (:func:`sign_test`):
  the chance of a split at least that lopsided if neither model were better. Prompts both got equally right or
  wrong say nothing about which is better and are left out, which makes the paired test far sharper than
  comparing two intervals.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence

#: the normal quantile of a two-sided 95% interval
Z95 = 1.959964


def wilson_interval(mean: float, n: int, z: float = Z95) -> tuple[float, float]:
    """``(low, high)``: the Wilson score interval of a success rate ``mean`` over ``n`` trials; ``(0, 1)`` for
    ``n = 0``."""
    if n <= 0:
        return 0.0, 1.0
    p = min(1.0, max(0.0, float(mean)))
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def sign_test(better: int, worse: int) -> float:
    """Exact two-sided sign-test p-value of ``better`` against ``worse`` paired outcomes (ties left out): twice the
    binomial(n, 1/2) tail at the smaller count, at most 1; 1 when there are none."""
    n = better + worse
    if n == 0:
        return 1.0
    k = min(better, worse)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired(mine: Sequence[float], theirs: Sequence[float]) -> dict:
    """``{"pairs", "better", "worse", "p"}`` of two score sequences over the same prompts, in the same order: how
    many pairs, on how many ``mine`` was higher / lower, and :func:`sign_test` of those two counts."""
    better = sum(a > b for a, b in zip(mine, theirs))
    worse = sum(a < b for a, b in zip(mine, theirs))
    return {"pairs": min(len(mine), len(theirs)), "better": better, "worse": worse,
            "p": round(sign_test(better, worse), 4)}


def paired_note(better: int, worse: int, p: float) -> str:
    """The conversion's recall check in words: ``found B the teacher missed, missed W it found: sign test p = P``."""
    return f"found {better} the teacher missed, missed {worse} it found: sign test p = {p:.2g}"


def paired_by_length(model_rows: Iterable[dict], against_rows: Iterable[dict],
                     key: Callable[[dict], Hashable | None]) -> dict[str, dict]:
    """``{length: paired(...)}`` over the prompts both sides scored (matched by ``key``, a row's prompt identity:
    task, variant, seed, length, depth)."""
    theirs = {k: r["score"] for r in against_rows if (k := key(r)) is not None}
    scores: dict[str, tuple[list, list]] = {}
    for r in model_rows:
        k = key(r)
        if k is not None and k in theirs:
            mine_l, theirs_l = scores.setdefault(str(r["length"]), ([], []))
            mine_l.append(r["score"])
            theirs_l.append(theirs[k])
    return {L: paired(*scores[L]) for L in sorted(scores, key=int)}

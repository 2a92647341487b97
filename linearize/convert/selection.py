"""Which layers stay softmax: `--ratio A:B`, an explicit `--softmax-layers` list, or `--select auto`.

The result is a `layer_types` list in the transformers convention used by Qwen3-Next:
``"linear_attention"`` or ``"full_attention"`` per decoder layer.

``--select interleave`` (the default) places the softmax layers by the repeating ``--ratio`` pattern.
``--select auto`` keeps the same *number* of softmax layers (or, with ``--kv-budget BYTES@LENGTH``, the
most that fit a cache budget) but chooses *which* layers from measured scores: see
:mod:`linearize.convert.probe` for the probe and :func:`choose_softmax_layers` for the choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import SelectionError
from ..settings import DEFAULT_RATIO
from ..units import UnitError, parse_bytes, parse_length

from ..model.layout import FULL, LINEAR  # noqa: F401 - re-exported for callers
from ..model.layout import widest_window

#: ``--select`` values
SELECT_MODES = ("interleave", "auto")


def parse_ratio(ratio: str) -> tuple[int, int]:
    """Parse ``"A:B"``: A linear layers for every B softmax layers, repeating."""
    parts = str(ratio).strip().split(":")
    if len(parts) != 2:
        raise SelectionError(f"--ratio {ratio!r}: expected A:B with two non-negative integers, e.g. 3:1")
    try:
        a, b = (int(p) for p in parts)
    except ValueError:
        raise SelectionError(f"--ratio {ratio!r}: expected A:B with two non-negative integers, e.g. 3:1") from None
    if a < 0 or b < 0:
        raise SelectionError(f"--ratio {ratio!r}: A and B must be >= 0")
    if a == 0 and b == 0:
        raise SelectionError(f"--ratio {ratio!r}: A and B cannot both be 0 (use 1:0 for all-linear, 0:1 for none)")
    return a, b


def layout_from_ratio(ratio: str, num_layers: int) -> list[str]:
    """Repeat A linear then B softmax layers. ``3:1`` on 30 layers keeps 3,7,...,27 softmax."""
    a, b = parse_ratio(ratio)
    period = a + b
    layout = [LINEAR if (i % period) < a else FULL for i in range(num_layers)]
    if b > 0 and FULL not in layout:
        raise SelectionError(f"--ratio {ratio}: the model has {num_layers} layers and the pattern starts with {a} "
                             f"linear ones, so none would stay softmax; use a smaller A, or 1:0 for all-linear")
    return layout


def parse_layer_list(spec: str) -> list[int]:
    """Parse ``"3,7,11"`` (ranges ``"0-3"`` allowed) into sorted unique indices."""
    out: set[int] = set()
    text = str(spec).strip()
    if not text:
        return []
    for item in text.split(","):
        item = item.strip()
        try:
            if "-" in item:
                lo, hi = (int(x) for x in item.split("-", 1))
                if hi < lo:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(item))
        except ValueError:
            raise SelectionError(
                f"--softmax-layers {spec!r}: {item!r} is not a layer index or range (expected e.g. 3,7,11 or 0-3)"
            ) from None
    return sorted(out)


def layout_from_softmax_layers(indices: list[int], num_layers: int) -> list[str]:
    """All layers linear except the given softmax indices."""
    bad = [i for i in indices if i < 0 or i >= num_layers]
    if bad:
        raise SelectionError(
            f"--softmax-layers: layer index {bad[0]} is out of range: the model has {num_layers} layers (0..{num_layers - 1})"
        )
    keep = set(indices)
    return [FULL if i in keep else LINEAR for i in range(num_layers)]


def select_layout(num_layers: int, *, ratio: str | None = None, softmax_layers: str | None = None) -> list[str]:
    """Resolve the layout; an explicit list overrides the ratio; the default is :data:`DEFAULT_RATIO`."""
    if softmax_layers is not None:
        return layout_from_softmax_layers(parse_layer_list(softmax_layers), num_layers)
    return layout_from_ratio(ratio or DEFAULT_RATIO, num_layers)


def describe_layout(layer_types: list[str]) -> str:
    """A compact one-line map, e.g. ``LLLS LLLS ...`` with counts."""
    chars = "".join("S" if t == FULL else "L" for t in layer_types)
    n_lin = chars.count("L")
    return f"{chars}  ({n_lin} linear, {len(chars) - n_lin} softmax)"


def softmax_indices(layer_types: list[str]) -> list[int]:
    return [i for i, t in enumerate(layer_types) if t == FULL]


# ----------------------------------------------------------------------------------------------
# --select auto: how many softmax layers, and which


def check_select(select: str | None, *, kv_budget: str | None = None, ratio_given: bool = False,
                 default: str = "interleave") -> str:
    """Validate ``--select`` and its combination with ``--kv-budget`` / ``--ratio``; return the mode.

    Not given (None): auto with ``--kv-budget`` (it only means something there), else ``default``."""
    if select is None:
        select = "auto" if kv_budget is not None else default
    mode = str(select).strip().lower()
    if mode not in SELECT_MODES:
        raise SelectionError(f"--select {select!r}: expected one of {', '.join(SELECT_MODES)}")
    if kv_budget is not None:
        if mode != "auto":
            raise SelectionError(f"--kv-budget {kv_budget}: needs --select auto (interleave takes its count from --ratio)")
        if ratio_given:
            raise SelectionError(f"--kv-budget {kv_budget} and --ratio both set the number of softmax layers; pass one")
        parse_kv_budget(kv_budget)
    return mode


def softmax_count_from_ratio(ratio: str, num_layers: int) -> int:
    """How many softmax layers ``--select auto`` keeps for ``ratio``: the count nearest to the ratio's share of the
    layers, ``num_layers * B / (A + B)``, halves rounded down (the cheaper layout), at least one when ``B > 0``.

    On 30 layers: ``3:1`` 7 (7.5), ``7:1`` 4 (3.75), ``15:1`` 2 (1.875). The interleave pattern keeps 7, 3 and 1
    there: 27:3 and 29:1 are further from 7:1 and 15:1 than 26:4 and 28:2, and with fewer layers to place a
    ratio's count matters more (the lookup of the embedded model runs through six layers)."""
    a, b = parse_ratio(ratio)
    if b == 0:
        return 0
    share = num_layers * b / (a + b)
    return min(num_layers, max(1, math.ceil(share - 0.5 - 1e-9)))


def parse_kv_budget(text: str) -> tuple[int, int]:
    """Parse ``BYTES@LENGTH`` (``2GB@32K``, ``512MiB@4096``) into ``(bytes, tokens)``.

    BYTES: a positive byte size (:func:`linearize.units.parse_bytes`: K/KB, M/MB, G/GB, T/TB are powers of 1000,
    KiB/MiB/GiB/TiB of 1024). LENGTH: context tokens like ``--lengths`` (:func:`linearize.units.parse_length`):
    ``32K`` = 32768, ``1M`` = 1048576.
    """
    example = "expected BYTES@LENGTH, e.g. 2GB@32K or 512MiB@4096"
    raw = str(text).strip()
    if raw.count("@") != 1:
        raise SelectionError(f"--kv-budget {text!r}: {example}")
    b, length = (x.strip() for x in raw.split("@"))
    try:
        n_bytes = parse_bytes(b)
    except UnitError:
        raise SelectionError(f"--kv-budget {text!r}: {b!r} is not a byte size (units B, K/KB, M/MB, G/GB, T/TB, "
                             f"KiB, MiB, GiB, TiB); {example}") from None
    if n_bytes <= 0:
        raise SelectionError(f"--kv-budget {text!r}: the byte budget must be positive")
    try:
        tokens = parse_length(length)
    except UnitError:
        raise SelectionError(f"--kv-budget {text!r}: {length!r} is not a context length (e.g. 4096, 32K); "
                             f"{example}") from None
    return n_bytes, tokens


def softmax_count_for_budget(base_config: Any, attention: dict, budget: str, dtype_bytes: int) -> tuple[int, dict]:
    """The most softmax layers whose KV cache at LENGTH tokens (batch 1, ``dtype_bytes`` per element) plus
    the linear layers' state (fp32 S, z and the window ring) fits BYTES; ``(count, detail)``.

    Raises :class:`SelectionError` when not even the cheapest layout fits.
    """
    from ..bench.costs import kv_layer_bytes, linear_state_bytes  # imports torch: only when a budget is given

    n_bytes, length = parse_kv_budget(budget)
    n = base_config.num_hidden_layers
    kv = kv_layer_bytes(base_config, length, 1, dtype_bytes)  # a softmax layer keeps all LENGTH tokens
    # per linear layer at its widest window (layer_windows: an upper bound, so the count never overshoots)
    state = linear_state_bytes(base_config, {**attention, "window": widest_window(attention)}, 1, dtype_bytes)
    need = [k * kv + (n - k) * state for k in range(n + 1)]  # bytes depend on how many softmax layers, not where
    fits = [k for k in range(n + 1) if need[k] <= n_bytes]
    if not fits:
        raise SelectionError(
            f"--kv-budget {budget}: {n_bytes:,} bytes is smaller than the all-linear state at {length} tokens "
            f"({need[0]:,} bytes for {n} linear layers); raise BYTES or lower LENGTH")
    k = max(fits)
    detail = {"budget_bytes": n_bytes, "length": length, "dtype_bytes": dtype_bytes, "softmax_count": k,
              "bytes_used": need[k], "kv_bytes_per_softmax_layer": need[n] // n,
              "state_bytes_per_linear_layer": need[0] // n,
              "all_linear_bytes": need[0], "all_softmax_bytes": need[n]}
    return k, detail


def rank_layers(scores: list[float]) -> list[int]:
    """Layer indices, highest score first (ties: the lower index)."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


@dataclass(frozen=True)
class SeatKind:
    """One kind of softmax seat of ``--select auto``: a layer kept whatever its score and never swapped out,
    because one probe measurement ranks it among the top ``ceil(share x softmax layers)``."""

    field: str  # the recipe's ``select`` field (the share) and the ``select`` report's key (the layers)
    term: str  # the probe measurement that ranks the layers (:data:`linearize.convert.probe.TERMS`)
    reason: str  # which layers these are, for the log and the report
    measure: str  # what the measurement is, for the log
    fmt: str  # how one value of it is printed

    @property
    def label(self) -> str:
        """``"retrieval seats"``: the field as words, for the log, the report and ``info``."""
        return self.field.replace("_", " ")


#: the seat kinds, filled in this order (each after the seats before it, while seats are left). Why each:
#:
#: - ``retrieval_seats``: on the embedded model the original retrieves through layers 20-23 at every length up to
#:   8K. Trained at 8K, a 3:1 hybrid that kept all four scored 80 / 60 / 95 / 80% passkey at 1K / 2K / 4K / 8K; two
#:   with 16 sinks and wider windows kept three and two (the swap check traded 20 and 21 for layers that lowered
#:   the probe's 2K-token losses) and scored 75 / 25 / 15 / 5% and 30 / 0 / 15 / 0%. The attention term measures
#:   the original directly; the scores mix it with the probe's losses, which a wide window or short retrieval
#:   prompts can hide it in.
#: - ``ablation_seats``: the layers that read the key are not the whole lookup. Layer 18 raises the passkey answer
#:   loss most when linearized alone (0.9 nats) while attending little onto the key; six 3:1 hybrids trained at 8K
#:   that kept 20-23 and 18 scored 75-85% passkey at 1K where they also kept 7, 10-60% where the swap check had
#:   traded it away. The swap check did not see it: it compares layouts on the probe's hybrid, whose joint loss did
#:   not predict recall after training.
#: - ``loss_seats``: the layer whose linearization alone raises the held-out loss most (layer 7 here, 0.10 nats,
#:   twice the next) carries the lookup too, though no retrieval measurement ranks it first. At 7:1 (four seats)
#:   the layout 7, 18, 22, 23 scored 82.5% on the needle and 41% passkey at 1K-8K, the layout without it (18, 20,
#:   22, 23) 41% and 22.5% (the original 87.5% and 67.5%; docs/long-context-experiments.md).
SEAT_KINDS = (
    SeatKind("retrieval_seats", "attention", "the layers the original retrieves with", "attention onto the key",
             ".3f"),
    SeatKind("ablation_seats", "retrieval", "the layers the lookup needs most",
             "passkey answer loss with only that layer linear", "+.3f"),
    SeatKind("loss_seats", "loss", "the layers the model needs most", "held-out loss with only that layer linear",
             "+.3f"),
)

#: the ``select`` report's keys of the seats (and the recipe's share fields)
SEAT_FIELDS = tuple(kind.field for kind in SEAT_KINDS)


def top_seats(values: list[float] | None, count: int, share: float, taken: list[int] = ()) -> list[int]:
    """The layers, besides the ``taken`` seats, with the largest ``values`` (only values > 0 and finite: not
    noise, not a failed measurement; ties: the lower index): ``ceil(share * count)`` of them, at most the
    ``count - len(taken)`` seats left, sorted. None measured or ``share`` 0: none."""
    if not values or share <= 0 or count <= len(taken):
        return []
    n = min(count - len(taken), math.ceil(share * count - 1e-9))
    ranked = [i for i in sorted(range(len(values)), key=lambda i: (-values[i], i))
              if values[i] > 0 and math.isfinite(values[i]) and i not in taken]
    return sorted(ranked[:n])


def choose_seats(measurements: dict[str, list[float] | None], count: int,
                 shares: dict[str, float]) -> dict[str, list[int]]:
    """``{kind.field: layers}`` for every :data:`SEAT_KINDS` kind of a ``count``-layer choice, filled in order
    (``shares``: the recipe's ``select`` section)."""
    seats: dict[str, list[int]] = {}
    for kind in SEAT_KINDS:
        seats[kind.field] = top_seats(measurements.get(kind.term), count, shares[kind.field], seated(seats))
    return seats


def seated(seats: dict[str, list[int]]) -> list[int]:
    """Every layer of a :func:`choose_seats` result, whatever its kind, sorted."""
    return sorted(i for got in seats.values() for i in got)


def choose_softmax_layers(scores: list[float], count: int, reserved: list[int] = ()) -> list[int]:
    """The ``reserved`` layers (:func:`choose_seats`) and then the highest scores (ties:
    the lower index) up to ``count`` layers, sorted."""
    if not 0 <= count <= len(scores):
        raise SelectionError(f"cannot keep {count} softmax layers of {len(scores)}")
    if len(reserved) > count:
        raise SelectionError(f"{len(reserved)} reserved layers do not fit {count} softmax layers")
    free = [i for i in rank_layers(scores) if i not in reserved]
    return sorted([*reserved, *free[: count - len(reserved)]])


#: a kept and a dropped layer whose scores are closer than this (relative to the kept one) are a close call
CLOSE_CALL = 0.1


def selection_boundary(scores: list[float], count: int, reserved: list[int] = ()) -> dict | None:
    """The lowest-scoring layer kept on its score (not a reserved seat) against the highest-scoring dropped one:
    ``{"kept", "dropped", "kept_score", "dropped_score", "relative_margin", "close_call"}``; None when nothing is
    dropped or no seat is free.

    On the embedded model a probe kept layer 17 over layer 8 by 3%: passkey 95% / 100% at 1K / 2K after
    training, against 85% / 50% with 8 kept instead (same tokens and seed; README), so a close call is worth a
    warning."""
    if not 0 < count < len(scores) or len(reserved) >= count:
        return None
    order = [i for i in rank_layers(scores) if i not in reserved]
    free = count - len(reserved)
    kept, dropped = order[free - 1], order[free]
    margin = (scores[kept] - scores[dropped]) / scores[kept] if scores[kept] > 0 else 0.0
    return {"kept": kept, "dropped": dropped, "kept_score": scores[kept], "dropped_score": scores[dropped],
            "relative_margin": round(margin, 4), "close_call": margin < CLOSE_CALL}


def describe_swap(r: dict) -> str:
    """One kept round of ``--select auto``'s swap check, for reports and ``info``."""
    return f"layer {r['add']} for {r['drop']} (joint loss {r['previous']:.4f} -> {r['joint_loss']:.4f})"


def scores_markdown(report: dict) -> list[str]:
    """Markdown lines for a ``select`` stage report: the per-layer scores, softmax layers marked."""
    rows = report.get("scores") or []
    if not rows:
        return []
    lines = ["### Layer scores (`--select auto`)", "",
             f"score = {report['scoring']['formula']}; weights {report['scoring']['weights']}", "",
             "| layer | kept | attention MSE | loss increase | retrieval loss increase | retrieval attention | score "
             "| rank |",
             "|---|---|---|---|---|---|---|---|"]

    def f(x):
        return "-" if x is None else f"{x:.4g}"

    for r in rows:
        kept = ("softmax (seat)" if r.get("seat") else "softmax") if r["softmax"] else "linear"
        lines.append(f"| {r['layer']} | {kept} | {f(r['mse'])} | "
                     f"{f(r['loss_delta'])} | {f(r.get('retrieval_delta'))} | {f(r.get('retrieval_attention'))} | "
                     f"{f(r['score'])} | {r['rank']} |")
    for kind in SEAT_KINDS:
        if report.get(kind.field):
            lines += ["", f"{kind.label.capitalize()} (kept whatever their score, never swapped out: "
                          f"{kind.reason}: {kind.measure}): {report[kind.field]}."]
    b = report.get("boundary")
    if b:
        lines += ["", f"Boundary: layer {b['kept']} kept ({b['kept_score']:.4g}), layer {b['dropped']} not "
                      f"({b['dropped_score']:.4g}), {100 * b['relative_margin']:.1f}% apart"
                      + (" (a close call: another probe budget or seed may swap them)" if b["close_call"] else "")
                      + "."]
    sw = report.get("swap_check")
    if sw:
        done = [r for r in sw["rounds"] if r["kept"]]
        lines += ["", f"Swap check ({sw['layouts_evaluated']} layouts on the probe's hybrid, {sw['seconds']}s): "
                      + ("; ".join(describe_swap(r) for r in done) or "no swap kept")
                      + f"; softmax layers {sw['final_layers']} (scores alone: {sw['start_layers']})."]
    return lines + [""]

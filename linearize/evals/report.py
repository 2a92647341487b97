"""Render an evaluation summary: ``report.md`` (model vs original vs difference tables),
PNG heatmaps (length x depth, green-red, values in the cells), the recall capacity plot and
a rich table for the terminal.

Everything is rendered from ``summary.json`` alone (:func:`write_report`), so a report can be
re-rendered later without rerunning anything.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from linearize.units import format_length

from . import copyspan
from .common import depth_key

ROLE_LABEL = {"model": "model", "against": "original", "diff": "difference"}
TASK_ORDER = ("niah", "passkey", "swapback", "copy", "ppl", "recall", "agreement", "speed", "lm-eval")


# ----------------------------------------------------------------------------- numbers

def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x)) else None


def diff_values(m: Any, a: Any) -> Any:
    """``m - a`` for numbers and (nested) dicts of numbers with the same keys; None elsewhere."""
    if isinstance(m, dict) and isinstance(a, dict):
        out = {k: diff_values(m[k], a[k]) for k in m if k in a}
        return {k: v for k, v in out.items() if v is not None} or None
    mm, aa = _num(m), _num(a)
    if mm is None or aa is None:
        return None
    return round(mm - aa, 6)


def task_difference(task: str, m: dict, a: dict) -> dict:
    """The ``difference`` entry of one task: model minus original for score and breakdowns
    (for speed also the model/original ratios)."""
    out: dict = {"metric": m.get("metric"), "higher_is_better": m.get("higher_is_better")}
    for key in ("score", "strict", "by_length", "strict_by_length", "by_depth", "grid", "by_pairs", "capacity",
                "kl", "nll", "kl_by_length", "by_task", "prefill_by_length", "peak_mib_by_length", "key_nll", "by_data"):
        if key in m and key in a:
            d = diff_values(m[key], a[key])
            if d is not None:
                out[key] = d
    if "by_variant" in m and "by_variant" in a:
        out["by_variant"] = {k: diff_values(v, a["by_variant"][k]) for k, v in m["by_variant"].items() if k in a["by_variant"]}
    if task == "speed":
        def ratio(x, y):
            x, y = _num(x), _num(y)
            return round(x / y, 4) if x is not None and y else None
        out["ratio"] = ratio(m.get("score"), a.get("score"))
        out["ratio_by_length"] = {k: ratio(v, a.get("by_length", {}).get(k)) for k, v in m.get("by_length", {}).items()}
        out["prefill_ratio_by_length"] = {k: ratio(v, a.get("prefill_by_length", {}).get(k))
                                          for k, v in m.get("prefill_by_length", {}).items()}
    return out


def fmt(x: Any, metric: str | None = None, signed: bool = False) -> str:
    v = _num(x)
    if v is None:
        return "–"
    if metric and metric.endswith("tok_s"):
        return f"{v:+.1f}" if signed else f"{v:.1f}"
    if metric in ("score", "accuracy", "top1"):
        s = f"{100 * v:+.1f}" if signed else f"{100 * v:.1f}"
        return s + "%"
    if metric in ("ppl",) or abs(v) >= 100:
        return f"{v:+.2f}" if signed else f"{v:.2f}"
    return f"{v:+.4f}" if signed else f"{v:.4f}"


def _diff_cell(task: str, d: dict, metric: str | None) -> str:
    """The difference column of the summary: model − original, or model / original for speed."""
    if task == "speed":
        r = _num(d.get("ratio"))
        return f"{r:.2f}×" if r is not None else "–"
    return fmt(d.get("score"), metric, signed=True)


def headline_rows(summary: dict) -> list[tuple[str, str, dict, dict | None, dict]]:
    """The summary table's rows: ``(task, metric label, model, original or None, difference)``, each a dict with
    ``score``. One row per task, except ppl: one row per context length, each named (``ppl @ 2K``), so the
    table never shows one length's perplexity as the task's."""
    m_all = summary["tasks"]
    ag = summary.get("against")
    d_all = summary.get("difference") or {}
    rows = []
    for t in [t for t in TASK_ORDER if t in m_all]:
        m = m_all[t]
        a = ag["tasks"].get(t, {}) if ag else None
        d = d_all.get(t, {})
        metric = str(m.get("metric"))
        arrow = "↑" if m.get("higher_is_better") else "↓"
        if t == "ppl" and m.get("by_data"):  # several data specs: one row per spec and length
            for data, by in m["by_data"].items():
                a_by, d_by = ((a or {}).get("by_data") or {}).get(data) or {}, (d.get("by_data") or {}).get(data) or {}
                for k in sorted(by, key=int):
                    rows.append((t, f"{metric} @ {format_length(int(k))} {data} {arrow}", {"score": by[k]},
                                 {"score": a_by.get(k)} if a is not None else None, {"score": d_by.get(k)}))
            continue
        if t == "ppl" and m.get("by_length"):
            for k in sorted(m["by_length"], key=int):
                rows.append((t, f"{metric} @ {format_length(int(k))} {arrow}", {"score": m["by_length"][k]},
                             {"score": (a.get("by_length") or {}).get(k)} if a is not None else None,
                             {"score": (d.get("by_length") or {}).get(k)}))
            continue
        rows.append((t, f"{metric} {arrow}", m, a, d))
    return rows


def _label_depth(d: str) -> str:
    return f"{100 * float(d):.0f}%"


# ----------------------------------------------------------------------------- plots

def _matplotlib():
    # heavy optional: matplotlib, only when a report draws its heatmaps
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg", force=False)
    # heavy optional: matplotlib, only when a report draws its heatmaps
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return matplotlib, plt


def heatmap(grid: dict, path: Path, title: str, *, diff: bool = False) -> Path:
    """Length (columns) x depth (rows) heatmap with the value printed in every cell.

    Scores use red (0%) -> yellow -> green (100%); differences use red (model worse) ->
    white (equal) -> green (model better) on [-100%, +100%]."""
    matplotlib, plt = _matplotlib()
    # heavy optional: matplotlib, only when a report draws its heatmaps
    from matplotlib.colors import LinearSegmentedColormap  # noqa: PLC0415

    lengths = sorted(grid, key=int)
    depths = sorted({d for L in lengths for d in grid[L]}, key=float)
    data = np.full((len(depths), len(lengths)), np.nan)
    for j, L in enumerate(lengths):
        for i, d in enumerate(depths):
            v = _num(grid[L].get(d))
            if v is not None:
                data[i, j] = v
    if diff:
        cmap = LinearSegmentedColormap.from_list("rwg", ["#c62828", "#ffffff", "#2e7d32"])
        vmin, vmax = -1.0, 1.0
    else:
        cmap = matplotlib.colormaps["RdYlGn"]
        vmin, vmax = 0.0, 1.0
    cmap = cmap.with_extremes(bad="#dddddd")
    w = 2.2 + 1.0 * len(lengths)
    h = 1.6 + 0.42 * len(depths)
    fig, ax = plt.subplots(figsize=(w, h), dpi=130)
    im = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    ax.set_xticks(range(len(lengths)), [format_length(int(L)) for L in lengths])
    ax.set_yticks(range(len(depths)), [_label_depth(d) for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=10)
    for i in range(len(depths)):
        for j in range(len(lengths)):
            v = data[i, j]
            if np.isnan(v):
                txt, color = "–", "black"
            else:
                txt = f"{100 * v:+.0f}" if diff else f"{100 * v:.0f}"
                if diff and round(100 * v) == 0:
                    txt = "0"
                r, g, b, _ = cmap((v - vmin) / (vmax - vmin))
                color = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
            ax.text(j, i, txt, ha="center", va="center", fontsize=9, color=color)
    cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    cb.set_label("model − original (points)" if diff else "score (%)")
    cb.set_ticks([-1, -0.5, 0, 0.5, 1] if diff else [0, 0.25, 0.5, 0.75, 1])
    cb.set_ticklabels(["-100", "-50", "0", "+50", "+100"] if diff else ["0", "25", "50", "75", "100"])
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def recall_plot(curves: dict[str, dict], path: Path, title: str) -> Path:
    """Accuracy vs number of pairs (log2 x axis), one line per model."""
    _, plt = _matplotlib()
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=130)
    styles = {"model": dict(color="#1565c0", marker="o", zorder=3),
              "original": dict(color="#9e9e9e", marker="s", linestyle="--", linewidth=2.5, markersize=8, zorder=2)}
    allx: set[int] = set()
    for label, by in curves.items():
        xs = sorted(int(k) for k in by)
        ys = [100 * float(by[str(x)]) for x in xs]
        allx.update(xs)
        ax.plot(xs, ys, label=label, **styles.get(label.split(":")[0], {}))
    ax.set_xscale("log", base=2)
    xs = sorted(allx)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_ylim(-3, 103)
    ax.set_xlabel("key-value pairs in context")
    ax.set_ylabel("values recalled (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- markdown

def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _sbs_rows(keys: list[str], m: dict, a: dict | None, d: dict | None, metric: str, label=lambda k: k) -> list[list[str]]:
    rows = []
    for k in keys:
        row = [label(k), fmt(m.get(k), metric)]
        if a is not None:
            row += [fmt(a.get(k), metric), fmt((d or {}).get(k), metric, signed=True)]
        rows.append(row)
    return rows


def _sbs_header(first: str, has_against: bool) -> list[str]:
    return [first, "model"] + (["original", "difference"] if has_against else [])


def _grid_table(grid: dict, metric: str, signed: bool = False) -> list[str]:
    lengths = sorted(grid, key=int)
    depths = sorted({d for L in lengths for d in grid[L]}, key=float)
    rows = [[_label_depth(d)] + [fmt(grid[L].get(d), metric, signed) for L in lengths] for d in depths]
    return _table(["depth"] + [format_length(int(L)) for L in lengths], rows)


def _lengths_label(k: str) -> str:
    return format_length(int(k))


def _interval(x: Any) -> str:
    return f"{100 * x[0]:.0f}–{100 * x[1]:.0f}%" if isinstance(x, (list, tuple)) and len(x) == 2 else "–"


def _score_by_length(m: dict, a: dict | None, d: dict | None) -> list[str]:
    """The per-length score table of a recall task, with each side's prompts and 95% interval and, against the
    original, the prompts the model did better / worse on and the sign test's p (:mod:`linearize.evals.stats`;
    reports from before these fields show dashes)."""
    keys = sorted(m["by_length"], key=int)
    paired = (d or {}).get("paired_by_length") or {}
    header = ["length", "model", "95% interval"] + (["original", "95% interval", "difference",
                                                      "prompts better / worse", "p (sign test)"] if a is not None else [])
    rows = []
    for k in keys:
        row = [_lengths_label(k), fmt(m["by_length"].get(k), "score"), _interval((m.get("interval_by_length") or {}).get(k))]
        if a is not None:
            pk = paired.get(k)
            row += [fmt(a["by_length"].get(k), "score"), _interval((a.get("interval_by_length") or {}).get(k)),
                    fmt((d or {}).get("by_length", {}).get(k), "score", signed=True),
                    f"{pk['better']} / {pk['worse']} of {pk['pairs']}" if pk else "–",
                    f"{pk['p']:.3g}" if pk else "–"]
        rows.append(row)
    n = sorted(set((m.get("n_by_length") or {}).values()))
    note = (f"{'/'.join(map(str, n))} prompts per length; the interval is Wilson's 95% for that many. "
            if n else "")
    if a is not None and paired:
        note += ("Against the original on the same prompts: p is the chance of a better / worse split at least "
                 "that lopsided if neither model were better (prompts both scored alike left out).")
    return _table(header, rows) + ([""] + [note.strip()] if note else [])


def render_markdown(summary: dict, images: dict[str, dict[str, str]]) -> str:
    m_all = summary["tasks"]
    ag = summary.get("against") or None
    a_all = ag["tasks"] if ag else {}
    d_all = summary.get("difference") or {}
    cfg = summary.get("config", {})
    has_a = ag is not None
    L: list[str] = [f"# linearize eval: `{summary['model']}`", ""]
    if has_a:
        L.append(f"Compared against the original `{ag['model']}`"
                 + (f" (its results from the earlier report `{ag['from_report']}`)" if ag.get("from_report") else "")
                 + ". Difference = model − original.")
        L.append("")
    meta = [
        ("created", summary.get("created", "")),
        ("tasks", ", ".join(cfg.get("tasks", []))),
        ("lengths", ", ".join(format_length(x) for x in cfg.get("lengths", []))),
        ("depths", ", ".join(f"{100 * x:.0f}%" for x in cfg.get("depths", []))),
        ("seeds", ", ".join(map(str, cfg.get("seeds", [])))),
        ("chat template", ", ".join(f"{k}: {'on' if v else 'off'}" for k, v in (cfg.get("chat_template") or {}).items())),
        ("device / dtype", f"{cfg.get('device')} / {cfg.get('dtype')}"),
        ("prompts identical for both models", {True: "yes", False: "NO", None: "–"}[summary.get("prompts_identical")]),
        ("elapsed", f"{summary.get('elapsed_s', 0):.0f} s"),
        ("versions", ", ".join(f"{k} {v}" for k, v in (summary.get("versions") or {}).items())),
    ]
    L += _table(["setting", "value"], [[k, str(v)] for k, v in meta if v not in ("", None)]) + [""]

    # headline table
    L += ["## Summary", ""]
    rows = []
    for t, label, m, a, d in headline_rows(summary):
        metric = m_all[t].get("metric")
        row = [t, label, fmt(m.get("score"), metric)]
        if has_a:
            row += [fmt((a or {}).get("score"), metric), _diff_cell(t, d, metric)]
        rows.append(row)
    L += _table(["task", "metric", "model"] + (["original", "difference"] if has_a else []), rows) + [""]
    if has_a and "speed" in m_all:
        L += ["For speed the difference column is the ratio model / original.", ""]

    for t in [t for t in TASK_ORDER if t in m_all]:
        m, a, d = m_all[t], a_all.get(t), d_all.get(t)
        L += [f"## {t}", ""]
        if t in ("niah", "passkey", "copy"):
            if t == "copy":
                L += [f"Share of the {m.get('span')}-token copied span (after its {copyspan.CUE}-token cue) predicted "
                      "exactly; depth = where the source span sits (0% = the start of the sequence, the farthest copy).", ""]
            imgs = images.get(t, {})
            if imgs:
                L.append(" ".join(f"![{ROLE_LABEL[r]}]({p})" for r, p in imgs.items()))
                L.append("")
            L += ["Score (fraction of expected values found) by context length:", ""]
            L += _score_by_length(m, a, d) + [""]
            L += ["Strict score by context length:", ""]
            L += _table(_sbs_header("length", has_a), _sbs_rows(sorted(m["strict_by_length"], key=int), m["strict_by_length"],
                                                                 a and a["strict_by_length"], d and d.get("strict_by_length"),
                                                                 "score", _lengths_label)) + [""]
            if "by_variant" in m:
                L += ["By variant (score per length; `all` = mean):", ""]
                lens = [str(x) for x in cfg.get("lengths", [])]
                vrows = []
                for vname, vm in m["by_variant"].items():
                    va = (a or {}).get("by_variant", {}).get(vname)
                    for role, src in (("model", vm), ("original", va)):
                        if src is None:
                            continue
                        vrows.append([vname if role == "model" else "", role]
                                     + [fmt(src["by_length"].get(x), "score") for x in lens] + [fmt(src["score"], "score")])
                    if va is not None:
                        dv = (d or {}).get("by_variant", {}).get(vname) or {}
                        vrows.append(["", "difference"] + [fmt((dv.get("by_length") or {}).get(x), "score", True) for x in lens]
                                     + [fmt(dv.get("score"), "score", True)])
                L += _table(["variant", ""] + [format_length(int(x)) for x in lens] + ["all"], vrows) + [""]
            L += ["Length × depth (model):", ""] + _grid_table(m["grid"], "score") + [""]
            if m.get("misses"):
                L += [f"Misses of the model ({m['missed']} of {m['n']}; the first {len(m['misses'])}):", ""]
                L += _table(["length", "depth", "seed", "expected", "output"],
                            [[_lengths_label(str(x["length"])), depth_key(x["depth"]), str(x["seed"]),
                              ", ".join(map(str, x["expected"] or [])),
                              "`" + x["output"].replace("`", "'").replace("|", "/").replace("\n", " ") + "`"]
                             for x in m["misses"]]) + [""]
            if a is not None:
                L += ["Length × depth (original):", ""] + _grid_table(a["grid"], "score") + [""]
                if d and d.get("grid"):
                    L += ["Length × depth (difference):", ""] + _grid_table(d["grid"], "score", signed=True) + [""]
        elif t == "swapback":
            L += ["Passkey key accuracy, teacher-forced (every token of the key is the model's top token), as converted "
                  "and with each linear layer alone switched back to its original softmax attention: a layer that lifts "
                  "the score is one the hybrid needs as softmax (`--softmax-layers`).", ""]
            lens = sorted(m["by_length"], key=int)

            def cells(src):
                return [fmt(src["by_length"].get(k), "score") for k in lens] + [fmt(src["score"], "score"),
                                                                                fmt(src.get("key_nll"))]

            rows = [["as converted"] + cells(m) + [""]]
            if a is not None:
                rows.append(["original"] + cells(a) + [""])
            rows += [[f"layer {i} softmax"] + cells(v) + [fmt(v["score"] - m["score"], "score", True)]
                     for i, v in m.get("layers", {}).items()]
            L += _table(["layout"] + [_lengths_label(k) for k in lens] + ["all", "key NLL", "gain"], rows) + [""]
        elif t == "ppl" and m.get("by_data"):
            for data, by in m["by_data"].items():
                L += [f"Perplexity on {m['tokens_by_data'][data]} held-out tokens of `{data}` (sliding window, stride = "
                      "length/2; lower is better):", ""]
                L += _table(_sbs_header("length", has_a), _sbs_rows(
                    sorted(by, key=int), by, a and (a.get("by_data") or {}).get(data),
                    d and (d.get("by_data") or {}).get(data), "ppl", _lengths_label)) + [""]
        elif t == "ppl":
            L += [f"Perplexity on {m.get('tokens')} held-out tokens of `{m.get('data')}` (sliding window, stride = length/2; lower is better):", ""]
            L += _table(_sbs_header("length", has_a), _sbs_rows(sorted(m["by_length"], key=int), m["by_length"],
                                                                 a and a["by_length"], d and d.get("by_length"), "ppl",
                                                                 _lengths_label)) + [""]
        elif t == "recall":
            if images.get(t):
                L += [" ".join(f"![recall]({p})" for p in images[t].values()), ""]
            keys = sorted(m["by_pairs"], key=int)
            rows = []
            for k in keys:
                row = [k, str(m.get("tokens_by_pairs", {}).get(k, "–")), fmt(m["by_pairs"][k], "accuracy")]
                if has_a:
                    row += [fmt(a["by_pairs"].get(k), "accuracy"), fmt((d or {}).get("by_pairs", {}).get(k), "accuracy", True)]
                rows.append(row)
            L += _table(["pairs", "tokens"] + _sbs_header("x", has_a)[1:], rows) + [""]
            cap = f"Capacity (largest pair count recalled at ≥ 90%): model {m.get('capacity')}"
            if has_a:
                cap += f", original {a.get('capacity')}"
            L += [cap + ".", ""]
            if m.get("skipped"):
                L += [f"Skipped (longer than the model's position limit): {', '.join(map(str, m['skipped']))} pairs.", ""]
        elif t == "agreement":
            L += [f"Teacher-forced on text the original generated; mean over positions. top-1 agreement (↑), "
                  f"KL(original ‖ model) in nats/token (↓). Overall: top-1 {fmt(m.get('score'), 'top1')}, "
                  f"KL {fmt(m.get('kl'))}, model NLL of the original's tokens {fmt(m.get('nll'))}.", ""]
            rows = []
            for k in sorted(m["by_length"], key=int):
                row = [_lengths_label(k), fmt(m["by_length"][k], "top1"), fmt(m["kl_by_length"].get(k))]
                if has_a:
                    row += [fmt(a["by_length"].get(k), "top1"), fmt(a["kl_by_length"].get(k)),
                            fmt((d or {}).get("by_length", {}).get(k), "top1", True)]
                rows.append(row)
            hdr = ["length", "top-1 model", "KL model"] + (["top-1 original (self)", "KL original (self)", "top-1 difference"] if has_a else [])
            L += _table(hdr, rows) + [""]
        elif t == "speed":
            L += [f"Through `generate()`; decode = {m.get('decode_tokens', 32)} tokens after the prompt; memory: {m.get('memory')} "
                  "(see `linearize.evals.speed`). Ratio = model / original.", ""]
            ag_grid = {(r["length"], r["batch"]): r for r in (a or {}).get("grid", [])}
            rows = []
            for r in m.get("grid", []):
                o = ag_grid.get((r["length"], r["batch"]), {})
                row = [format_length(r["length"]), str(r["batch"])]
                if r.get("oom"):
                    row += ["OOM", "", ""] if not has_a else ["OOM", "", "", "", "", "", "", ""]
                    rows.append(row)
                    continue
                row += [f"{r['prefill_tok_s']:.0f}", f"{r['decode_tok_s']:.1f}", f"{r['peak_mib']:.0f}"]
                if has_a:
                    def rt(x, y):
                        return f"{x / y:.2f}×" if _num(x) and _num(y) else "–"
                    row += [f"{o.get('prefill_tok_s', 0):.0f}" if o.get("prefill_tok_s") else "–",
                            f"{o.get('decode_tok_s', 0):.1f}" if o.get("decode_tok_s") else "–",
                            f"{o.get('peak_mib', 0):.0f}" if o.get("peak_mib") else "–",
                            rt(r["prefill_tok_s"], o.get("prefill_tok_s")), rt(r["decode_tok_s"], o.get("decode_tok_s"))]
                rows.append(row)
            hdr = ["length", "batch", "prefill tok/s", "decode tok/s", "peak MiB"]
            if has_a:
                hdr += ["prefill tok/s (orig.)", "decode tok/s (orig.)", "peak MiB (orig.)", "prefill ratio", "decode ratio"]
            L += _table(hdr, rows) + [""]
        elif t == "lm-eval":
            keys = list(m.get("by_task", {}))
            rows = []
            for k in keys:
                row = [k, str(m.get("metric_by_task", {}).get(k)), fmt(m["by_task"][k], "accuracy")]
                if has_a:
                    row += [fmt(a.get("by_task", {}).get(k), "accuracy"), fmt((d or {}).get("by_task", {}).get(k), "accuracy", True)]
                rows.append(row)
            L += _table(["task", "metric", "model"] + (["original", "difference"] if has_a else []), rows) + [""]
    L += ["## Files", "",
          "- `summary.json`: every number above, machine-readable (`tasks`, `against.tasks`, `difference`).",
          "- `results.jsonl`: one row per sample (`model` is `model` or `against`); needle rows carry seed, length, "
          "depth, the actual needle token position, expected values, output and scores, enough to rebuild the prompt "
          "(`prompt_sha1` checks it).", ""]
    return "\n".join(L)


def write_report(out_dir: Path, summary: dict) -> list[Path]:
    """Write ``report.md`` and the PNGs for ``summary`` into ``out_dir``; return the files written."""
    out_dir = Path(out_dir)
    files: list[Path] = []
    images: dict[str, dict[str, str]] = {}
    m_all = summary["tasks"]
    ag = summary.get("against")
    d_all = summary.get("difference") or {}
    for t in ("niah", "passkey", "copy"):
        if t not in m_all or not m_all[t].get("grid"):
            continue
        imgs: dict[str, str] = {}
        m = m_all[t]
        files.append(heatmap(m["grid"], out_dir / f"{t}_model.png",
                             f"{t} · model: {summary['model']}\nmean {fmt(m['score'], 'score')}"))
        imgs["model"] = files[-1].name
        if ag and t in ag["tasks"]:
            a = ag["tasks"][t]
            files.append(heatmap(a["grid"], out_dir / f"{t}_against.png",
                                 f"{t} · original: {ag['model']}\nmean {fmt(a['score'], 'score')}"))
            imgs["against"] = files[-1].name
            if d_all.get(t, {}).get("grid"):
                files.append(heatmap(d_all[t]["grid"], out_dir / f"{t}_diff.png",
                                     f"{t} · model − original\nmean {fmt(d_all[t].get('score'), 'score', signed=True)}",
                                     diff=True))
                imgs["diff"] = files[-1].name
        images[t] = imgs
    if "recall" in m_all and m_all["recall"].get("by_pairs"):
        curves = {f"model: {summary['model']}": m_all["recall"]["by_pairs"]}
        if ag and ag["tasks"].get("recall", {}).get("by_pairs"):
            curves[f"original: {ag['model']}"] = ag["tasks"]["recall"]["by_pairs"]
        files.append(recall_plot(curves, out_dir / "recall.png", "in-context key→value recall (MQAR-style)"))
        images["recall"] = {"model": files[-1].name}
    md = out_dir / "report.md"
    md.write_text(render_markdown(summary, images), encoding="utf-8")
    files.append(md)
    return files


# ----------------------------------------------------------------------------- terminal

def summary_table(summary: dict):
    """A rich Table: task, metric, model, original, difference."""
    ag = summary.get("against")
    table = Table(title=f"linearize eval · {summary['model']}" + (f" vs {ag['model']}" if ag else ""))
    table.add_column("task")
    table.add_column("metric")
    table.add_column("model", justify="right")
    if ag:
        table.add_column("original", justify="right")
        table.add_column("difference", justify="right")
    for t, label, m, a, d in headline_rows(summary):
        task = summary["tasks"][t]
        metric = task.get("metric")
        row = [t, label, fmt(m.get("score"), metric)]
        if ag:
            style = ""
            dv = _num(d.get("score"))
            if dv is not None and abs(dv) > 1e-12:
                good = (dv > 0) == bool(task.get("higher_is_better"))
                style = "green" if good else "red"
            txt = _diff_cell(t, d, metric)
            row += [fmt((a or {}).get("score"), metric), f"[{style}]{txt}[/{style}]" if style else txt]
        table.add_row(*row)
    return table

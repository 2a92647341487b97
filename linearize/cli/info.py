"""``linearize info``: layer map, parameters, cache bytes and speed bounds of a model, a hybrid or a planned
conversion (:func:`linearize.bench.info.model_info`), without loading weights unless ``--retrieval`` asks."""

from __future__ import annotations

from typing import List, Optional

import typer
from rich.table import Table

from ..bench.info import model_info, retrieval_layers
from ..convert.selection import SEAT_KINDS, describe_swap
from ..errors import LinearizeError
from ..settings import DEFAULT_RECIPE
from ..units import format_bytes, format_length
from .app import app, console, user_errors
from .options import overrides


@app.command()
@user_errors
def info(spec: str = typer.Argument(..., help="Model spec or hybrid checkpoint directory."),
         ratio: Optional[str] = typer.Option(None, "--ratio", help="Plan a conversion: show the hybrid A:B would build (no weights loaded; an alias not on this machine uses its shipped published config)."),
         softmax_layers: Optional[str] = typer.Option(None, "--softmax-layers", help="Plan a conversion with these softmax layers, e.g. 3,7,11 (overrides --ratio)."),
         recipe: Optional[str] = typer.Option(None, "--recipe", help=f"With --ratio / --softmax-layers: the recipe (default {DEFAULT_RECIPE})."),
         set_: Optional[List[str]] = typer.Option(None, "--set", help="With --ratio / --softmax-layers: override an attention.* field of the recipe, e.g. attention.window=2048 (repeatable)."),
         retrieval: Optional[str] = typer.Option(None, "--retrieval", help="LENGTHS (e.g. 1K,2K): load the original model and show, per layer, its attention from the answer position onto a hidden pass key (the layers that retrieve)."),
         dtype: Optional[str] = typer.Option(None, "--dtype", help="With --retrieval: float32, bfloat16 or float16."),
         device: Optional[str] = typer.Option(None, "--device", help="With --retrieval: cpu, cuda or cuda:N.")):
    """Show the layer map, parameter counts and cache bytes at 4K/32K/128K (of a conversion, planned with --ratio)."""
    if retrieval is None and (dtype is not None or device is not None):
        raise LinearizeError("info: --dtype and --device only apply with --retrieval (nothing else loads weights)")
    if retrieval is not None and (ratio is not None or softmax_layers is not None):
        raise LinearizeError("info: --retrieval measures the original model; it does not combine with --ratio / "
                             "--softmax-layers")
    data = model_info(spec, ratio=ratio, softmax_layers=softmax_layers, recipe=recipe, overrides=overrides(set_))
    console.print(f"[bold]{data['name']}[/] ({data['model_type']}, {data['num_layers']} layers)", highlight=False)
    if data.get("note"):
        console.print(data["note"], highlight=False)
    console.print(f"layers: {data['layout']}", highlight=False)
    if data.get("converted"):
        console.print(f"converted layers: {data['converted']}", highlight=False)
    if data.get("sliding"):
        console.print(f"sliding: {data['sliding']}", highlight=False)
    console.print(f"parameters: {data['parameters']:,} (added by conversion: {data['extra_parameters']:,})")
    table = Table(title="per sequence: cache + state bytes (bf16 KV, fp32 state)" + (" and speed bounds" if data.get("bounds") else ""))
    table.add_column("context")
    table.add_column("original", justify="right")
    table.add_column("hybrid", justify="right")
    table.add_column("hybrid / original", justify="right")
    bounds = data.get("bounds")
    if bounds:
        table.add_column("prefill bound", justify="right")
        table.add_column("decode bound", justify="right")
    for length, row in data["cache_bytes"].items():
        cells = [length, format_bytes(row["original"]), format_bytes(row["hybrid"]),
                 f"{row['hybrid'] / row['original']:.1%}"]
        if bounds:
            cells += [f"{bounds[length]['prefill']:.2f}x", f"{bounds[length]['decode']:.2f}x"]
        table.add_row(*cells)
    console.print(table)
    if bounds:
        console.print("bounds: hybrid / original speed at equal efficiency, batch 1 (prefill: FLOPs per token, "
                      "windows counted, linear parts free; decode: weight + cache bytes read per step); `linearize "
                      "bench model` measures both", highlight=False)
    q = data.get("quality") or {}
    if "ppl" in q:
        p = q["ppl"]
        console.print(f"held-out perplexity ({p['seq_len']}-token sequences): hybrid {p['hybrid']:.2f}, teacher "
                      f"{p['teacher']:.2f} ({p['hybrid'] / p['teacher']:.3f}x)", highlight=False)
    if "copy" in q:
        c = q["copy"]
        console.print(f"recall check (copy, {c['length']} tokens, {c['samples']} samples): hybrid {100 * c['hybrid']:.1f}%, "
                      f"teacher {100 * c['teacher']:.1f}%", highlight=False)
    if "passkey" in q:
        from ..evals.stats import paired_note  # here: the evals package imports torch, which `info` defers

        k = q["passkey"]
        console.print(f"recall check (passkey, {k['length']} tokens, {k['prompts']} prompts): "
                      f"hybrid {100 * k['hybrid']:.0f}%, teacher {100 * k['teacher']:.0f}%"
                      + (f" ({paired_note(k['better'], k['worse'], k['p'])})" if "p" in k else ""), highlight=False)
    if "select" in q:
        sel, b = q["select"], q["select"]["boundary"]
        console.print(f"softmax layers chosen by --select auto: {sel['softmax_layers']}"
                      + "".join(f"; {k.label}: {sel[k.field]}" for k in SEAT_KINDS if sel.get(k.field))
                      + (f"; boundary: layer {b['kept']} kept ({b['kept_score']:.4f}), layer {b['dropped']} not "
                         f"({b['dropped_score']:.4f}), {100 * b['relative_margin']:.1f}% apart"
                         + (" (a close call)" if b["close_call"] else "") if b else "")
                      + "".join(f"; swap check: {describe_swap(r)}" for r in sel["swaps"]), highlight=False)
    if retrieval is not None:
        from ..evals.common import parse_lengths  # start-up time: the evals package imports torch

        ret = retrieval_layers(spec, parse_lengths(retrieval), dtype=dtype, device=device)
        console.print(f"attention from the answer position onto a hidden pass key (max over heads, mean of "
                      f"{ret['prompts']} passkey prompts per length, depths 0..1):", highlight=False)
        table = Table(title="retrieval attention per layer")
        table.add_column("layer", justify="right")
        for n in ret["by_length"]:
            table.add_column(format_length(int(n)), justify="right")
        for i in range(data["num_layers"]):
            table.add_row(str(i), *[f"{v[i]:.3f}" for v in ret["by_length"].values()])
        console.print(table)
        mean = [sum(v[i] for v in ret["by_length"].values()) / len(ret["by_length"]) for i in range(data["num_layers"])]
        top = sorted(sorted(range(len(mean)), key=lambda i: -mean[i])[:4])
        console.print(f"retrieving layers (top 4 by mean): {','.join(map(str, top))}", highlight=False)

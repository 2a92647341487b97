"""What `linearize info` shows: layer map, parameter counts and cache bytes, without loading weights; with
``--retrieval``, where the original model retrieves (loads it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..convert.selection import SEAT_FIELDS, describe_layout, select_layout
from ..errors import SelectionError, SpecError
from ..io.sources import load_model, local_dir, read_config, resolve, shipped_configs, vision_language_note
from ..model.layout import GATED_DELTA
from ..settings import DEFAULT_RECIPE
from ..units import parse_length

# torch, transformers and the model code are imported where they are used: a spec that cannot be found ends in
# one line before any of them loads

#: the context lengths info reports, by label
CONTEXTS = {label: parse_length(label) for label in ("4K", "32K", "128K")}


def base_config(spec: str):
    """``(config, name, local directory or None)`` of a spec, without weights. An alias that is not on this
    machine falls back to its published config shipped with the package (``linearize/model_configs``), so a
    conversion can be planned offline; anything else missing raises the usual one-line :class:`SpecError`."""
    try:
        r = resolve(spec)
        path = local_dir(r)
    except SpecError:
        if spec not in shipped_configs():
            raise
        # start-up time: an unknown spec or a bad option is one line before torch and transformers load
        from .model import load_config

        return load_config(spec)[0], f"{spec} (published config; weights not on this machine)", None
    return read_config(path), r.name, path


def model_info(spec: str, *, ratio: str | None = None, softmax_layers: str | None = None,
               recipe: str | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Layer map, parameters (total and added by linearization) and cache bytes for a spec or hybrid dir.

    ``ratio`` / ``softmax_layers`` (and ``recipe``, default ``lolcats``, with ``attention.*`` ``overrides``) plan a
    conversion of an original model: the report is then the hybrid ``convert`` would build with that layout,
    computed on the meta device."""
    config, name, path = base_config(spec)  # an unknown spec fails here, before the imports below
    # start-up time: an unknown spec or a bad option is one line before torch and transformers load
    import torch

    # start-up time: an unknown spec or a bad option is one line before torch and transformers load
    from transformers import AutoModelForCausalLM

    # start-up time: an unknown spec or a bad option is one line before torch and transformers load
    from .. import recipe as recipes

    # start-up time: an unknown spec or a bad option is one line before torch and transformers load
    from ..convert.surgery import check_config_supported, linearize_model

    # start-up time: an unknown spec or a bad option is one line before torch and transformers load
    from ..model.cache import softmax_windows

    # start-up time: an unknown spec or a bad option is one line before torch and transformers load
    from .costs import cache_bytes

    planned = ratio is not None or softmax_layers is not None
    if planned and config.model_type == "linearize":
        raise SelectionError(f"{spec} is already a hybrid; --ratio / --softmax-layers plan the conversion of an "
                             "original model")
    if recipe is not None and not planned:
        raise SelectionError("info: --recipe only applies with --ratio or --softmax-layers (a planned conversion)")
    if overrides and not planned:
        raise SelectionError("info: --set only applies with --ratio or --softmax-layers (a planned conversion; a "
                             "checkpoint's settings are in its config.json)")
    if planned:
        check_config_supported(config, spec)
        layout = select_layout(config.num_hidden_layers, ratio=ratio, softmax_layers=softmax_layers)
        recipes.check_layer_overrides(overrides or {}, "info")
        rec = recipes.load(recipe or DEFAULT_RECIPE, overrides or None)  # validated before anything is built
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        if planned:
            model = linearize_model(model, layout, rec)
            config = model.config
    total = sum(p.numel() for p in model.parameters())
    # what conversion adds: each converted layer's own parameters (feature maps, window mix, gates, delta-rule parts)
    extra = sum(p.numel() for m in getattr(model, "linear_modules", list)() for p in m.learned_parameters())
    if config.model_type == "linearize":
        layout_line = describe_layout(config.layer_types) + (f" (planned, recipe {rec.name})" if planned else "")
        base_type = config.base_model_type
    else:
        layout_line = describe_layout(["full_attention"] * config.num_hidden_layers) + " (not converted)"
        base_type = config.model_type
    stages = report_stages(path) if not planned else {}  # the conversion's report.json, read once
    return {
        "name": name,
        "model_type": base_type,
        "num_layers": config.num_hidden_layers,
        "layout": layout_line,
        "sliding": describe_sliding(softmax_windows(config)),
        "converted": describe_converted(config.linear_attention, stages.get("finetune"))
        if config.model_type == "linearize" else None,
        "layer_types": getattr(config, "layer_types", None),
        "parameters": total,
        "extra_parameters": extra,
        "cache_bytes": {ctx: cache_bytes(config, n) for ctx, n in CONTEXTS.items()},
        "bounds": speed_bounds(model, config, extra) if config.model_type == "linearize" else None,
        "quality": conversion_quality(stages),
        "note": vision_language_note(path) if path is not None else None,
    }


def describe_converted(la: dict, stage2: dict | None = None) -> str:
    """One line on what the converted layers compute, e.g. ``linear attention, hedgehog maps, 64-token window
    (layers 0-19: 512), 16 sinks, learned decay``, ``..., 512-token window (trained at 64), ...``, ``...,
    4096-token window (trained at 64, stage 2 at the served width)`` or ``gated delta rule``. ``stage2``: the
    conversion report's stage 2 (its ``train_window``, the width stage 2 ran every windowed layer at; None: each
    layer's own), when it differs from the layers' ``train_window``."""
    if la.get("layer_type") == GATED_DELTA:
        return "gated delta rule" + (", output gate" if la.get("delta_output_gate") else "")
    parts = ["linear attention", f"{la.get('feature_map', 'hedgehog')} maps"]
    if la.get("window"):
        notes = [f"layers {k}: {w}" for k, w in (la.get("layer_windows") or {}).items()]
        own = la.get("train_window") or None  # None: trained at the served widths
        if own:
            notes.append(f"trained at {own}")
        fitted = (stage2 or {}).get("train_window", own)
        if fitted != own:
            notes.append(f"stage 2 at {fitted}" if fitted else "stage 2 at the served width")
        parts.append(f"{la['window']}-token window" + (f" ({', '.join(notes)})" if notes else ""))
    if la.get("sinks"):
        parts.append(f"{la['sinks']} sinks")
    if (la.get("decay") or "none") != "none":
        parts.append(f"{la['decay']} decay")
    return ", ".join(parts)


def describe_sliding(windows: list[int | None]) -> str | None:
    """One line on the original's sliding-window layers (None when no layer slides), e.g. ``22 of 26 layers
    slide over 512 tokens; full attention in 5, 11, 17, 23``: the layers whose KV cache grows with the context."""
    sliding = [w for w in windows if w]
    if not sliding:
        return None
    sizes = "/".join(str(w) for w in sorted(set(sliding)))
    full = [i for i, w in enumerate(windows) if not w]
    rest = f"; full attention in {', '.join(map(str, full))}" if full else ""
    return f"{len(sliding)} of {len(windows)} layers slide over {sizes} tokens in the original{rest}"


def speed_bounds(model, config, extra_parameters: int) -> dict[str, dict[str, float]]:
    """Per context, batch 1, bf16 weights and KV: the speed-ups a hybrid's layout allows over its original at
    equal efficiency (``bench model``'s bounds): ``prefill`` from FLOPs per token, ``decode`` from the bytes a
    step reads (weights + cache). The original: the same shapes with every layer softmax, without the
    parameters conversion adds."""
    # start-up time: torch and transformers, only for a hybrid's bounds
    from ..model.cache import softmax_windows

    # start-up time: torch and transformers, only for a hybrid's bounds
    from .costs import cache_bytes, cost_model, speedup_bounds

    hybrid = cost_model(model)
    dtype_bytes = 2
    to_bf16 = dtype_bytes / next(model.parameters()).element_size()
    weights_h = int(hybrid["decode_weight_bytes"] * to_bf16)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    hybrid = {**hybrid, "decode_weight_bytes": weights_h, "expert_bytes": int(hybrid["expert_bytes"] * to_bf16)}
    windows = softmax_windows(config)  # the original's sliding layers
    original = {**hybrid, "matmul_flops_per_token": hybrid["matmul_flops_per_token"] - 2 * extra_parameters,
                "attention_flops_per_token_per_T": 2 * windows.count(None) * heads * head_dim,
                "sliding_windows": [w for w in windows if w],
                "decode_weight_bytes": weights_h - extra_parameters * dtype_bytes}
    out = {}
    for name, n in CONTEXTS.items():
        cache = cache_bytes(config, n, dtype_bytes=dtype_bytes)
        prefill, decode = speedup_bounds(hybrid, original, n, cache["hybrid"], cache["original"])
        out[name] = {"prefill": prefill, "decode": decode}
    return out


def report_stages(path) -> dict[str, Any]:
    """The ``stages`` of a hybrid's ``report.json`` (empty without the file or a path)."""
    if path is None:
        return {}
    try:
        stages = json.loads((Path(path) / "report.json").read_text()).get("stages") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    return stages if isinstance(stages, dict) else {}


def conversion_quality(stages: dict[str, Any]) -> dict[str, Any]:
    """From a hybrid's report stages (:func:`report_stages`): held-out perplexity vs the teacher (stage 2), the
    recall check (copy and passkey, teacher vs hybrid) and ``--select auto``'s boundary; empty for other directories
    or untrained hybrids."""
    out: dict[str, Any] = {}
    ft = stages.get("finetune") or {}
    if "heldout_ppl_end" in ft and ft.get("heldout_ppl_teacher"):
        out["ppl"] = {"hybrid": ft["heldout_ppl_end"], "teacher": ft["heldout_ppl_teacher"],
                      "seq_len": ft.get("seq_len")}
    rc = stages.get("recall") or {}
    if "hybrid" in rc:
        out["copy"] = {k: rc[k] for k in ("hybrid", "teacher", "length", "samples")}
        if "hybrid" in (rc.get("passkey") or {}):
            out["passkey"] = {k: rc["passkey"][k] for k in ("hybrid", "teacher", "length", "prompts", "better",
                                                            "worse", "p") if k in rc["passkey"]}
    sel = stages.get("select") or {}
    if sel.get("boundary") or any(sel.get(k) for k in SEAT_FIELDS):  # --select auto: how clear the choice was
        out["select"] = {"softmax_layers": sel["softmax_layers"], "boundary": sel.get("boundary"),
                         **{k: sel.get(k) or "" for k in SEAT_FIELDS},
                         "swaps": [r for r in (sel.get("swap_check") or {}).get("rounds", []) if r["kept"]]}
    return out


def retrieval_layers(spec: str, lengths: list[int], *, prompts: int = 5, dtype: str | None = None,
                     device: str | None = None) -> dict[str, Any]:
    """Per layer of an original (not converted) model: its attention from the answer position onto the pass key
    (max over heads, mean over ``prompts`` passkey prompts per length at depths 0..1) -- the probe's
    ``attention`` term (:func:`linearize.convert.probe.retrieval_attention`). High values mark the layers that
    retrieve."""
    # start-up time: torch and transformers, only for --retrieval
    from .. import recipe as recipes
    from ..convert import probe

    config_type = model_info(spec)["layer_types"]
    if config_type is not None and "linear_attention" in config_type:
        raise SelectionError(f"{spec} is a converted hybrid; --retrieval measures an original model: pass its spec")
    model, tokenizer = load_model(spec, dtype=dtype, device=device)
    out: dict[str, Any] = {"prompts": prompts, "by_length": {}}
    for n in lengths:
        rec = recipes.load(DEFAULT_RECIPE, {"select.retrieval_length": n, "select.retrieval_prompts": prompts})
        samples = probe.retrieval_samples(tokenizer, rec, getattr(model.config, "max_position_embeddings", None))
        with probe.all_linear(model, rec) as hybrid:  # softmax mode = the original attention, hooked per layer
            out["by_length"][str(n)] = probe.retrieval_attention(hybrid, samples)
    return out

"""Recipes: YAML files that say how a model is linearized and trained.

A recipe is loaded from ``recipes/NAME.yaml`` (shipped as package data) or a path, merged with CLI
overrides (``section.field=value``) and validated against :data:`SCHEMA`. Every error names the
field, the value and what is allowed.
"""

from __future__ import annotations

import copy
import difflib
import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from .data.checks import check_text_files
from .data.mixture import mixture_text
from .errors import DataError, RecipeError
from .model.layout import CONVERTED, GATED_DELTA, LINEAR, parse_layer_windows, training_width, widest_window
from .settings import DEFAULT_RECIPE
from .units import parse_tokens


@dataclass(frozen=True)
class Field:
    """One recipe field: its type, default, check and the text that describes what is allowed."""

    type: type | tuple[type, ...]
    default: Any
    allowed: str
    check: Callable[[Any], bool] = lambda v: True
    nullable: bool = False


def _positive_tokens(v) -> bool:
    try:
        return parse_tokens(v) > 0
    except ValueError:
        return False


def _feature_map_names() -> list[str]:
    # start-up time: the feature maps import torch; recipes are read before any model loads
    from .model.feature_maps import FEATURE_MAPS

    return sorted(FEATURE_MAPS)


def _training_fields(lr: float) -> dict[str, Field]:
    """Data, budget and optimizer fields shared by the training stages."""
    return {
        "data": Field(str, "wiki", "a data spec: wiki, a named corpus (books, code, docs, dialogue, chat, legal, c), a .txt/.jsonl file or folder, "
                      "hf:NAME[:CONFIG][:SPLIT], or a mixture SPEC:WEIGHT,SPEC:WEIGHT (or a list of {data, weight})"),
        "tokens": Field((str, int), "2M", "a token budget > 0 such as 256K, 20M, 1B", _positive_tokens),
        "seq_len": Field(int, 512, "an integer in [16, 65536]", lambda v: 16 <= v <= 65536),
        # row lengths to train at, one drawn per optimizer step (linearize.train.loop.step_length): each step's
        # seq_len rows are cut into rows of that length, the same tokens; [] = seq_len throughout
        "lengths": Field(list, [], "a list of row lengths, each an integer in [16, 65536] that divides seq_len "
                         "([] = seq_len)", lambda v: all(type(n) is int and 16 <= n <= 65536 for n in v)),
        "batch_size": Field(int, 4, "an integer in [1, 4096]", lambda v: 1 <= v <= 4096),
        "grad_accum": Field(int, 1, "an integer in [1, 1024]", lambda v: 1 <= v <= 1024),
        # share of training rows given a long-range exact copy (linearize.data.augment.copy_augment); held-out
        # rows never
        "copy_fraction": Field(float, 0.0, "a number in [0, 1] (0 = off)", lambda v: 0.0 <= v <= 1.0),
        "lr": Field(float, lr, "a number in (0, 1]", lambda v: 0.0 < v <= 1.0),
        "weight_decay": Field(float, 0.0, "a number in [0, 1]", lambda v: 0.0 <= v <= 1.0),
        "warmup_steps": Field(int, 10, "an integer in [0, 100000]", lambda v: 0 <= v <= 100000),
        "min_lr_ratio": Field(float, 0.1, "a number in [0, 1]", lambda v: 0.0 <= v <= 1.0),
    }


def _valid_layer_windows(v: dict) -> bool:
    try:
        parse_layer_windows(v)
    except ValueError:
        return False
    return True


#: the default ``max_loss_ratio`` of both training stages (the exploding-loss check's factor)
MAX_LOSS_RATIO = 100.0


def _run_fields() -> dict[str, Field]:
    """Evaluation, checkpointing, loss-guard and seed fields shared by the training stages."""
    return {
        "eval_seqs": Field(int, 8, "an integer in [1, 4096]", lambda v: 1 <= v <= 4096),
        "checkpoint_every": Field(int, 50, "an integer in [1, 1000000] (optimizer steps)", lambda v: 1 <= v <= 1_000_000),
        # a micro-batch loss above this multiple of its running mean stops the run (linearize.train.guards)
        "max_loss_ratio": Field(float, MAX_LOSS_RATIO, "a number >= 0 (0 = no exploding-loss check)", lambda v: v >= 0),
        "seed": Field(int, 0, "an integer >= 0", lambda v: v >= 0),
    }


#: section -> field -> Field. Adding a field is one line here plus a comment in each recipe.
SCHEMA: dict[str, dict[str, Field]] = {
    "": {
        "name": Field(str, "custom", "a string"),
        "description": Field(str, "", "a string"),
    },
    "attention": {
        "feature_map": Field(str, "hedgehog", "a registered feature map", lambda v: v in _feature_map_names()),
        "feature_dim": Field(int, None, "an integer in [1, 1024] or null (the map's default)",
                             lambda v: 1 <= v <= 1024, nullable=True),
        "window": Field(int, 64, "an integer in [0, 4096] (0 = no sliding window)", lambda v: 0 <= v <= 4096),
        # other widths for some layers: {"0-19": 512, 24: 64} (a layer or an inclusive range -> tokens); the rest
        # keep window (model.layout.layer_window)
        "layer_windows": Field(dict, {}, "a mapping of layers (24, or a range like 0-19) to window widths in "
                               "[1, 4096]", _valid_layer_windows),
        # the width every windowed layer trains at (probe, stage 1, stage 2), served at its own afterwards; 0 = its
        # own (model.layout.training_width)
        "train_window": Field(int, 0, "an integer in [0, 4096] (0 = each layer's own window)",
                              lambda v: 0 <= v <= 4096),
        "window_init": Field(float, 0.1, "a number in (0, 1)", lambda v: 0.0 < v < 1.0),
        "sinks": Field(int, 0, "an integer in [0, 256] (0 = none; needs a window)", lambda v: 0 <= v <= 256),
        "eps": Field(float, 1e-6, "a number in (0, 0.1]", lambda v: 0.0 < v <= 0.1),
        "decay": Field(str, "none", "none or learned", lambda v: v in ("none", "learned")),
        "decay_half_life": Field(float, 16384.0, "a number of tokens in [1, 1e9]", lambda v: 1.0 <= v <= 1e9),
        # what the converted layers compute: linear attention with feature maps, or the gated delta rule
        # (linearize/model/delta_attention.py; the feature-map and window fields do not apply to it)
        "layer_type": Field(str, LINEAR, f"one of {', '.join(CONVERTED)}", lambda v: v in CONVERTED),
        "delta_beta_init": Field(float, 0.5, "a number in (0, 1)", lambda v: 0.0 < v < 1.0),
        "delta_q_scale": Field(float, 1.0, "a number in (0, 64]", lambda v: 0.0 < v <= 64.0),
        "delta_qk_map": Field(bool, False, "true or false"),
        "delta_output_gate": Field(bool, False, "true or false"),
    },
    "distill": {
        **_training_fields(lr=1e-2),
        "mse_weight": Field(float, 1.0, "a number in [0, 1000]", lambda v: 0.0 <= v <= 1000.0),
        "xent_weight": Field(float, 0.0, "a number in [0, 1000] (0 = off)", lambda v: 0.0 <= v <= 1000.0),
        "xent_rows": Field(int, 64, "an integer in [1, 4096]", lambda v: 1 <= v <= 4096),
        # sliding windows to train at, one drawn per optimizer step (linearize.train.distill.step_window); [] =
        # attention.window throughout
        "windows": Field(list, [], "a list of window widths, each an integer in [1, 4096] ([] = attention.window)",
                         lambda v: all(type(w) is int and 1 <= w <= 4096 for w in v)),
        **_run_fields(),
    },
    "finetune": {
        **_training_fields(lr=1e-4),
        "lora_r": Field(int, 8, "an integer in [1, 1024]", lambda v: 1 <= v <= 1024),
        "lora_alpha": Field(float, 16.0, "a number in (0, 4096]", lambda v: 0 < v <= 4096),
        "lora_dropout": Field(float, 0.0, "a number in [0, 1)", lambda v: 0.0 <= v < 1.0),
        "targets": Field(list, ["q_proj", "k_proj", "v_proj", "o_proj"],
                         "a non-empty list drawn from q_proj, k_proj, v_proj, o_proj",
                         lambda v: bool(v) and all(t in ("q_proj", "k_proj", "v_proj", "o_proj") for t in v)),
        # which layers' attention projections get adapters: the linearized ones (LoLCATs) or every layer, so the
        # kept softmax layers can adapt to the new residual stream too
        "layers": Field(str, "linear", "linear (the linearized layers) or all (every attention layer)",
                        lambda v: v in ("linear", "all")),
        # the width stage 2 trains the windowed layers at, when it differs from attention.train_window (which the
        # probe and stage 1 keep): null = attention.train_window, 0 = each layer's served window, N = N tokens
        "train_window": Field(int, None, "an integer in [0, 4096] or null (attention.train_window; 0 = the served "
                              "windows)", lambda v: 0 <= v <= 4096, nullable=True),
        "loss": Field(str, "xent", "xent (next-token cross-entropy) or kl (KL to the teacher's logits)",
                      lambda v: v in ("xent", "kl")),
        # decoder layers recompute their forward in the backward (linearize.train.memory turns it on under auto)
        "activation_checkpointing": Field((bool, str), "auto", "auto (on when one row does not fit), true or false",
                                          lambda v: v is True or v is False or v == "auto"),
        **_run_fields(),
    },
    "select": {  # --select auto: the probe (linearize/convert/probe.py)
        # what convert does without --select: interleave, or auto where it can run and pays (training, not --fsdp,
        # a layer count to choose, a budget the probe fits, no more scoring than training tokens:
        # pipeline.plan_recipe_auto; otherwise interleave)
        "method": Field(str, "interleave", "interleave or auto", lambda v: v in ("interleave", "auto")),
        "probe_fraction": Field(float, 0.1, "a number in (0, 0.25] (share of the stage-1 token budget)",
                                lambda v: 0.0 < v <= 0.25),
        "mse_weight": Field(float, 1.0, "a number in [0, 1000]", lambda v: 0.0 <= v <= 1000.0),
        "loss_weight": Field(float, 1.0, "a number in [0, 1000]", lambda v: 0.0 <= v <= 1000.0),
        "retrieval_weight": Field(float, 1.0, "a number in [0, 1000] (0 = no retrieval probe)",
                                  lambda v: 0.0 <= v <= 1000.0),
        "attention_weight": Field(float, 2.0, "a number in [0, 1000] (0 = not a score term)",
                                  lambda v: 0.0 <= v <= 1000.0),
        # softmax seats kept for the layers the original retrieves with (probe.retrieval_attention), whatever their
        # score and never swapped out: ceil(share x softmax layers)
        "retrieval_seats": Field(float, 0.5, "a number in [0, 1] (share of the softmax layers; 0 = none)",
                                 lambda v: 0.0 <= v <= 1.0),
        # and for the layers whose linearization alone raises the passkey answer loss most (the probe's retrieval
        # term): ceil(share x softmax layers) more, after those (convert.selection.SEAT_KINDS)
        "ablation_seats": Field(float, 0.25, "a number in [0, 1] (share of the softmax layers; 0 = none)",
                                lambda v: 0.0 <= v <= 1.0),
        # and for the layers whose linearization alone raises the held-out loss most (the probe's loss term)
        "loss_seats": Field(float, 0.25, "a number in [0, 1] (share of the softmax layers; 0 = none)",
                            lambda v: 0.0 <= v <= 1.0),
        "retrieval_length": Field(int, 2048, "an integer in [64, 1048576] (tokens)", lambda v: 64 <= v <= 1048576),
        "retrieval_prompts": Field(int, 4, "an integer in [1, 256]", lambda v: 1 <= v <= 256),
        "seed": Field(int, 1, "an integer >= 0", lambda v: v >= 0),
        # joint check of the choice on the probe's hybrid (linearize.convert.probe.swap_check): rounds of trying to
        # swap one of the swap_pool lowest-scoring kept layers for one of the swap_pool highest-scoring dropped ones
        "swap_rounds": Field(int, 2, "an integer in [0, 8] (0 = no swap check)", lambda v: 0 <= v <= 8),
        "swap_pool": Field(int, 4, "an integer in [1, 16]", lambda v: 1 <= v <= 16),
    },
}

#: keys that carry metadata written by linearize itself (ignored on load)
METADATA_KEYS = {"resolved"}
RESOLVED_MARKER = "\n# --- written by linearize: the values actually used ---\n"


@dataclass
class Recipe:
    """A validated recipe. ``values`` is ``{section: {field: value}}`` with ``""`` for top-level fields."""

    values: dict[str, dict[str, Any]]
    source_text: str = ""
    source: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, section: str) -> dict[str, Any]:
        return self.values[section]

    @property
    def name(self) -> str:
        return self.values[""]["name"]

    def to_dict(self) -> dict[str, Any]:
        """Nested dict as it would be written in YAML."""
        out: dict[str, Any] = dict(self.values[""])
        for section, vals in self.values.items():
            if section:
                out[section] = dict(vals)
        return out

    def with_overrides(self, overrides: dict[str, Any]) -> "Recipe":
        """A copy with ``{"section.field": value}`` applied and validated."""
        raw = self.to_dict()
        for key, value in overrides.items():
            section, _, name = key.rpartition(".")
            if section in SCHEMA:  # a bad override is named as the user wrote it, not as the recipe file's
                _check(section, name, value, "--set: ")
            target = raw.setdefault(section, {}) if section else raw
            if not isinstance(target, dict):
                raise RecipeError(f"recipe override {key}: {section!r} is not a section")
            target[name] = value
        if "attention.window" in overrides and "attention.train_window" not in overrides \
                and isinstance(raw.get("attention"), dict):
            raw["attention"]["train_window"] = 0  # a window given alone is trained at as well as served at
        merged = validate(raw, source=self.source)
        merged.source_text = self.source_text
        merged.overrides = {**self.overrides, **overrides}
        return merged


def recipes_dir() -> Path:
    """The folder of shipped recipes (package data)."""
    return Path(str(importlib.resources.files("linearize.recipes")))


def available() -> list[str]:
    """Names of the shipped recipes."""
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def find(name_or_path: str) -> Path:
    """Locate a recipe by name (shipped) or path."""
    p = Path(name_or_path).expanduser()
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise RecipeError(f"recipe file not found: {name_or_path}")
        return p
    shipped = recipes_dir() / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    raise RecipeError(f"unknown recipe {name_or_path!r}: expected one of {', '.join(available())} or a .yaml path")


def load(name_or_path: str = DEFAULT_RECIPE, overrides: dict[str, Any] | None = None) -> Recipe:
    """Load, merge overrides and validate a recipe."""
    path = find(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(f"recipe {path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise RecipeError(f"recipe {path}: cannot read it ({e.strerror})") from None
    try:
        raw = yaml.safe_load(text) or {}
        lines = _line_map(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise RecipeError(f"recipe {path}{where}: invalid YAML ({problem})") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe {path} line {lines.get('', 1)}: expected a mapping of sections and fields at the "
                          f"top level, got {type(raw).__name__} {_short(raw)}")
    recipe = validate(raw, source=str(path), lines=lines)
    # a checkpoint's copy ends in a ``resolved:`` block: rerunning a stage starts from the values as run
    # (the conversion's --set overrides), and the file text stays the recipe's own
    recipe.source_text = text.split(RESOLVED_MARKER, 1)[0]
    resolved = raw.get("resolved") if isinstance(raw.get("resolved"), dict) else {}
    merged = {**(resolved.get("overrides") or {}), **(overrides or {})}
    return recipe.with_overrides(merged) if merged else recipe


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``section.field=value`` (value read as YAML: numbers, null, true/false, strings)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"--set {text!r}: expected section.field=value, e.g. attention.window=32")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


def check_layer_overrides(overrides: dict[str, Any], command: str) -> None:
    """Refuse overrides outside ``attention.*`` for ``command``, which builds untrained layers (``bench model``,
    ``info``): no other section changes what it shows."""
    for key in overrides:
        if not key.startswith("attention."):
            raise RecipeError(f"--set {key}: {command} builds untrained layers, so only attention.* fields change "
                              f"what it shows")


def validate(raw: dict[str, Any], *, source: str = "", lines: dict[str, int] | None = None) -> Recipe:
    """Check every field against :data:`SCHEMA`; fill defaults. ``lines`` (``"section.field"`` -> line
    number in the source file) puts the line into error messages."""
    lines = lines or {}

    def where(key: str = "") -> str:
        line = lines.get(key)
        return f"recipe {source}{f' line {line}' if line else ''}: " if source else "recipe: "

    values: dict[str, dict[str, Any]] = {s: {k: copy.deepcopy(f.default) for k, f in fs.items()} for s, fs in SCHEMA.items()}
    for key, val in raw.items():
        key = str(key)
        if key in METADATA_KEYS:
            continue
        if key in SCHEMA and key:
            if not isinstance(val, dict):
                raise RecipeError(f"{where(key)}{key} must be a mapping of fields, got {_short(val)}")
            for fname, fval in val.items():
                values[key][str(fname)] = _check(key, str(fname), fval, where(f"{key}.{fname}"))
        elif key in SCHEMA[""]:
            values[""][key] = _check("", key, val, where(key))
        else:
            allowed = sorted([k for k in SCHEMA if k] + list(SCHEMA[""]))
            hint = _did_you_mean("", key)
            raise RecipeError(f"{where(key)}unknown field {key!r}; " + (f"{hint} (a field belongs under its section)"
                                                                        if hint else f"allowed: {', '.join(allowed)}"))
    _check_layer_type(values, where)
    return Recipe(values=values, source=source)


def _check_layer_type(values: dict[str, dict[str, Any]], where: Callable[[str], str]) -> None:
    """Fields that mean nothing to their layers are refused rather than ignored: sinks without a sliding window; for
    gated delta layers the sliding window (they have none) and Hedgehog's attention-weight loss (no attention
    weights)."""
    att = values["attention"]
    if values["distill"]["windows"] and not att["window"]:
        raise RecipeError(f"{where('distill.windows')}distill.windows = {values['distill']['windows']}: the layers "
                          f"have no sliding window to vary (attention.window is 0); set distill.windows=[]")
    if att["layer_windows"] and not att["window"]:
        raise RecipeError(f"{where('attention.layer_windows')}attention.layer_windows = {att['layer_windows']}: "
                          f"attention.window is 0, so the layers have no window to widen or narrow; set a window "
                          f"or attention.layer_windows={{}}")
    if att["train_window"] and not att["window"]:
        raise RecipeError(f"{where('attention.train_window')}attention.train_window = {att['train_window']}: "
                          f"attention.window is 0, so the layers have no window to train narrower or wider; set a "
                          f"window or attention.train_window=0")
    if values["finetune"]["train_window"] is not None and not att["window"]:
        raise RecipeError(f"{where('finetune.train_window')}finetune.train_window = "
                          f"{values['finetune']['train_window']}: attention.window is 0, so the layers have no window "
                          f"to train at; set a window or finetune.train_window=null")
    if att["layer_windows"] and values["distill"]["windows"]:
        raise RecipeError(f"{where('distill.windows')}distill.windows = {values['distill']['windows']} draws one "
                          f"width for every layer, and attention.layer_windows gives layers their own; set one of "
                          f"them to [] / {{}}")
    if att["sinks"] and not att["window"]:
        raise RecipeError(f"{where('attention.sinks')}attention.sinks = {att['sinks']}: sinks join the sliding "
                          f"window's exact softmax, and attention.window is 0; set a window or attention.sinks=0")
    if att["layer_type"] != GATED_DELTA:
        return
    if att["window"]:
        raise RecipeError(f"{where('attention.window')}attention.window = {att['window']}: gated_delta layers "
                          f"(attention.layer_type) have no sliding window; set attention.window=0")
    if values["distill"]["xent_weight"] > 0:
        raise RecipeError(f"{where('distill.xent_weight')}distill.xent_weight = {values['distill']['xent_weight']}: "
                          f"gated_delta layers (attention.layer_type) have no attention weights to match; set "
                          f"distill.xent_weight=0")


def _line_map(text: str) -> dict[str, int]:
    """``{"": first line, "section": line, "section.field": line}`` for a YAML recipe text (1-based)."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if node is None:
        return {}
    out = {"": node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = str(k.value)
            out[key] = k.start_mark.line + 1
            if isinstance(v, yaml.MappingNode):
                for k2, _ in v.value:
                    out[f"{key}.{k2.value}"] = k2.start_mark.line + 1
    return out


def _short(value: Any, limit: int = 60) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_training(recipe: Recipe, stages: dict[str, Any], *, window: int | None = None) -> None:
    """Combinations that only matter when ``stages`` train (checked before any model is loaded).

    ``stages`` maps ``"distill"`` / ``"finetune"`` to that stage's token budget (None = the recipe's);
    ``window`` is the model's sliding window when it differs from the recipe's (a hybrid checkpoint); the layers
    train at the stage's training width instead when one is set (:func:`~linearize.model.layout.training_width`).
    Refuses a window that covers the whole training sequence (the linear part would never see a
    token), a budget smaller than one batch (distill) or one optimizer step (finetune), and a data
    spec that does not resolve or holds no text (:func:`linearize.data.checks.check_text_files`).
    """
    for stage, tokens in stages.items():
        cfg = recipe[stage]
        trained = training_width(recipe["attention"], cfg)
        win = trained or (widest_window(recipe["attention"]) if window is None else window)
        if not trained:
            name = "attention.window"
        else:
            name = f"{stage}.train_window" if cfg.get("train_window") else "attention.train_window"
        seq = cfg["seq_len"]
        if win and win >= seq:
            raise RecipeError(f"{name} = {win} is not shorter than {stage}.seq_len = {seq}: the window "
                              f"would cover every training sequence, so the linear part would never see a token; "
                              f"use --set {stage}.seq_len={max(2 * win, 64)} or a smaller window")
        odd = [n for n in cfg["lengths"] if seq % n]
        if odd:
            raise RecipeError(f"{stage}.lengths holds {odd[0]}, which does not divide {stage}.seq_len = {seq}: each "
                              f"step cuts its rows into rows of a drawn length; use divisors of {seq}")
        short = [n for n in cfg["lengths"] if win and win >= n]
        if short:
            raise RecipeError(f"{stage}.lengths holds {short[0]}, not longer than {name} = {win}: rows that "
                              f"short would never reach the linear part; use longer rows or a smaller window")
        wide = [w for w in cfg.get("windows", ()) if w >= seq]  # distill only
        if win and wide:
            raise RecipeError(f"{stage}.windows holds {wide[0]}, not shorter than {stage}.seq_len = {seq}: at that "
                              f"width the linear part would never see a token; use smaller windows")
        budget = parse_tokens(tokens if tokens is not None else cfg["tokens"])
        accum = cfg["grad_accum"] if stage == "finetune" else 1  # distill runs at least one (partial) step
        need = cfg["batch_size"] * seq * accum
        if budget < need:
            what = "one optimizer step" if stage == "finetune" else "one batch"
            parts = f"batch_size {cfg['batch_size']} x seq_len {seq}" + (f" x grad_accum {accum}" if accum > 1 else "")
            raise RecipeError(f"{stage}: {budget:,} tokens is smaller than {what} ({parts} = {need:,} tokens); raise "
                              f"the token budget or lower {stage}.batch_size / {stage}.seq_len")
        check_text_files(cfg["data"], field=f"{stage}.data")  # exists, not binary, not empty: no tokenizer needed


def _did_you_mean(section: str, name: str) -> str:
    """``did you mean distill.lr or finetune.lr?`` for a field given without its section (every ``section.field``
    with that name, else those closest to it) or misspelt inside one; ``""`` when nothing is close."""
    def close(fields) -> list[str]:
        return difflib.get_close_matches(name, list(fields), n=3)

    if section:
        names = [f"{section}.{f}" for f in close(SCHEMA[section])]
    else:
        names = [f"{s}.{name}" for s in SCHEMA if s and name in SCHEMA[s]] or [
            f"{s}.{f}" for s, fields in SCHEMA.items() if s for f in fields if close([f])][:3]
    if not names:
        return ""
    return "did you mean " + (" or ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} or {names[-1]}") + "?"


def _check(section: str, name: str, value: Any, where: str) -> Any:
    fields = SCHEMA[section]
    full = f"{section}.{name}" if section else name
    if name not in fields:
        hint = _did_you_mean(section, name)
        if hint and not section:  # a field without its section: its section.field spellings are the answer
            raise RecipeError(f"{where}unknown field {full!r} (a field is written section.field); {hint}")
        raise RecipeError(f"{where}unknown field {full!r}; {hint + ' ' if hint else ''}allowed in "
                          f"{section or 'top level'}: {', '.join(sorted(fields))}")
    f = fields[name]
    if name == "data" and isinstance(value, list):  # a YAML list of {data, weight}: its one-line mixture form
        try:
            value = mixture_text(value)
        except DataError as e:
            raise RecipeError(f"{where}{full}: {e}") from None
    if value is None:
        if f.nullable:
            return None
        raise RecipeError(f"{where}{full} = null: must be {f.allowed}")
    types = f.type if isinstance(f.type, tuple) else (f.type,)
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, str) and float in types:
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise RecipeError(f"{where}{full} = {value!r}: must be {f.allowed}")
    if not f.check(value):
        if name == "feature_map":
            raise RecipeError(f"{where}{full} = {value!r}: must be one of {', '.join(_feature_map_names())}")
        raise RecipeError(f"{where}{full} = {value!r}: must be {f.allowed}")
    if isinstance(value, dict):  # string keys, as config.json holds them (YAML reads 24 as an int, 0-19 as a string)
        value = {str(k).strip(): v for k, v in value.items()}
    return value


def resolved_yaml(recipe: Recipe, extra: dict[str, Any]) -> str:
    """The recipe text as run, byte for byte, followed by a ``resolved:`` block (valid YAML)."""
    text = recipe.source_text
    if text and not text.endswith("\n"):
        text += "\n"
    block = {"resolved": {"recipe": recipe.to_dict(), "overrides": recipe.overrides, **extra}}
    return text + RESOLVED_MARKER + yaml.safe_dump(block, sort_keys=False)

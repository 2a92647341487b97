"""Recipes: YAML files that say how a model is linearized and trained.

A recipe is loaded from ``recipes/NAME.yaml`` (shipped as package data) or a path, merged with CLI
overrides (``section.field=value``) and validated against :data:`SCHEMA`. Every error names the
field, the value and what is allowed.
"""

from __future__ import annotations

import copy
import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from .errors import RecipeError


@dataclass(frozen=True)
class Field:
    """One recipe field: its type, default, check and the text that describes what is allowed."""

    type: type | tuple[type, ...]
    default: Any
    allowed: str
    check: Callable[[Any], bool] = lambda v: True
    nullable: bool = False


def _positive_tokens(v) -> bool:
    from .data import parse_tokens

    try:
        return parse_tokens(v) > 0
    except ValueError:
        return False


def _feature_map_names() -> list[str]:
    from .feature_maps import FEATURE_MAPS

    return sorted(FEATURE_MAPS)


def _training_fields(lr: float) -> dict[str, Field]:
    """Data, budget and optimizer fields shared by the training stages."""
    return {
        "data": Field(str, "wiki", "a data spec: wiki, a .txt/.jsonl file or folder, hf:NAME[:CONFIG][:SPLIT]"),
        "tokens": Field((str, int), "2M", "a token budget > 0 such as 256K, 20M, 1B", _positive_tokens),
        "seq_len": Field(int, 512, "an integer in [16, 65536]", lambda v: 16 <= v <= 65536),
        "batch_size": Field(int, 4, "an integer in [1, 4096]", lambda v: 1 <= v <= 4096),
        "grad_accum": Field(int, 1, "an integer in [1, 1024]", lambda v: 1 <= v <= 1024),
        "lr": Field(float, lr, "a number in (0, 1]", lambda v: 0.0 < v <= 1.0),
        "weight_decay": Field(float, 0.0, "a number in [0, 1]", lambda v: 0.0 <= v <= 1.0),
        "warmup_steps": Field(int, 10, "an integer in [0, 100000]", lambda v: 0 <= v <= 100000),
        "min_lr_ratio": Field(float, 0.1, "a number in [0, 1]", lambda v: 0.0 <= v <= 1.0),
    }


def _run_fields() -> dict[str, Field]:
    """Evaluation, checkpointing and seed fields shared by the training stages."""
    return {
        "eval_seqs": Field(int, 8, "an integer in [1, 4096]", lambda v: 1 <= v <= 4096),
        "checkpoint_every": Field(int, 50, "an integer in [1, 1000000] (optimizer steps)", lambda v: 1 <= v <= 1_000_000),
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
        "window_init": Field(float, 0.1, "a number in (0, 1)", lambda v: 0.0 < v < 1.0),
        "eps": Field(float, 1e-6, "a number in (0, 0.1]", lambda v: 0.0 < v <= 0.1),
    },
    "distill": {
        **_training_fields(lr=1e-2),
        "mse_weight": Field(float, 1.0, "a number in [0, 1000]", lambda v: 0.0 <= v <= 1000.0),
        "xent_weight": Field(float, 0.0, "a number in [0, 1000] (0 = off)", lambda v: 0.0 <= v <= 1000.0),
        "xent_rows": Field(int, 64, "an integer in [1, 4096]", lambda v: 1 <= v <= 4096),
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
        "loss": Field(str, "xent", "xent (next-token cross-entropy) or kl (KL to the teacher's logits)",
                      lambda v: v in ("xent", "kl")),
        **_run_fields(),
    },
}

#: keys that carry metadata written by linearize itself (ignored on load)
METADATA_KEYS = {"resolved"}


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
            target = raw.setdefault(section, {}) if section else raw
            if not isinstance(target, dict):
                raise RecipeError(f"recipe override {key}: {section!r} is not a section")
            target[name] = value
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


def load(name_or_path: str = "lolcats", overrides: dict[str, Any] | None = None) -> Recipe:
    """Load, merge overrides and validate a recipe."""
    path = find(name_or_path)
    text = path.read_text()
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"recipe {path}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe {path}: expected a mapping at the top level")
    recipe = validate(raw, source=str(path))
    recipe.source_text = text
    return recipe.with_overrides(overrides) if overrides else recipe


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


def validate(raw: dict[str, Any], *, source: str = "") -> Recipe:
    """Check every field against :data:`SCHEMA`; fill defaults."""
    where = f"recipe {source}: " if source else "recipe: "
    values: dict[str, dict[str, Any]] = {s: {k: copy.deepcopy(f.default) for k, f in fs.items()} for s, fs in SCHEMA.items()}
    for key, val in raw.items():
        if key in METADATA_KEYS:
            continue
        if key in SCHEMA and key:
            if not isinstance(val, dict):
                raise RecipeError(f"{where}{key} must be a mapping of fields, got {val!r}")
            for fname, fval in val.items():
                values[key][fname] = _check(key, fname, fval, where)
        elif key in SCHEMA[""]:
            values[""][key] = _check("", key, val, where)
        else:
            allowed = sorted([k for k in SCHEMA if k] + list(SCHEMA[""]))
            raise RecipeError(f"{where}unknown field {key!r}; allowed: {', '.join(allowed)}")
    return Recipe(values=values, source=source)


def _check(section: str, name: str, value: Any, where: str) -> Any:
    fields = SCHEMA[section]
    full = f"{section}.{name}" if section else name
    if name not in fields:
        raise RecipeError(f"{where}unknown field {full!r}; allowed in {section or 'top level'}: {', '.join(sorted(fields))}")
    f = fields[name]
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
    return value


def resolved_yaml(recipe: Recipe, extra: dict[str, Any]) -> str:
    """The recipe text as run, byte for byte, followed by a ``resolved:`` block (valid YAML)."""
    text = recipe.source_text
    if text and not text.endswith("\n"):
        text += "\n"
    block = {"resolved": {"recipe": recipe.to_dict(), "overrides": recipe.overrides, **extra}}
    return text + "\n# --- written by linearize: the values actually used ---\n" + yaml.safe_dump(block, sort_keys=False)

"""Apply a recipe to a loaded model: swap attention modules and record the layout in the config."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from ..errors import RecipeError, UnsupportedModelError
from ..io.sources import read_config
from ..model.architectures import arch_spec, not_causal_reason, not_supported_reason, supported_types, text_part
from ..model.layout import LINEAR, parse_layer_windows
from ..model.modeling import LinearizeConfig, LinearizeForCausalLM
from ..recipe import Recipe


def check_config_supported(config, spec: str | None = None) -> str:
    """The base ``model_type`` of a config (a vision-language model's: its text decoder's, see
    :data:`~linearize.model.architectures.FAMILIES`), or a one-line :class:`UnsupportedModelError` (no weights needed)."""
    name = f"{spec}: " if spec else ""
    config = text_part(config)  # a vision-language model: its text decoder
    mt = getattr(config, "model_type", None) or "unknown"
    supported = ", ".join(supported_types())
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name}{mt} is an encoder-decoder model; linearize converts causal decoder LMs "
                                    f"({supported})")
    if mt == "linearize":
        raise UnsupportedModelError(f"{name}this model is already a linearize hybrid; convert its base model instead")
    if not_causal_reason(mt):
        raise UnsupportedModelError(f"{name}{mt} is {not_causal_reason(mt)}; linearize converts causal decoder LMs "
                                    f"({supported})")
    if mt not in supported_types():
        archs = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
        raise UnsupportedModelError(f"{name}model type {mt!r} ({archs}) is not supported{not_supported_reason(mt)} "
                                    f"(supported: {supported})")
    for attr in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if not isinstance(getattr(config, attr, None), int):
            raise UnsupportedModelError(f"{name}{mt} config has no {attr}: not a standard attention model")
    return mt


def load_base_config(spec: str, path) -> Any:
    """Read ``path/config.json`` (one line on failure) and check it is a supported architecture; a
    vision-language model's config is its text decoder's (what ``convert`` converts)."""
    try:
        config = read_config(path)
    except (ValueError, OSError, KeyError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0][:200]
        raise UnsupportedModelError(f"{spec}: cannot read its config.json ({first})") from None
    check_config_supported(config, spec)
    return config


def check_supported(model: PreTrainedModel) -> str:
    """The base ``model_type``, or a one-line error for encoder-only / non-standard models."""
    cfg = model.config
    check_config_supported(cfg)
    spec = arch_spec(cfg.model_type)
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise UnsupportedModelError(f"{cfg.model_type}: no decoder layer stack at model.model.layers")
    for i, layer in enumerate(model.model.layers):  # every layer must hold the standard attention projections
        attn = getattr(layer, spec.attention, None)
        missing = [p for p in spec.projections if not isinstance(getattr(attn, p, None), torch.nn.Linear)]
        if attn is None or missing:
            what = spec.attention if attn is None else f"{spec.attention}.{missing[0]}"
            raise UnsupportedModelError(f"{cfg.model_type}: layer {i} has no standard attention ({what} missing or "
                                        f"not a Linear); cannot linearize it")
    return cfg.model_type


def linearize_model(model: PreTrainedModel, layer_types: list[str], recipe: Recipe) -> LinearizeForCausalLM:
    """Turn a loaded causal LM into a hybrid in place (its weights are adopted, not copied). The layout's converted
    layers (``linear_attention``, as layouts are chosen) become the recipe's ``attention.layer_type``."""
    check_supported(model)
    converted = recipe["attention"].get("layer_type") or LINEAR
    named = parse_layer_windows(recipe["attention"].get("layer_windows"))
    if named and max(named) >= len(layer_types):
        raise RecipeError(f"attention.layer_windows names layer {max(named)}, and the model has {len(layer_types)} "
                          f"layers (0-{len(layer_types) - 1})")
    layer_types = [converted if t == LINEAR else t for t in layer_types]
    config = LinearizeConfig.from_base(model.config, layer_types, dict(recipe["attention"]))
    config._attn_implementation = model.config._attn_implementation
    param = next(model.parameters())
    config.dtype = param.dtype
    hybrid = LinearizeForCausalLM(config, base_model=model)
    hybrid.generation_config = model.generation_config
    hybrid.to(param.device)
    hybrid.eval()
    return hybrid

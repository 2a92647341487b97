"""Apply a recipe to a loaded model: swap attention modules and record the layout in the config."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .attention import arch_spec
from .errors import UnsupportedModelError
from .modeling import LinearizeConfig, LinearizeForCausalLM
from .recipe import Recipe


def check_supported(model: PreTrainedModel) -> str:
    """The base ``model_type``, or a one-line error for encoder-only / non-standard models."""
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{cfg.model_type}: encoder-decoder models are not supported (causal LMs only)")
    if cfg.model_type == "linearize":
        raise UnsupportedModelError("this model is already a linearize hybrid; convert its base model instead")
    arch_spec(cfg.model_type)
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise UnsupportedModelError(f"{cfg.model_type}: no decoder layer stack at model.model.layers")
    return cfg.model_type


def linearize_model(model: PreTrainedModel, layer_types: list[str], recipe: Recipe) -> LinearizeForCausalLM:
    """Turn a loaded causal LM into a hybrid in place (its weights are adopted, not copied)."""
    check_supported(model)
    config = LinearizeConfig.from_base(model.config, layer_types, dict(recipe["attention"]))
    config._attn_implementation = model.config._attn_implementation
    param = next(model.parameters())
    config.dtype = param.dtype
    hybrid = LinearizeForCausalLM(config, base_model=model)
    hybrid.generation_config = model.generation_config
    hybrid.to(param.device)
    hybrid.eval()
    return hybrid


@torch.no_grad()
def cache_bytes(config, seq_len: int, batch: int = 1, dtype_bytes: int = 2) -> dict[str, int]:
    """Cache + state bytes at ``seq_len`` for the original (all KV) and the hybrid layout."""
    n = config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_layer = 2 * batch * kv * seq_len * d * dtype_bytes
    layer_types = getattr(config, "layer_types", None) if config.model_type == "linearize" else None
    if layer_types is None:
        return {"original": n * kv_layer, "hybrid": n * kv_layer}
    la = config.linear_attention
    from .feature_maps import build_feature_map

    fm_params = {"feature_dim": la["feature_dim"]} if la.get("feature_dim") is not None else {}
    f = build_feature_map(la.get("feature_map", "hedgehog"), 1, d, **fm_params).feature_dim
    window = int(la.get("window") or 0)
    state = batch * kv * (f * d + f) * 4  # fp32 S and z
    ring = batch * kv * window * (d + f + d) * dtype_bytes
    n_full = sum(t != "linear_attention" for t in layer_types)
    n_lin = n - n_full
    return {"original": n * kv_layer, "hybrid": n_full * kv_layer + n_lin * (state + ring)}

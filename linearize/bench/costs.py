"""The cost model ``info`` and ``bench model`` share: the cache and state bytes of a layout, and what bounds a
model's speed (FLOPs per prefill token, bytes read per decode step), from shapes alone.

:func:`cache_bytes` (with :func:`kv_layer_bytes` and :func:`linear_state_bytes`, which ``convert --kv-budget``
uses too) gives the bytes a sequence's cache and state take at a context length; :func:`cost_model` reads a model's
matmul and attention FLOPs and its weight bytes; :func:`speedup_bounds` turns two of them into the speed-ups a
hybrid allows over its original at equal efficiency.
"""

from __future__ import annotations

import torch

from ..model.architectures import attention_shape
from ..model.cache import softmax_windows
from ..model.feature_maps import build_feature_map
from ..model.layout import CONVERTED, GATED_DELTA, LINEAR, layer_window


def kv_layer_bytes(config, tokens: int, batch: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of one softmax layer's cached keys and values for ``tokens`` tokens."""
    _, kv_heads, head_dim = attention_shape(config)
    return 2 * batch * kv_heads * tokens * head_dim * dtype_bytes


@torch.no_grad()
def linear_state_bytes(config, linear_attention: dict, batch: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of one converted layer's state under the ``linear_attention`` settings (a recipe's ``attention``
    section). A linear layer: fp32 ``S`` and ``z``, and for a window layer the ring of the last W tokens' keys, key
    features and values, which of them are padding, their fp32 log decays (``decay: learned``), the attention
    sinks' keys and values (``sinks``) and the step counter. A gated delta layer (``layer_type: gated_delta``):
    fp32 ``S`` ``[Hk, K, V]``. It does not grow with the context."""
    _, kv, d = attention_shape(config)
    la = linear_attention
    if la.get("layer_type") == GATED_DELTA:
        return batch * kv * d * d * 4
    fm_params = {"feature_dim": la["feature_dim"]} if la.get("feature_dim") is not None else {}
    f = build_feature_map(la.get("feature_map", "hedgehog"), 1, d, **fm_params).feature_dim
    state = batch * kv * (f * d + f) * 4  # fp32 S and z
    window = int(la.get("window") or 0)
    if not window:
        return state
    decays = batch * kv * window * 4 if (la.get("decay") or "none") != "none" else 0  # fp32 log decays
    ring = batch * kv * window * (d + f + d) * dtype_bytes + batch * window + decays  # + padding flags (bool)
    n = int(la.get("sinks") or 0)  # attention sinks: keys and values, int64 positions, validity flags
    sinks = batch * kv * n * 2 * d * dtype_bytes + batch * n * 9 if n else 0
    return state + ring + sinks + 8  # + the int64 step counter


def cache_bytes(config, seq_len: int, batch: int = 1, dtype_bytes: int = 2) -> dict[str, int]:
    """Cache + state bytes at ``seq_len`` for the original (all KV; the last ``sliding_window`` tokens in the base
    model's sliding layers) and the hybrid layout."""
    kv_layers = [kv_layer_bytes(config, min(seq_len, w or seq_len), batch, dtype_bytes)
                 for w in softmax_windows(config)]
    layer_types = getattr(config, "hybrid_layer_types", None) if config.model_type == "linearize" else None
    if layer_types is None:
        return {"original": sum(kv_layers), "hybrid": sum(kv_layers)}
    la = config.linear_attention
    hybrid = sum(linear_state_bytes(config, {**la, "window": layer_window(la, i)}, batch, dtype_bytes)
                 if t in CONVERTED else kv_layer for i, (t, kv_layer) in enumerate(zip(layer_types, kv_layers)))
    return {"original": sum(kv_layers), "hybrid": hybrid}


def cost_model(model) -> dict:
    """What bounds a model's speed, from its shapes (for the ``*_bound`` values of :func:`ratios`).

    ``matmul_flops_per_token``: 2 x the parameters a prefill token multiplies by (all but the embedding
    tables: prefill keeps the last position's logits only; of a mixture of experts' routed experts, the share a
    token is routed to); ``attention_flops_per_token_per_T``: causal attention at context T costs this x T FLOPs
    per token (2 T H d per softmax layer: half of QK^T and PV); ``sliding_windows``: the windows of the softmax
    layers that slide in the base model (Gemma 2 / 3, Mistral), which are left out of the previous term, and the
    exact-softmax windows of the converted layers, each costing ``attention_flops_per_key`` (4 H d) per key a token
    sees (a converted layer's linear part, its feature maps and state, counted as free);
    ``decode_weight_bytes``: weight bytes every decode step reads (all but the input embedding table, which it
    only indexes unless the output layer shares it, and the routed experts); ``expert_bytes``: the routed
    experts' bytes, of which a step reads the share :func:`decode_read_bytes` estimates; ``expert_share``: the
    experts one token uses, k / E (1 for a dense model)."""
    cfg = model.config
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    emb_in = inp.weight if inp is not None else None
    emb_out = out.weight if out is not None else None
    tied = emb_in is not None and emb_in is emb_out
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tables = {id(t): t.numel() for t in (emb_in, emb_out) if t is not None}
    experts = [p for n, p in model.named_parameters() if ".experts." in n]  # routed experts (not shared_expert)
    if experts:  # a hybrid's config keeps its base's fields, not the base class's aliases (num_experts in Mixtral)
        base = cfg.base_config() if hasattr(cfg, "base_config") else cfg
        total = next(getattr(base, f) for f in ("num_experts", "num_local_experts", "n_routed_experts")
                     if getattr(base, f, None))
        share = int(base.num_experts_per_tok) / int(total)
    else:
        share = 1.0
    expert_numel = sum(p.numel() for p in experts)
    expert_bytes = sum(p.numel() * p.element_size() for p in experts)
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * int(cfg.num_hidden_layers)
    windows = [w for t, w in zip(types, softmax_windows(cfg)) if t != LINEAR]  # of the softmax layers
    la = getattr(cfg, "linear_attention", None) or {}  # a hybrid's: its converted layers' exact windows (0: none)
    exact = [layer_window(la, i) for i, t in enumerate(getattr(cfg, "hybrid_layer_types", None) or []) if t == LINEAR]
    active = sum(p.numel() for p in model.parameters()) - sum(tables.values()) - expert_numel * (1 - share)
    return {"matmul_flops_per_token": int(2 * active),
            "attention_flops_per_token_per_T": 2 * windows.count(None) * heads * head_dim,
            "sliding_windows": [w for w in windows + exact if w], "attention_flops_per_key": 4 * heads * head_dim,
            "decode_weight_bytes": nbytes - expert_bytes
            - (0 if tied or emb_in is None else emb_in.numel() * emb_in.element_size()),
            "expert_bytes": expert_bytes, "expert_share": share}


def flops_per_token(cost: dict, T: int) -> int:
    """Prefill FLOPs per token at context ``T`` of a :func:`cost_model` (a sliding layer's query sees on average
    ``w - w^2 / 2T`` keys of a ``T``-token prefill, a full layer's ``T / 2``)."""
    slides = sum(T / 2 if w >= T else w - w * w / (2 * T) for w in cost.get("sliding_windows", ()))
    return cost["matmul_flops_per_token"] + cost["attention_flops_per_token_per_T"] * T + \
        cost.get("attention_flops_per_key", 0) * slides


def decode_read_bytes(cost: dict, batch: int) -> float:
    """Weight bytes a decode step of ``batch`` sequences reads (a :func:`cost_model`): every dense weight, and of
    the routed experts the expected share that at least one of the ``batch`` tokens is routed to, with routing
    taken as uniform: 1 - (1 - k/E)^batch."""
    touched = 1 - (1 - cost.get("expert_share", 1.0)) ** batch
    return cost["decode_weight_bytes"] + cost.get("expert_bytes", 0) * touched


def speedup_bounds(hybrid: dict, original: dict, T: int, cache_hybrid, cache_original,
                   batch: int = 1) -> tuple[float, float | None]:
    """``(prefill, decode)``: the speed-ups over ``original`` that ``hybrid`` (both :func:`cost_model`) allows at
    equal efficiency at context ``T``: prefill from FLOPs per token, decode from the bytes a step of ``batch``
    sequences reads (weights + cache bytes; None when a cache size is unknown)."""
    prefill = flops_per_token(original, T) / flops_per_token(hybrid, T)
    if not isinstance(cache_hybrid, (int, float)) or not isinstance(cache_original, (int, float)):
        return prefill, None
    return prefill, ((decode_read_bytes(original, batch) + cache_original)
                     / (decode_read_bytes(hybrid, batch) + cache_hybrid))

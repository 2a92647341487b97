"""The hybrid model: a Hugging Face config and causal-LM class with its own ``model_type``.

``LinearizeConfig`` carries every field of the base model's config (so generic code reads
``hidden_size``, ``vocab_size``, ... as usual), plus ``base_model_type``, the hybrid's layout
(``hybrid_layer_types``: ``full_attention``, ``linear_attention`` or ``gated_delta`` per layer; ``layer_types``: the
same in transformers' vocabulary, ``linear_attention`` for both kinds of converted layer), the ``linear_attention``
settings, the kernel options (``fused_feature_maps``, ``rotary_backend``:
:data:`~linearize.model.attention.KERNEL_OPTIONS`) and ``prefill_chunk_tokens``.
``LinearizeForCausalLM`` builds the base family's causal LM from that config, replaces the attention of every
``linear_attention`` layer with :class:`~linearize.model.attention.LinearAttention` and of every ``gated_delta``
layer with :class:`~linearize.model.delta_attention.GatedDeltaAttention`, and runs the base family's own forward
(an inference forward of more than ``prefill_chunk_tokens`` tokens, all rows together, as consecutive cached forwards:
:mod:`~linearize.model.prefill`). Parameter names are the base model's plus the converted layers' own (feature maps,
window and decay; the delta rule's gates and read-out scale).

In memory the config's ``model_type`` is ``linearize``; on disk ``config.json`` names the base family
(``llama``, ``gemma3_text``, ...) and the hybrid by ``architectures`` and ``auto_map``. transformers'
``AutoTokenizer`` reads ``config.json`` before the tokenizer files; under the base family's type it loads
the checkpoint's tokenizer exactly as the original's, with no custom code, prompt or warning, while the model
itself loads with ``trust_remote_code=True`` (or :func:`linearize.io.sources.load_model`). Checkpoints written
with ``model_type: linearize`` load the same way.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..version import __version__
from .architectures import arch_spec
from .attention import KERNEL_OPTIONS, LinearAttention, RealTokens, merge_kernel_options
from .cache import HybridCache, softmax_windows
from .delta_attention import GatedDeltaAttention
from .layout import CONVERTED, FULL, GATED_DELTA, transformers_layer_types
from .norms import set_norm_backend
from .prefill import PREFILL_CHUNK_TOKENS, check_chunk_size, chunked_forward, row_chunk
from .softmax_attention import attention_implementation

#: base-config fields that belong to the hybrid and must not be passed to the base config class
_OWN_FIELDS = ("base_model_type", "layer_types", "hybrid_layer_types", "linear_attention", "base_layer_types",
               "base_rope_parameters", "linearize_version", "prefill_chunk_tokens", *KERNEL_OPTIONS)


class LinearizeConfig(PretrainedConfig):
    """Config of a linearize hybrid: the base config's fields + the layer layout + layer settings + the kernel
    options + ``prefill_chunk_tokens`` (tokens per piece of a chunked prefill, all rows together, 0: none;
    :mod:`~linearize.model.prefill`)
    (a config without the last two, as written before they existed, takes the defaults).

    The layout is ``hybrid_layer_types`` (:mod:`~linearize.model.layout`'s types per decoder layer); ``layer_types``
    is its transformers spelling (:func:`~linearize.model.layout.transformers_layer_types`), since transformers
    refuses a ``layer_types`` entry it does not know and builds its caches from them. Given ``layer_types`` alone
    (a config written before gated delta layers, or ``from_base``'s layout), the layout is read from it."""

    model_type = "linearize"

    def __init__(self, base_model_type: str = "llama", layer_types: list[str] | None = None,
                 hybrid_layer_types: list[str] | None = None, linear_attention: dict | None = None,
                 base_layer_types: list[str] | None = None,
                 base_rope_parameters: dict | None = None, linearize_version: str | None = None,
                 fused_feature_maps: str = KERNEL_OPTIONS["fused_feature_maps"],
                 rotary_backend: str | None = KERNEL_OPTIONS["rotary_backend"],
                 norm_backend: str | None = KERNEL_OPTIONS["norm_backend"],
                 prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS, **kwargs):
        merge_kernel_options(KERNEL_OPTIONS, dict(fused_feature_maps=fused_feature_maps, rotary_backend=rotary_backend,
                                                  norm_backend=norm_backend))
        self.prefill_chunk_tokens = check_chunk_size(prefill_chunk_tokens)
        self.base_model_type = base_model_type
        layout = hybrid_layer_types if hybrid_layer_types is not None else layer_types
        self.hybrid_layer_types = list(layout) if layout is not None else None
        self.layer_types = transformers_layer_types(layout) if layout is not None else None
        if hybrid_layer_types is not None and layer_types is not None and list(layer_types) != self.layer_types:
            raise ValueError(f"layer_types {list(layer_types)} does not spell hybrid_layer_types {list(layout)}")
        self.linear_attention = dict(linear_attention or {})
        self.base_layer_types = base_layer_types
        self.base_rope_parameters = base_rope_parameters
        self.linearize_version = linearize_version
        self.fused_feature_maps = fused_feature_maps
        self.rotary_backend = rotary_backend
        self.norm_backend = norm_backend
        self.use_cache = kwargs.pop("use_cache", True)
        super().__init__(**kwargs)

    def to_json_string(self, use_diff: bool = True) -> str:
        """``config.json``'s text: ``model_type`` is the base family's (see the module docstring)."""
        d = json.loads(super().to_json_string(use_diff))
        d["model_type"] = self.base_model_type
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    @classmethod
    def get_config_dict(cls, *args, **kwargs) -> tuple[dict[str, Any], dict[str, Any]]:
        """Read ``config.json`` written with the base family's ``model_type`` (or ``linearize``) as this class."""
        config_dict, kwargs = super().get_config_dict(*args, **kwargs)
        on_disk = config_dict.get("model_type")
        if on_disk != cls.model_type:
            config_dict = {**config_dict, "model_type": cls.model_type,
                           "base_model_type": config_dict.get("base_model_type") or on_disk}
        return config_dict, kwargs

    @classmethod
    def from_base(cls, base_config: PretrainedConfig, layer_types: list[str], linear_attention: dict) -> "LinearizeConfig":
        """Wrap a base config (e.g. ``LlamaConfig``) with a hybrid layout and layer settings."""
        d = base_config.to_dict()
        base_type = d.pop("model_type")
        arch_spec(base_type)  # one-line error for unsupported families
        for k in ("architectures", "auto_map", "transformers_version", "quantization_config"):
            d.pop(k, None)
        base_layer_types = d.pop("layer_types", None)
        rope = d.get("rope_parameters")
        # rotary parameters per base layer type (Gemma 3: {"sliding_attention": {...}, "full_attention": {...}}) are
        # kept aside: transformers would read them against the hybrid's layer_types, as one flat set, and rewrite them
        nested = isinstance(rope, dict) and rope and all(x is None or isinstance(x, dict) for x in rope.values())
        base_rope_parameters = d.pop("rope_parameters") if nested else None
        n = base_config.num_hidden_layers
        if len(layer_types) != n:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {n} layers")
        return cls(base_model_type=base_type, layer_types=layer_types, linear_attention=linear_attention,
                   base_layer_types=base_layer_types, base_rope_parameters=base_rope_parameters,
                   linearize_version=__version__, **d)

    def base_config(self) -> PretrainedConfig:
        """The base family's config object (its own ``layer_types`` restored)."""
        d = self.to_dict()
        for k in _OWN_FIELDS + ("model_type", "architectures", "auto_map", "transformers_version"):
            d.pop(k, None)
        if self.base_layer_types is not None:
            d["layer_types"] = self.base_layer_types
        if self.base_rope_parameters is not None:
            d["rope_parameters"] = self.base_rope_parameters
        cfg = AutoConfig.for_model(self.base_model_type, **d)
        impl = getattr(self, "_attn_implementation", None)
        if impl is not None:
            cfg._attn_implementation = _base_attention(cfg, impl)
        return cfg

    @property
    def linear_layers(self) -> list[int]:
        """The converted layers (linear attention or gated delta rule), in order."""
        return [i for i, t in enumerate(self.hybrid_layer_types or []) if t in CONVERTED]


def _base_attention(base_config: PretrainedConfig, impl: str) -> str:
    """The attention implementation the base family runs: ``impl``, or eager where the family has no SDPA path
    (Gemma 2, whose scores are soft-capped), as transformers picks for the original model; ``sdpa`` runs as
    :data:`~linearize.model.softmax_attention.SDPA` (no mask for a cache's unpadded continuation)."""
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(base_config)]
    except KeyError:
        return attention_implementation(impl)
    return "eager" if impl == "sdpa" and not getattr(cls, "_supports_sdpa", True) else attention_implementation(impl)


class LinearizeForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal LM whose ``linear_attention`` layers run linear attention and ``gated_delta`` layers the gated delta
    rule. Loads with ``from_pretrained``."""

    config_class = LinearizeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = False
    _supports_attention_backend = True
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # no _no_split_modules here: post_init collects the adopted base model's (its decoder layer class), so
    # layer-wise offloading places whole decoder layers for every family without a list kept by hand

    def __init__(self, config: LinearizeConfig, base_model: PreTrainedModel | None = None):
        super().__init__(config)
        base_cfg = config.base_config()
        if base_model is None:
            base_model = AutoModelForCausalLM.from_config(base_cfg, dtype=config.dtype if isinstance(config.dtype, torch.dtype) else None)
        else:  # adopted weights stay as they are: post_init below initialises only the modules added here
            for module in base_model.modules():
                module._is_hf_initialized = True
        self._base_forward = type(base_model).forward
        self.model = base_model.model
        self.lm_head = base_model.lm_head
        for name, value in vars(base_model).items():  # scalars the base forward reads (Cohere's logit_scale)
            if not name.startswith("_") and isinstance(value, (bool, int, float, str)) and not hasattr(self, name):
                setattr(self, name, value)
        self.vocab_size = config.vocab_size
        spec = arch_spec(config.base_model_type)
        options = self.kernel_options()
        masks = RealTokens()  # one padding read per forward, shared by the converted layers
        for i, kind in enumerate(config.hybrid_layer_types or []):
            if kind not in CONVERTED:
                if kind != FULL:
                    raise ValueError(f"hybrid_layer_types[{i}] = {kind!r}: expected one of "
                                     f"{', '.join((FULL, *CONVERTED))}")
                continue
            layer = self.model.layers[i]
            original = getattr(layer, spec.attention)
            cls = GatedDeltaAttention if kind == GATED_DELTA else LinearAttention
            setattr(layer, spec.attention, cls(original, base_cfg, i, config.linear_attention, spec,
                                               kernel_options=options, masks=masks))
        self.post_init()
        if options["norm_backend"] != "torch":
            set_norm_backend(self, options["norm_backend"])

    def _init_weights(self, module):
        # New modules (feature maps, window logits) initialise themselves; base weights come from the checkpoint.
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and not getattr(module, "_is_hf_initialized", False):
            super()._init_weights(module)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def linear_modules(self) -> list[LinearAttention | GatedDeltaAttention]:
        """The converted layers (linear attention, gated delta rule), in order."""
        return [m for m in self.modules() if isinstance(m, (LinearAttention, GatedDeltaAttention))]

    def set_attention_mode(self, mode: str) -> None:
        """``"linear"`` (converted), ``"softmax"`` (original attention) or ``"distill"`` (both)."""
        if mode not in ("linear", "softmax", "distill"):
            raise ValueError(f"unknown attention mode {mode!r}")
        for m in self.linear_modules():
            m.mode = mode

    def set_softmax_layers(self, layers) -> None:
        """The linear layers whose index is in ``layers`` run their original softmax attention, every other one
        linear attention (layer ablations: the probe, its swap check, ``eval --task swapback``)."""
        for m in self.linear_modules():
            m.mode = "softmax" if m.layer_idx in layers else "linear"

    def kernel_options(self) -> dict:
        """The config's kernel options (:data:`~linearize.model.attention.KERNEL_OPTIONS`)."""
        return {name: getattr(self.config, name) for name in KERNEL_OPTIONS}

    def set_kernel_options(self, **options) -> None:
        """Change kernel options (``fused_feature_maps="none"``, ``rotary_backend="torch"``, ``norm_backend=None``) in
        the config and every converted layer (the norm backend: in every RMS norm of the model); the others stay.
        Results change by rounding only."""
        for name, value in merge_kernel_options(self.kernel_options(), options).items():
            setattr(self.config, name, value)
        for m in self.linear_modules():
            m.set_kernel_options(**options)
        if "norm_backend" in options:
            set_norm_backend(self, options["norm_backend"])

    def new_cache(self) -> HybridCache:
        return HybridCache(self.config.hybrid_layer_types, softmax_windows(self.config))

    def _swap_cache(self, cache: Any) -> Any:
        if cache is None or isinstance(cache, HybridCache):
            return cache
        if isinstance(cache, Cache) and cache.get_seq_length() == 0:
            return self.new_cache()
        raise ValueError("a linearize hybrid needs its own HybridCache (model.new_cache()), got " + type(cache).__name__)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        out = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        for key in ("cache", "past_key_values"):
            c = model_kwargs.get(key)
            if isinstance(c, Cache) and not isinstance(c, HybridCache) and not getattr(c, "_is_user_defined", False):
                model_kwargs[key] = self.new_cache()
                if getattr(generation_config, "is_assistant", False):  # an assistant's drafts are taken back
                    model_kwargs[key].activate_past_recording()
        return out

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, prefill_chunk_tokens=None, **kwargs):
        """The base family's forward with the hybrid's cache. ``prefill_chunk_tokens`` (default: the config's) splits
        an inference forward of more than that many tokens (B rows x T) into cached forwards of that many, i.e. of
        ``prefill_chunk_tokens // B`` tokens per row (:meth:`_chunk_size` says when); the logits asked for by
        ``logits_to_keep`` and the filled cache come back as from one forward (the cache even with
        ``use_cache=False``, which then is internal and not returned)."""
        impl = self.config._attn_implementation
        base = _base_attention(self.model.config, impl) if impl is not None else None
        if base is not None and self.model.config._attn_implementation != base:  # e.g. set on the hybrid's config
            self.model.config._attn_implementation = base
        c = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        x = input_ids if input_ids is not None else inputs_embeds
        past = c.get_seq_length() if isinstance(c, Cache) else 0
        chunk = self._chunk_size(prefill_chunk_tokens, x, attention_mask, past, labels, logits_to_keep, kwargs)
        if (use_cache or chunk) and c is None:
            c = self.new_cache()
        c = self._swap_cache(c)
        key = "cache" if "cache" in _base_forward_params(self._base_forward) else "past_key_values"
        if chunk:
            cache_position = kwargs.pop("cache_position", None)  # older transformers: cut per piece like the ids
            as_tuple = kwargs.pop("return_dict", getattr(self.config, "return_dict", True)) is False

            def step(**piece):  # one piece: a cached forward of the base family
                return self._base_forward(self, use_cache=True, return_dict=True, **{key: c}, **piece, **kwargs)

            out = chunked_forward(step, chunk, input_ids=input_ids, inputs_embeds=inputs_embeds,
                                  attention_mask=attention_mask, position_ids=position_ids, past=past,
                                  logits_to_keep=logits_to_keep, cache_position=cache_position,
                                  return_cache=bool(use_cache))
            return out.to_tuple() if as_tuple else out
        kwargs[key] = c
        return self._base_forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                  logits_to_keep=logits_to_keep, **kwargs)

    def _chunk_size(self, prefill_chunk_tokens, x, attention_mask, past: int, labels, logits_to_keep,
                    kwargs: dict) -> int:
        """Tokens per row in one piece if this forward runs as a chunked prefill, else 0. It does for inference (eval
        mode, no labels, no gradient recorded: training and backward need the whole graph, which pieces would not
        shrink) longer than one piece, with every converted layer in linear mode (a softmax teacher keeps no cache), no
        padding mask or a 2-D one over the ``past`` cached tokens and the new ones, ``logits_to_keep`` an int or a
        1-D tensor, and no per-layer outputs asked for (attentions, hidden states, router logits)."""
        asked = self.config.prefill_chunk_tokens if prefill_chunk_tokens is None else prefill_chunk_tokens
        chunk = row_chunk(check_chunk_size(asked), 1 if x is None else x.shape[0])
        if not chunk or x is None or x.shape[1] <= chunk or labels is not None or self.training:
            return 0
        if torch.is_grad_enabled() or any(m.mode != "linear" for m in self.linear_modules()):
            return 0
        if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[1] != past + x.shape[1]):
            return 0
        if torch.is_tensor(logits_to_keep) and logits_to_keep.dim() != 1:
            return 0
        if any(kwargs.get(k, getattr(self.config, k, False))
               for k in ("output_attentions", "output_hidden_states", "output_router_logits")):
            return 0
        return chunk


_PARAMS_CACHE: dict[Any, set[str]] = {}


def _base_forward_params(fn) -> set[str]:
    if fn not in _PARAMS_CACHE:
        _PARAMS_CACHE[fn] = set(inspect.signature(inspect.unwrap(fn)).parameters)
    return _PARAMS_CACHE[fn]


def register_auto_classes() -> None:
    """Make ``AutoConfig``/``AutoModelForCausalLM`` know the ``linearize`` model type."""
    try:
        AutoConfig.register("linearize", LinearizeConfig)
    except ValueError:
        pass
    try:
        AutoModelForCausalLM.register(LinearizeConfig, LinearizeForCausalLM)
    except ValueError:
        pass


register_auto_classes()

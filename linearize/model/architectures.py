"""Model families as data: one table, :data:`FAMILIES`, says per ``model_type`` what linearize knows about it.

A supported causal decoder LM has an :class:`ArchSpec` (where its attention pieces are); a model type that is
not a causal decoder LM, or one checked and not supported, has the one-line reason its refusal gives; a
vision-language wrapper whose text decoder converts on its own has a :class:`TextDecoder` (where its text config
is, how its checkpoint keys map onto the text causal LM's). Adding a family is one line here, not a code path.

Bundled into every checkpoint (:mod:`linearize.bundle`): imports only bundled modules, and no torch (the command
line imports it through :mod:`linearize.io.sources` before it needs torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class ArchSpec:
    """Where a family keeps its attention pieces. Architecture support is data, not branches."""

    attention: str = "self_attn"  # attribute of a decoder layer
    projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    q_norm: str | None = None  # norm applied before rotary (Qwen3, OLMo 2); absent on the module: not applied
    k_norm: str | None = None
    # what q_norm / k_norm normalise: "head", each head's vector (Qwen3), laid out [B, T, H, D]; "heads_first", the
    # same laid out [B, H, T, D] (StableLM's one LayerNorm per head); "projection", the whole projection before it
    # is split into heads (OLMo 2)
    qk_norm_over: str = "head"
    # config field bounding q, k and v after projection, |x| <= bound (OLMo's clip_qkv); None in the config: no bound
    clip_qkv: str | None = None
    # whether the original attention module rotates q and k (None: always); False for the layers without positions
    # of SmolLM3 and EXAONE 4
    uses_rope: Optional[Callable[[Any], bool]] = None
    # the q/k norms come after rotary instead of before it (Hunyuan)
    qk_norm_after_rope: bool = False
    # rotary turns interleaved pairs (x[2i], x[2i+1]) by frequency i: "pairs" with the usual half-split tables
    # (GLM, Helium, ERNIE 4.5), "tables" with interleaved tables too (Cohere). The converted layers gather each
    # head's rotated channels as [evens, odds] first (tables: their even entries, twice), which makes it the usual
    # half-split rotary and leaves every q.k (and so the teacher) unchanged
    rope_interleaved: str | None = None
    # one projection computing queries, keys and values, in that order (Phi-3: qkv_proj); None: q_proj, k_proj, v_proj
    qkv: str | None = None

    def lora_targets(self, targets: list[str]) -> list[str]:
        """A recipe's LoRA targets (named as in Llama: q_proj, k_proj, v_proj, o_proj) as this family's modules:
        q/k/v become the fused projection where there is one (in order, once)."""
        out = [self.qkv if self.qkv and t in ("q_proj", "k_proj", "v_proj") else t for t in targets]
        return list(dict.fromkeys(out))


@dataclass(frozen=True)
class TextDecoder:
    """A vision-language model whose text decoder converts on its own (the vision tower is not loaded and the
    hybrid is a text model)."""

    config: str  # attribute of the outer config holding the text decoder's config
    key_mapping: dict[str, str]  # checkpoint key prefixes (regular expressions) -> the text causal LM's


@dataclass(frozen=True)
class Family:
    """What linearize knows about one model type; one of the fields is set."""

    arch: ArchSpec | None = None  # a supported causal decoder LM: where its attention pieces are
    not_causal: str | None = None  # not a causal decoder LM: what it is, as the refusal says it
    not_supported: str | None = None  # a causal decoder LM checked and not supported: why
    text_decoder: TextDecoder | None = None  # a vision-language wrapper: how to take its text decoder


#: checkpoint key prefixes of a vision-language model's text decoder -> the text causal LM's (both layouts: the one
#: transformers 5 writes, ``language_model.model.*``, and its in-memory one, ``model.language_model.*``)
_LANGUAGE_MODEL_KEYS = {r"^language_model\.model\.": "model.", r"^model\.language_model\.": "model.",
                        r"^language_model\.lm_head\.": "lm_head."}
_ENCODER_ONLY = Family(not_causal="an encoder-only model (bidirectional attention, no causal LM to linearize)")
_NO_SOFTMAX = Family(not_causal="a model without softmax attention (state-space / recurrent layers)")

#: model_type -> what linearize knows about it
FAMILIES: dict[str, Family] = {
    "llama": Family(ArchSpec()),
    "mistral": Family(ArchSpec()),
    "qwen2": Family(ArchSpec()),  # q/k/v biases live inside the adopted nn.Linear modules
    "qwen3": Family(ArchSpec(q_norm="q_norm", k_norm="k_norm")),
    # softmax scale = attention_multiplier (read from the module); other multipliers in the base
    "granite": Family(ArchSpec()),
    "gemma": Family(ArchSpec()),
    # Gemma 2 / 3 (text): sliding-window softmax layers and Gemma 2's logit soft-cap are read from the base config
    # and the original module (the teacher keeps both; the converted layers' window uses plain softmax scores)
    "gemma2": Family(ArchSpec()),
    "gemma3_text": Family(ArchSpec(q_norm="q_norm", k_norm="k_norm")),
    "olmo2": Family(ArchSpec(q_norm="q_norm", k_norm="k_norm", qk_norm_over="projection")),
    # Phi-3 / Phi-3.5 / Phi-4: fused qkv_proj; Phi-4-mini rotates only part of each head (the rotary tables say how
    # much)
    "phi3": Family(ArchSpec(projections=("qkv_proj", "o_proj"), qkv="qkv_proj")),
    # Llama-shaped attention under other names; sliding windows (Starcoder2, Ministral, OLMo 3) are read from the
    # config, partial rotary (StableLM, Nemotron) from the rotary tables
    "arcee": Family(ArchSpec()),
    "seed_oss": Family(ArchSpec()),
    "starcoder2": Family(ArchSpec()),
    "ministral": Family(ArchSpec()),
    "nemotron": Family(ArchSpec()),
    "olmo": Family(ArchSpec(clip_qkv="clip_qkv")),
    "olmo3": Family(ArchSpec(q_norm="q_norm", k_norm="k_norm", qk_norm_over="projection")),
    "apertus": Family(ArchSpec(q_norm="q_norm", k_norm="k_norm")),
    # qk_layernorm: one LayerNorm per head
    "stablelm": Family(ArchSpec(q_norm="q_layernorm", k_norm="k_layernorm", qk_norm_over="heads_first")),
    "smollm3": Family(ArchSpec(uses_rope=lambda m: bool(m.use_rope))),  # every fourth layer without rotary
    # global layers without rotary when the model has sliding ones
    "exaone4": Family(ArchSpec(q_norm="q_norm", k_norm="k_norm",
                               uses_rope=lambda m: m.sliding_window is None or bool(m.is_sliding))),
    "hunyuan_v1_dense": Family(ArchSpec(q_norm="query_layernorm", k_norm="key_layernorm", qk_norm_after_rope=True)),
    # GLM 4 (glm) and GLM-4 0414 (glm4): partial, interleaved rotary
    "glm": Family(ArchSpec(rope_interleaved="pairs")),
    "glm4": Family(ArchSpec(rope_interleaved="pairs")),
    "helium": Family(ArchSpec(rope_interleaved="pairs")),
    "ernie4_5": Family(ArchSpec(rope_interleaved="pairs")),
    # Command R: interleaved rotary, optional q/k LayerNorms ([heads, head_dim] weights); Command R7B: rotary in
    # the sliding layers only
    "cohere": Family(ArchSpec(q_norm="q_norm", k_norm="k_norm", rope_interleaved="tables")),
    "cohere2": Family(ArchSpec(rope_interleaved="tables", uses_rope=lambda m: m.sliding_window is not None)),
    # mixture-of-experts variants: attention laid out as their dense family; the expert MLPs are left as they are
    "mixtral": Family(ArchSpec()),
    "qwen2_moe": Family(ArchSpec()),
    "qwen3_moe": Family(ArchSpec(q_norm="q_norm", k_norm="k_norm")),
    "granitemoe": Family(ArchSpec()),
    "phimoe": Family(ArchSpec()),
    # GLM-4.5: q/k norms when use_qk_norm, partial rotary
    "glm4_moe": Family(ArchSpec(q_norm="q_norm", k_norm="k_norm")),
    "hunyuan_v1_moe": Family(ArchSpec(q_norm="query_layernorm", k_norm="key_layernorm", qk_norm_after_rope=True)),
    "ernie4_5_moe": Family(ArchSpec(rope_interleaved="pairs")),
    # vision-language models whose text decoder converts (its model type is then the one checked)
    "gemma3": Family(text_decoder=TextDecoder("text_config", _LANGUAGE_MODEL_KEYS)),  # Gemma 3 from 4B up
    "mistral3": Family(text_decoder=TextDecoder("text_config", _LANGUAGE_MODEL_KEYS)),  # Mistral Small 3.1 / 3.2
    # causal decoders checked and not supported: why their attention is not what the converted layers compute
    "gpt_oss": Family(not_supported="its attention has learned sinks"),
    # not causal decoder LMs
    **dict.fromkeys(["bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
                     "camembert", "modernbert", "mpnet", "ernie", "nomic_bert", "longformer", "big_bird",
                     "xlm-roberta-xl", "data2vec-text", "esm"], _ENCODER_ONLY),
    **dict.fromkeys(["mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"], _NO_SOFTMAX),
}


def _family(model_type: str | None) -> Family:
    return FAMILIES.get(model_type) or Family()


def supported_types() -> list[str]:
    """The model types linearize converts, sorted."""
    return sorted(mt for mt, f in FAMILIES.items() if f.arch is not None)


def not_supported_reason(model_type: str) -> str:
    """``": why"`` for a causal decoder checked and not supported, else ``""``."""
    why = _family(model_type).not_supported
    return f": {why}" if why else ""


def not_causal_reason(model_type: str | None) -> str | None:
    """What a model type that is not a causal decoder LM is (``"an encoder-only model (...)"``); None otherwise."""
    return _family(model_type).not_causal


def arch_spec(model_type: str) -> ArchSpec:
    """The :class:`ArchSpec` of a model type, or a one-line error naming why (where known) and the supported ones."""
    spec = _family(model_type).arch
    if spec is None:
        raise UnsupportedModelError(f"model type {model_type!r} is not supported{not_supported_reason(model_type)} "
                                    f"(supported: {', '.join(supported_types())})")
    return spec


def text_decoder(model_type: str | None) -> TextDecoder | None:
    """How to take the text decoder of a vision-language model type; None for any other."""
    return _family(model_type).text_decoder


def text_part(config):
    """The config of the model linearize converts: a vision-language model's text decoder (its word-embedding
    tie taken from the outer config, which is the one the model applies), otherwise ``config`` itself."""
    entry = text_decoder(getattr(config, "model_type", None))
    if entry is None:
        return config
    text = getattr(config, entry.config)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", text.tie_word_embeddings))
    return text


def attention_shape(config) -> tuple[int, int, int]:
    """``(heads, kv_heads, head_dim)`` of a decoder config (``kv_heads`` defaults to ``heads``, ``head_dim`` to
    ``hidden_size / heads``)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads

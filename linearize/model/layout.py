"""Layer types of a hybrid (``config.hybrid_layer_types``, and their transformers spelling ``config.layer_types``)."""

#: a converted layer of linear attention with feature maps (:class:`~linearize.model.attention.LinearAttention`)
LINEAR = "linear_attention"
#: a converted layer running the gated delta rule (:class:`~linearize.model.delta_attention.GatedDeltaAttention`)
GATED_DELTA = "gated_delta"
#: a softmax-attention layer kept from the original
FULL = "full_attention"
#: the types of converted layers (a recipe's ``attention.layer_type`` is one of them)
CONVERTED = (LINEAR, GATED_DELTA)


def transformers_layer_types(layer_types: list[str]) -> list[str]:
    """``layer_types`` in transformers' vocabulary, which its configs validate (on creation and on save) and its
    caches are built from: every converted layer is ``linear_attention`` (transformers' name for recurrent layers,
    the gated delta rule's included: Qwen3-Next's configs say so), a softmax layer ``full_attention``."""
    return [LINEAR if t in CONVERTED else t for t in layer_types]

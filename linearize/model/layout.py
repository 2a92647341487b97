"""Layer types of a hybrid (``config.layer_types``)."""

#: a converted (linear-attention) layer
LINEAR = "linear_attention"
#: a softmax-attention layer kept from the original
FULL = "full_attention"

"""linearize: convert softmax-attention LLMs into linear-attention hybrids.

Importing the package registers the hybrid config and model with transformers' Auto classes, so
``AutoModelForCausalLM.from_pretrained(hybrid_dir)`` works without ``trust_remote_code``.
"""

__version__ = "0.1.0"

from .modeling import LinearizeConfig, LinearizeForCausalLM  # noqa: E402

__all__ = ["LinearizeConfig", "LinearizeForCausalLM", "__version__"]

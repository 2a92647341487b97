"""linearize: convert softmax-attention LLMs into linear-attention hybrids.

Importing the package registers the hybrid config and model with transformers' Auto classes, so
``AutoModelForCausalLM.from_pretrained(hybrid_dir)`` works without ``trust_remote_code``. (The ``linearize``
command line, started through ``_linearize_cli``, defers that to the commands that open a hybrid.)
"""

import sys

__version__ = "0.1.0"

__all__ = ["LinearizeConfig", "LinearizeForCausalLM", "__version__"]

if "_linearize_cli" not in sys.modules:
    from .modeling import LinearizeConfig, LinearizeForCausalLM  # noqa: E402


def __getattr__(name: str):
    if name in ("LinearizeConfig", "LinearizeForCausalLM"):
        from . import modeling

        return getattr(modeling, name)
    raise AttributeError(f"module 'linearize' has no attribute {name!r}")

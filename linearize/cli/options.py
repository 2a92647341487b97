"""Options several commands share: one definition each, so a flag reads the same in every command's ``--help``."""

from __future__ import annotations

from typing import List, Optional

import typer

DTYPE_HELP = "float32 | bfloat16 | float16 (default: float32 on CPU, bfloat16 on GPU)."
DEVICE_HELP = "cpu | cuda | cuda:N (default: cuda when available)."
OVERWRITE_HELP = ("Replace an earlier output of this command (a folder it wrote, with its .linearize-output.json); "
                  "never a model checkpoint or anything else.")
MAX_MEMORY_HELP = ("Run a model that does not fit one device, onloading layer by layer: DEV=SIZE,... with DEV N, "
                   "cuda:N or cpu and SIZE like 40GiB, 512MB, 1.5GB (e.g. 0=40GiB,cpu=100GiB). Whole decoder layers "
                   "fill the listed devices in order, the rest stay on disk; an offloaded layer's weights move to the "
                   "first listed GPU (else the CPU) just for its forward. Excludes --device.")
OFFLOAD_DIR_HELP = ("With --max-memory: where weights offloaded to disk may be written (a private folder, removed at "
                    "exit; default: under the linearize cache).")

# the model-loading options of convert, distill, finetune, generate and eval
DTYPE = typer.Option(None, "--dtype", help=DTYPE_HELP)
DEVICE = typer.Option(None, "--device", help=DEVICE_HELP)
# the benchmarks' (bfloat16 by default on a GPU, as they time what a deployment runs)
BENCH_DTYPE = typer.Option(None, "--dtype", help="bfloat16 | float16 | float32 (default: bfloat16 on GPU, float32 on CPU).")
BENCH_DEVICE = typer.Option(None, "--device", help="cuda | cuda:N | cpu (default: cuda when available).")
# the training options of convert, distill and finetune (SET also bench train's)
SET = typer.Option(None, "--set", help="Override a recipe field: section.field=value (repeatable).")
RESUME = typer.Option(False, "--resume", help="Continue an interrupted run from its last checkpoint.")
FSDP = typer.Option(False, "--fsdp", help="Under torchrun: shard the model over the processes (FSDP2) instead of copying it to each; for models that do not fit one device.")


def overrides(sets: Optional[List[str]]) -> dict:
    """``--set section.field=value`` options as a ``{field: value}`` dict of recipe overrides."""
    from ..recipe import parse_override  # start-up time: the recipe schema imports numpy

    return dict(parse_override(s) for s in (sets or []))

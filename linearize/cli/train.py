"""``linearize distill`` and ``linearize finetune``: rerun a training stage on a hybrid checkpoint
(:func:`linearize.convert.pipeline.rerun_stage`)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..io.outputs import command_scope, finish_output
from .app import app, log, user_errors
from .options import DEVICE, DTYPE, FSDP, RESUME, SET, overrides

_TOKENS_HELP = "Token budget, e.g. 256K, 20M (default: the recipe's)."
_OUT_HELP = "Write here (a new folder, outside any model checkpoint) instead of updating PATH in place."
_PATH_HELP = "A hybrid checkpoint directory (from `linearize convert`)."
_LENGTH_HELP = ("Tokens per training sequence, e.g. 8K (default: the recipe's); batch and held-out sequences are "
                "scaled to keep the tokens per step.")


@app.command()
@user_errors
def distill(
    path: str = typer.Argument(..., help=_PATH_HELP),
    tokens: Optional[str] = typer.Option(None, "--tokens", help=_TOKENS_HELP),
    train_length: Optional[str] = typer.Option(None, "--train-length", help=_LENGTH_HELP),
    set_: Optional[List[str]] = SET,
    out: Optional[Path] = typer.Option(None, "-o", "--output", help=_OUT_HELP),
    resume: bool = RESUME,
    dtype: Optional[str] = DTYPE,
    device: Optional[str] = DEVICE,
    fsdp: bool = FSDP,
):
    """(Re)run attention transfer (stage 1) on a hybrid checkpoint."""
    from ..convert.pipeline import rerun_stage  # start-up time: torch, transformers and the model code

    with command_scope("distill", in_place=path):  # PATH itself is updated in place; -o never a model checkpoint
        p = rerun_stage("distill", path, out=out, overrides=overrides(set_), tokens=tokens, resume=resume,
                        dtype=dtype, device=device, fsdp=fsdp, train_length=train_length, log=log)
    log(f"wrote {p}")


@app.command()
@user_errors
def finetune(
    path: str = typer.Argument(..., help=_PATH_HELP),
    tokens: Optional[str] = typer.Option(None, "--tokens", help=_TOKENS_HELP),
    loss: Optional[str] = typer.Option(None, "--loss", help="xent (next token) or kl (to the original attention)."),
    train_length: Optional[str] = typer.Option(None, "--train-length", help=_LENGTH_HELP),
    set_: Optional[List[str]] = SET,
    adapter_only: bool = typer.Option(False, "--adapter-only", help="Write only the LoRA adapter (default PATH-adapter)."),
    out: Optional[Path] = typer.Option(None, "-o", "--output", help=_OUT_HELP),
    resume: bool = RESUME,
    dtype: Optional[str] = DTYPE,
    device: Optional[str] = DEVICE,
    fsdp: bool = FSDP,
):
    """(Re)run the LoRA stage (stage 2) on a hybrid checkpoint; adapters are merged before saving."""
    # start-up time: torch, transformers and the model code
    from ..convert.pipeline import rerun_stage
    from ..distributed import is_main

    # PATH itself is updated in place (an adapter never goes into it); -o is never a model checkpoint
    with command_scope("finetune", in_place=None if adapter_only else path):
        p = rerun_stage("finetune", path, out=out, overrides=overrides(set_), tokens=tokens, loss=loss,
                        adapter_only=adapter_only, resume=resume, dtype=dtype, device=device,
                        fsdp=fsdp, train_length=train_length, log=log)
    if adapter_only and is_main():  # the adapter folder peft wrote: its marker and the usual file modes
        finish_output(p, "finetune")
    log(f"wrote {p}")

"""``linearize convert``: spec -> hybrid checkpoint (:func:`linearize.convert.pipeline.convert`)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..io.outputs import command_scope
from ..settings import DEFAULT_MODEL, DEFAULT_RATIO, DEFAULT_RECIPE
from .app import app, log, user_errors
from .options import DEVICE, DTYPE, FSDP, OVERWRITE_HELP, RESUME, SET, overrides


@app.command()
@user_errors
def convert(
    spec: str = typer.Argument(DEFAULT_MODEL, help="Model: alias, local dir, .gguf file or hub id."),
    ratio: Optional[str] = typer.Option(None, "--ratio", help=f"A:B = A linear layers per B softmax layers, repeating (default {DEFAULT_RATIO}); with --select auto only the count is kept."),
    softmax_layers: Optional[str] = typer.Option(None, "--softmax-layers", help="Explicit softmax layers, e.g. 3,7,11 (overrides --ratio and --select)."),
    select: Optional[str] = typer.Option(None, "--select", help="interleave (the --ratio pattern) or auto (probe every layer, keep the ones that matter most as softmax); default: the recipe's select.method (lolcats: auto when training)."),
    kv_budget: Optional[str] = typer.Option(None, "--kv-budget", help="Implies --select auto. BYTES@LENGTH, e.g. 2GB@32K: keep the most softmax layers whose KV cache + linear state at LENGTH tokens (batch 1) fits BYTES."),
    recipe: str = typer.Option(DEFAULT_RECIPE, "--recipe", help="Recipe name (see `linearize recipes`) or YAML path."),
    set_: Optional[List[str]] = SET,
    no_train: bool = typer.Option(False, "--no-train", help="Surgery only: write the untrained hybrid."),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="Training tokens, split evenly across the stages, e.g. 40M (default: the recipe's)."),
    distill_tokens: Optional[str] = typer.Option(None, "--distill-tokens", help="Attention-transfer tokens (overrides the split)."),
    finetune_tokens: Optional[str] = typer.Option(None, "--finetune-tokens", help="LoRA tokens (overrides the split)."),
    train_length: Optional[str] = typer.Option(None, "--train-length", help="Tokens per training sequence in both stages, e.g. 2K (default: the recipe's, 8K for lolcats, or the model's context where shorter); batch and held-out sequences are scaled to keep the tokens per step. A converted layer's fit holds up to about the length it is trained at."),
    no_finetune: bool = typer.Option(False, "--no-finetune", help="Stop after attention transfer (no LoRA stage)."),
    loss: Optional[str] = typer.Option(None, "--loss", help="LoRA loss: xent (next token) or kl (to the original); default: the recipe's."),
    resume: bool = RESUME,
    out: Optional[Path] = typer.Option(None, "-o", "--output", help="Output directory (default: MODEL-LAYOUT-RECIPE)."),
    overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP),
    dtype: Optional[str] = DTYPE,
    device: Optional[str] = DEVICE,
    fsdp: bool = FSDP,
):
    """Convert a model into a linear-attention hybrid checkpoint."""
    # start-up time: the pipeline imports torch, transformers and the model code, which --help never needs
    from ..convert.pipeline import convert as run
    from ..convert.plan import LayoutOptions, RunOptions, TrainingOptions

    layout = LayoutOptions(ratio=ratio, softmax_layers=softmax_layers, select=select, kv_budget=kv_budget)
    training = TrainingOptions(train=not no_train, finetune=not no_finetune, tokens=tokens,
                               distill_tokens=distill_tokens, finetune_tokens=finetune_tokens, loss=loss,
                               resume=resume, train_length=train_length)
    where = RunOptions(out=out, overwrite=overwrite, dtype=dtype, device=device, fsdp=fsdp)
    with command_scope("convert"):  # -o: never a model checkpoint; --overwrite: only an earlier convert output
        path = run(spec, recipe=recipe, overrides=overrides(set_), layout=layout, training=training, run=where,
                   log=log)
    log(f"wrote {path}")

"""``linearize generate``: stream text from a model or a hybrid (:func:`linearize.generation.stream_generate`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from ..io.sources import check_placement
from .app import app, err_console, user_errors
from .options import DEVICE, DTYPE, MAX_MEMORY_HELP, OFFLOAD_DIR_HELP


@app.command()
@user_errors
def generate(
    spec: str = typer.Argument(..., help="Model spec or hybrid checkpoint directory."),
    prompt: str = typer.Argument(..., help="The prompt."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="Tokens to generate."),
    chat: bool = typer.Option(True, "--chat/--raw", help="Apply the tokenizer's chat template when it has one."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0,
                                      help="0 (the default): greedy; above 0: sample at this temperature."),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0,
                                help="When sampling: keep the smallest set of tokens whose probability adds up to P."),
    seed: int = typer.Option(0, "--seed", help="Random seed for sampling (the same seed gives the same text)."),
    prompt_lookup: int = typer.Option(0, "--prompt-lookup", min=0, help=(
        "Speculative decoding without a second model: draft up to N tokens by matching the last tokens in the "
        "prompt, checked in one forward (greedy text unchanged; faster when the answer repeats the prompt). 0: off.")),
    dtype: Optional[str] = DTYPE,
    device: Optional[str] = DEVICE,
    max_memory: Optional[str] = typer.Option(None, "--max-memory", help=MAX_MEMORY_HELP),
    offload_dir: Optional[Path] = typer.Option(None, "--offload-dir", help=OFFLOAD_DIR_HELP),
):
    """Generate text (greedy, or sampled with --temperature), streaming tokens as they come."""
    from ..generation import stream_generate  # start-up time: torch, transformers and the model code

    if top_p == 0.0:
        raise typer.BadParameter("0 keeps no token; use a value in (0, 1]", param_hint="'--top-p'")
    mm = check_placement(device, max_memory, offload_dir)  # a bad value is one line before anything loads
    for piece in stream_generate(spec, prompt, max_new_tokens=max_new_tokens, chat=chat, dtype=dtype, device=device,
                                 temperature=temperature, top_p=top_p, seed=seed, prompt_lookup=prompt_lookup,
                                 max_memory=mm, offload_dir=offload_dir,
                                 log=lambda m: err_console.print(m, highlight=False, soft_wrap=True, markup=False)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")


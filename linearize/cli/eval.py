"""``linearize eval``: tasks on a model or hybrid, side by side with the original (:func:`linearize.evals.runner.run_eval`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..io.outputs import command_scope
from .app import app, console, err_console, user_errors
from .options import DEVICE, DTYPE, MAX_MEMORY_HELP, OFFLOAD_DIR_HELP


@app.command("eval")
@user_errors
def eval_cmd(
    spec: str = typer.Argument(..., help="Model spec or hybrid checkpoint directory to evaluate."),
    task: str = typer.Option(..., "--task", help="niah,passkey,copy,ppl,recall,agreement,speed,swapback,lm-eval:TASKS (comma-separated)."),
    against: Optional[str] = typer.Option(None, "--against", help="The original model, evaluated on identical prompts; or an earlier eval report (its original's results, taken when it ran the same grid)."),
    out: Optional[Path] = typer.Option(None, "-o", "--output", help="Report directory (default: a new eval-MODEL-TASKS-DATE-TIME per run)."),
    lengths: str = typer.Option("1K,2K,4K", "--lengths", help="Context lengths in the model's tokens, e.g. 1K,2K,4K,8K."),
    depths: str = typer.Option("5", "--depths", help="Needle depths: a count (11 = 0%,10%,...,100%) or fractions 0,0.5,1."),
    seeds: str = typer.Option("2", "--seeds", help="Samples per (length, depth) cell: a count or explicit seeds."),
    chat_template: Optional[bool] = typer.Option(None, "--chat-template/--no-chat-template", help="Use the tokenizer's chat template (default: when it has one)."),
    data: Optional[str] = typer.Option(None, "--data", help="Held-out text: wiki (default), a named corpus (books, code, docs, dialogue, chat, legal, c), a "
                                       ".txt/.jsonl file or folder, or several: ppl scores each (wiki,code,docs)."),
    batch: str = typer.Option("1", "--batch", help="Batch sizes for the speed task, e.g. 1,8."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Override each task's generation length."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier eval report (a folder eval wrote, with its .linearize-output.json); never a model checkpoint or anything else."),
    dtype: Optional[str] = DTYPE,
    device: Optional[str] = DEVICE,
    max_memory: Optional[str] = typer.Option(None, "--max-memory", help=MAX_MEMORY_HELP + " Applies to --against too."),
    offload_dir: Optional[Path] = typer.Option(None, "--offload-dir", help=OFFLOAD_DIR_HELP),
):
    """Evaluate recall, quality and speed, side by side with the original (results table on stdout)."""
    # start-up time: the eval runner imports torch and every task
    from ..evals.report import summary_table
    from ..evals.runner import EvalOptions, LoadOptions, ReportOptions, default_out_dir, run_eval

    out = out or default_out_dir(spec, task)
    options = EvalOptions(lengths=lengths, depths=depths, seeds=seeds, chat_template=chat_template, data=data,
                          batch_sizes=batch, max_new_tokens=max_new_tokens)
    load = LoadOptions(device=device, dtype=dtype, max_memory=max_memory, offload_dir=offload_dir)
    with command_scope("eval"):  # -o: never a model checkpoint; --overwrite: only an earlier eval report
        summary = run_eval(spec, task, ReportOptions(out, overwrite=overwrite, console=err_console, table=False),
                           against=against, options=options, load=load)
    console.print(summary_table(summary))
    console.print(f"wrote {out}", highlight=False)

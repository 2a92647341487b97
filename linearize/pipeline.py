"""The conversion pipeline: spec -> load -> select -> swap -> (train) -> save.

Each step is a plain function; :func:`convert` strings them together for the CLI.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from . import recipe as recipes
from .checkpoint import check_output_dir, save_checkpoint
from .data import parse_tokens
from .errors import LinearizeError
from .select import describe_layout, parse_layer_list, parse_ratio, select_layout
from .sources import load_model, resolve, resolve_dtype


def default_output_name(spec: str, ratio: str | None, softmax_layers: str | None, recipe_name: str) -> str:
    """``smollm2-135m-3to1-lolcats`` style names for ``-o``'s default."""
    name = resolve(spec).name
    layout = f"{ratio.replace(':', 'to')}" if softmax_layers is None else "custom"
    return f"{name}-{layout}-{recipe_name}"


def convert(spec: str, *, ratio: str | None = "3:1", softmax_layers: str | None = None, recipe: str = "lolcats",
            overrides: dict[str, Any] | None = None, train: bool = True, out: Path | None = None,
            overwrite: bool = False, dtype: str | None = None, device: str | None = None,
            tokens: str | int | None = None, distill_tokens: str | int | None = None,
            finetune_tokens: str | int | None = None, finetune: bool = True, loss: str | None = None,
            resume: bool = False, log: Callable[[str], None] = print) -> Path:
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
    distill_tokens, finetune_tokens = split_tokens(tokens, distill_tokens, finetune_tokens, finetune)
    if loss is not None and loss not in ("xent", "kl"):
        raise LinearizeError(f"--loss {loss!r}: expected xent or kl")
    resolved = resolve(spec)
    from transformers import AutoConfig

    from .sources import local_dir

    base_config = AutoConfig.from_pretrained(local_dir(resolved))
    layer_types = select_layout(base_config.num_hidden_layers, ratio=ratio, softmax_layers=softmax_layers)
    out = Path(out or default_output_name(spec, ratio or "3:1", softmax_layers, rec.name))
    check_output_dir(out, overwrite)
    t0 = time.time()
    model, tokenizer = load_model(spec, dtype=dtype, device=device)
    log(f"layers: {describe_layout(layer_types)}")
    from .surgery import linearize_model

    hybrid = linearize_model(model, layer_types, rec)
    t_load = time.time() - t0
    reports = {}
    if train:
        reports["distill"] = run_distill(hybrid, tokenizer, rec, out, tokens=distill_tokens, resume=resume, log=log)
        if finetune:
            hybrid, reports["finetune"] = run_finetune(hybrid, tokenizer, rec, out, tokens=finetune_tokens, loss=loss,
                                                       resume=resume, log=log)
    path = save_checkpoint(
        hybrid, tokenizer, out, base=resolved.name, recipe=rec, overwrite=overwrite, reports=reports,
        resolved={"ratio": ratio if softmax_layers is None else None, "softmax_layers": softmax_layers,
                  "layer_types": layer_types, "dtype": str(next(hybrid.parameters()).dtype).replace("torch.", ""),
                  "load_and_surgery_seconds": round(t_load, 2)},
    )
    import shutil

    shutil.rmtree(state_dir_for(out), ignore_errors=True)
    return path


def split_tokens(tokens, distill_tokens, finetune_tokens, finetune: bool = True):
    """Per-stage budgets: ``--tokens`` splits evenly across the stages that run (LoLCATs: 20M + 20M);
    ``--distill-tokens`` / ``--finetune-tokens`` set one stage; None keeps the recipe's."""
    for name, v in (("--tokens", tokens), ("--distill-tokens", distill_tokens), ("--finetune-tokens", finetune_tokens)):
        if v is not None:
            parse_tokens(v)  # one-line error for a bad budget
    if tokens is not None:
        total = parse_tokens(tokens)
        share = total // 2 if finetune else total
        distill_tokens = distill_tokens if distill_tokens is not None else share
        finetune_tokens = finetune_tokens if finetune_tokens is not None else total - share
    return distill_tokens, finetune_tokens


def run_finetune(model, tokenizer, rec, out: Path, *, tokens=None, loss=None, resume: bool = False,
                 adapter_only_dir: Path | None = None, log: Callable[[str], None] = print):
    """The LoRA stage with its state beside ``out``; returns ``(model, report)``."""
    from .finetune import finetune

    model, report = finetune(model, tokenizer, rec, state_dir=state_dir_for(out), resume=resume, tokens=tokens,
                             loss=loss, adapter_only_dir=adapter_only_dir, log=log)
    if "heldout_ppl_end" in report:
        log(f"finetune: held-out ppl {report['heldout_ppl_start']:.2f} -> {report['heldout_ppl_end']:.2f} "
            f"(teacher {report['heldout_ppl_teacher']:.2f}), {report['tokens']:,} tokens in {report['train_seconds']}s")
    return model, report


def state_dir_for(out: Path) -> Path:
    """Where resumable training state for output ``out`` lives (a hidden sibling directory)."""
    out = Path(out)
    return out.parent / f".{out.name}.state"


def run_distill(model, tokenizer, rec, out: Path, *, tokens=None, resume: bool = False,
                log: Callable[[str], None] = print) -> dict:
    """Attention transfer with its state beside ``out``; the state is removed once the output is saved."""
    from .distill import distill

    sdir = state_dir_for(out)
    if sdir.exists() and not resume:
        import shutil

        shutil.rmtree(sdir)
    report = distill(model, tokenizer, rec, state_dir=sdir, resume=resume, tokens=tokens, log=log)
    if "heldout_mse_reduction_mean" in report:
        log(f"distill: held-out attention MSE {report['heldout_mse_start_mean']:.4g} -> "
            f"{report['heldout_mse_end_mean']:.4g} (mean per-layer reduction {report['heldout_mse_reduction_mean']:.1f}x), "
            f"{report['tokens']:,} tokens in {report['train_seconds']}s")
    return report


def rerun_stage(stage: str, path: str, *, out: Path | None = None, overrides: dict[str, Any] | None = None,
                tokens=None, loss: str | None = None, adapter_only: bool = False, resume: bool = False,
                dtype: str | None = None, device: str | None = None, log: Callable[[str], None] = print) -> Path:
    """(Re)run ``"distill"`` or ``"finetune"`` on a hybrid checkpoint; write to ``out`` (default: in place).

    With ``adapter_only`` (finetune), only the LoRA adapter is written, to ``out`` (default ``PATH-adapter``).
    """
    import json
    import shutil

    from .sources import is_hybrid_dir, local_dir

    src = Path(local_dir(path))
    if not is_hybrid_dir(src):
        raise LinearizeError(f"{path}: not a linearize hybrid checkpoint; use `linearize convert {path}` first")
    rec = recipes.load(str(src / "linearize_recipe.yaml"), overrides)
    if tokens is not None:
        parse_tokens(tokens)
    if loss is not None and loss not in ("xent", "kl"):
        raise LinearizeError(f"--loss {loss!r}: expected xent or kl")
    if adapter_only:
        out = Path(out) if out is not None else src.with_name(src.name + "-adapter")
    else:
        out = Path(out) if out is not None else src
    in_place = out.resolve() == src.resolve()
    if not in_place:
        check_output_dir(out, overwrite=False)
    model, tokenizer = load_model(str(src), dtype=dtype, device=device)
    if stage == "distill":
        report = run_distill(model, tokenizer, rec, out, tokens=tokens, resume=resume, log=log)
    else:
        model, report = run_finetune(model, tokenizer, rec, out, tokens=tokens, loss=loss, resume=resume,
                                     adapter_only_dir=out if adapter_only else None, log=log)
    if adapter_only:
        shutil.rmtree(state_dir_for(out), ignore_errors=True)
        return out
    summary = json.loads((src / "report.json").read_text()) if (src / "report.json").is_file() else {}
    path_out = save_checkpoint(model, tokenizer, out, base=summary.get("base_model", path), recipe=rec,
                               overwrite=in_place, reports={**summary.get("stages", {}), stage: report})
    shutil.rmtree(state_dir_for(out), ignore_errors=True)
    return path_out

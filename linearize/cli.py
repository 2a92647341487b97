"""The ``linearize`` command line: every command is a thin wrapper over a library function."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Callable, List, Optional

import typer
from rich.table import Table

from .errors import LinearizeError
from .progress import make_console
from .settings import DEFAULT_MODEL, DEFAULT_RATIO, DEFAULT_RECIPE
from .units import format_bytes, format_length

app = typer.Typer(
    help="Convert softmax-attention LLMs into fast linear-attention hybrids.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks: kernels (vs fla and SDPA), model speed vs the original, training throughput.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

console = make_console()
err_console = make_console(stderr=True)

_DTYPE_HELP = "float32 | bfloat16 | float16 (default: float32 on CPU, bfloat16 on GPU)."
_DEVICE_HELP = "cpu | cuda | cuda:N (default: cuda when available)."
_OVERWRITE_HELP = ("Replace an earlier output of this command (a folder it wrote, with its .linearize-output.json); "
                   "never a model checkpoint or anything else.")


def _plain_flags() -> None:
    """Show on/off options as bare flags in ``--help``: this Typer prints a value type (``<bool>``) beside every
    option, flags included, which reads as if ``--no-train`` took a value."""
    try:
        from typer.core import TyperOption
    except ImportError:  # pragma: no cover - another Typer layout: its own help
        return
    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_linearize_plain_flags", False):
        return

    def display_type_rich(self, ctx):
        if getattr(self, "is_flag", False) and not getattr(self, "count", False):
            return None
        return shown(self, ctx)

    display_type_rich._linearize_plain_flags = True
    TyperOption.display_type_rich = display_type_rich


_plain_flags()


def _print_version(value: bool) -> None:
    if value:
        from . import __version__

        console.print(f"linearize {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print the version and exit.")):
    """Convert softmax-attention LLMs into fast linear-attention hybrids."""


def fail(message: str, code: int = 2) -> None:
    """Print one line on stderr and exit non-zero."""
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def user_errors(fn: Callable) -> Callable:
    """Turn errors a user can cause into one line and a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LinearizeError as e:
            fail(str(e), e.exit_code)
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130)
        except Exception as e:
            import errno

            from .train.guards import is_oom, oom_error

            if is_oom(e):  # CUDA, MemoryError or the CPU allocator: stage, layer, batch from the traceback
                fail(str(oom_error(e)), 3)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                fail(f"{e.filename or 'output'}: {e.strerror} (disk full); free some space or write elsewhere (-o)")
            if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                fail(f"{e.filename or 'file'}: {e.strerror}")
            raise

    return wrapper


def _log(message: str) -> None:
    """A progress line on stdout; under torchrun only rank 0 prints."""
    from .distributed import is_main

    if is_main():
        console.print(message, highlight=False)


def _overrides(sets: Optional[List[str]]) -> dict:
    from .recipe import parse_override

    return dict(parse_override(s) for s in (sets or []))


@app.command()
@user_errors
def convert(
    spec: str = typer.Argument(DEFAULT_MODEL, help="Model: alias, local dir, .gguf file or hub id."),
    ratio: Optional[str] = typer.Option(None, "--ratio", help=f"A:B = A linear layers per B softmax layers, repeating (default {DEFAULT_RATIO}); with --select auto only the count is kept."),
    softmax_layers: Optional[str] = typer.Option(None, "--softmax-layers", help="Explicit softmax layers, e.g. 3,7,11 (overrides --ratio and --select)."),
    select: Optional[str] = typer.Option(None, "--select", help="interleave (the --ratio pattern) or auto (probe every layer, keep the ones that matter most as softmax); default: the recipe's select.method (lolcats: auto when training)."),
    kv_budget: Optional[str] = typer.Option(None, "--kv-budget", help="Implies --select auto. BYTES@LENGTH, e.g. 2GB@32K: keep the most softmax layers whose KV cache + linear state at LENGTH tokens (batch 1) fits BYTES."),
    recipe: str = typer.Option(DEFAULT_RECIPE, "--recipe", help="Recipe name (see `linearize recipes`) or YAML path."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe field: section.field=value (repeatable)."),
    no_train: bool = typer.Option(False, "--no-train", help="Surgery only: write the untrained hybrid."),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="Training tokens, split evenly across the stages, e.g. 40M (default: the recipe's)."),
    distill_tokens: Optional[str] = typer.Option(None, "--distill-tokens", help="Attention-transfer tokens (overrides the split)."),
    finetune_tokens: Optional[str] = typer.Option(None, "--finetune-tokens", help="LoRA tokens (overrides the split)."),
    no_finetune: bool = typer.Option(False, "--no-finetune", help="Stop after attention transfer (no LoRA stage)."),
    loss: Optional[str] = typer.Option(None, "--loss", help="LoRA loss: xent (next token) or kl (to the original); default: the recipe's."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run from its last checkpoint."),
    out: Optional[Path] = typer.Option(None, "-o", "--output", help="Output directory (default: MODEL-LAYOUT-RECIPE)."),
    overwrite: bool = typer.Option(False, "--overwrite", help=_OVERWRITE_HELP),
    dtype: Optional[str] = typer.Option(None, "--dtype", help=_DTYPE_HELP),
    device: Optional[str] = typer.Option(None, "--device", help=_DEVICE_HELP),
    fsdp: bool = typer.Option(False, "--fsdp", help="Under torchrun: shard the model over the processes (FSDP2) instead of copying it to each; for models that do not fit one device."),
):
    """Convert a model into a linear-attention hybrid checkpoint."""
    from .outputs import command_scope
    from .pipeline import convert as run
    from .plan import LayoutOptions, RunOptions, TrainingOptions

    layout = LayoutOptions(ratio=ratio, softmax_layers=softmax_layers, select=select, kv_budget=kv_budget)
    training = TrainingOptions(train=not no_train, finetune=not no_finetune, tokens=tokens,
                               distill_tokens=distill_tokens, finetune_tokens=finetune_tokens, loss=loss,
                               resume=resume)
    where = RunOptions(out=out, overwrite=overwrite, dtype=dtype, device=device, fsdp=fsdp)
    with command_scope("convert"):  # -o: never a model checkpoint; --overwrite: only an earlier convert output
        path = run(spec, recipe=recipe, overrides=_overrides(set_), layout=layout, training=training, run=where,
                   log=_log)
    _log(f"wrote {path}")


@app.command()
@user_errors
def distill(
    path: str = typer.Argument(..., help="A hybrid checkpoint directory (from `linearize convert`)."),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="Token budget, e.g. 256K, 20M (default: the recipe's)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe field: section.field=value (repeatable)."),
    out: Optional[Path] = typer.Option(None, "-o", "--output", help="Write here (a new folder, outside any model checkpoint) instead of updating PATH in place."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run from its last checkpoint."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help=_DTYPE_HELP),
    device: Optional[str] = typer.Option(None, "--device", help=_DEVICE_HELP),
    fsdp: bool = typer.Option(False, "--fsdp", help="Under torchrun: shard the model over the processes (FSDP2) instead of copying it to each; for models that do not fit one device."),
):
    """(Re)run attention transfer (stage 1) on a hybrid checkpoint."""
    from .outputs import command_scope
    from .pipeline import rerun_stage

    with command_scope("distill", in_place=path):  # PATH itself is updated in place; -o never a model checkpoint
        p = rerun_stage("distill", path, out=out, overrides=_overrides(set_), tokens=tokens, resume=resume,
                        dtype=dtype, device=device, fsdp=fsdp, log=_log)
    _log(f"wrote {p}")


@app.command()
@user_errors
def finetune(
    path: str = typer.Argument(..., help="A hybrid checkpoint directory (from `linearize convert`)."),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="Token budget, e.g. 256K, 20M (default: the recipe's)."),
    loss: Optional[str] = typer.Option(None, "--loss", help="xent (next token) or kl (to the original attention)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe field: section.field=value (repeatable)."),
    adapter_only: bool = typer.Option(False, "--adapter-only", help="Write only the LoRA adapter (default PATH-adapter)."),
    out: Optional[Path] = typer.Option(None, "-o", "--output", help="Write here (a new folder, outside any model checkpoint) instead of updating PATH in place."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run from its last checkpoint."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help=_DTYPE_HELP),
    device: Optional[str] = typer.Option(None, "--device", help=_DEVICE_HELP),
    fsdp: bool = typer.Option(False, "--fsdp", help="Under torchrun: shard the model over the processes (FSDP2) instead of copying it to each; for models that do not fit one device."),
):
    """(Re)run the LoRA stage (stage 2) on a hybrid checkpoint; adapters are merged before saving."""
    from .outputs import command_scope, finish_output
    from .pipeline import rerun_stage

    # PATH itself is updated in place (an adapter never goes into it); -o is never a model checkpoint
    with command_scope("finetune", in_place=None if adapter_only else path):
        p = rerun_stage("finetune", path, out=out, overrides=_overrides(set_), tokens=tokens, loss=loss,
                        adapter_only=adapter_only, resume=resume, dtype=dtype, device=device,
                        fsdp=fsdp, log=_log)
    from .distributed import is_main

    if adapter_only and is_main():  # the adapter folder peft wrote: its marker and the usual file modes
        finish_output(p, "finetune")
    _log(f"wrote {p}")


@app.command()
@user_errors
def info(spec: str = typer.Argument(..., help="Model spec or hybrid checkpoint directory."),
         ratio: Optional[str] = typer.Option(None, "--ratio", help="Plan a conversion: show the hybrid A:B would build (no weights loaded; an alias not on this machine uses its shipped published config)."),
         softmax_layers: Optional[str] = typer.Option(None, "--softmax-layers", help="Plan a conversion with these softmax layers, e.g. 3,7,11 (overrides --ratio)."),
         recipe: Optional[str] = typer.Option(None, "--recipe", help=f"With --ratio / --softmax-layers: the recipe (default {DEFAULT_RECIPE})."),
         retrieval: Optional[str] = typer.Option(None, "--retrieval", help="LENGTHS (e.g. 1K,2K): load the original model and show, per layer, its attention from the answer position onto a hidden pass key (the layers that retrieve)."),
         dtype: Optional[str] = typer.Option(None, "--dtype", help="With --retrieval: float32, bfloat16 or float16."),
         device: Optional[str] = typer.Option(None, "--device", help="With --retrieval: cpu, cuda or cuda:N.")):
    """Show the layer map, parameter counts and cache bytes at 4K/32K/128K (of a conversion, planned with --ratio)."""
    from .info import model_info

    if retrieval is None and (dtype is not None or device is not None):
        raise LinearizeError("info: --dtype and --device only apply with --retrieval (nothing else loads weights)")
    if retrieval is not None and (ratio is not None or softmax_layers is not None):
        raise LinearizeError("info: --retrieval measures the original model; it does not combine with --ratio / "
                             "--softmax-layers")
    data = model_info(spec, ratio=ratio, softmax_layers=softmax_layers, recipe=recipe)
    console.print(f"[bold]{data['name']}[/] ({data['model_type']}, {data['num_layers']} layers)", highlight=False)
    if data.get("note"):
        console.print(data["note"], highlight=False)
    console.print(f"layers: {data['layout']}", highlight=False)
    if data.get("sliding"):
        console.print(f"sliding: {data['sliding']}", highlight=False)
    console.print(f"parameters: {data['parameters']:,} (linear-attention extras: {data['extra_parameters']:,})")
    table = Table(title="per sequence: cache + state bytes (bf16 KV, fp32 state)" + (" and speed bounds" if data.get("bounds") else ""))
    table.add_column("context")
    table.add_column("original", justify="right")
    table.add_column("hybrid", justify="right")
    table.add_column("hybrid / original", justify="right")
    bounds = data.get("bounds")
    if bounds:
        table.add_column("prefill bound", justify="right")
        table.add_column("decode bound", justify="right")
    for length, row in data["cache_bytes"].items():
        cells = [length, format_bytes(row["original"]), format_bytes(row["hybrid"]),
                 f"{row['hybrid'] / row['original']:.1%}"]
        if bounds:
            cells += [f"{bounds[length]['prefill']:.2f}x", f"{bounds[length]['decode']:.2f}x"]
        table.add_row(*cells)
    console.print(table)
    if bounds:
        console.print("bounds: hybrid / original speed at equal efficiency, batch 1 (prefill: FLOPs per token, linear "
                      "layers free; decode: weight + cache bytes read per step); `linearize bench model` measures "
                      "both", highlight=False)
    q = data.get("quality") or {}
    if "ppl" in q:
        p = q["ppl"]
        console.print(f"held-out perplexity ({p['seq_len']}-token sequences): hybrid {p['hybrid']:.2f}, teacher "
                      f"{p['teacher']:.2f} ({p['hybrid'] / p['teacher']:.3f}x)", highlight=False)
    if "copy" in q:
        c = q["copy"]
        console.print(f"recall check (copy, {c['length']} tokens, {c['samples']} samples): hybrid {100 * c['hybrid']:.1f}%, "
                      f"teacher {100 * c['teacher']:.1f}%", highlight=False)
    if "select" in q:
        from .select import describe_swap

        b = q["select"]["boundary"]
        console.print(f"softmax layers chosen by --select auto: {q['select']['softmax_layers']}; boundary: layer "
                      f"{b['kept']} kept ({b['kept_score']:.4f}), layer {b['dropped']} not ({b['dropped_score']:.4f}), "
                      f"{100 * b['relative_margin']:.1f}% apart" + (" (a close call)" if b["close_call"] else "")
                      + "".join(f"; swap check: {describe_swap(r)}" for r in q["select"]["swaps"]), highlight=False)
    if retrieval is not None:
        from .evals.common import parse_lengths
        from .info import retrieval_layers

        ret = retrieval_layers(spec, parse_lengths(retrieval), dtype=dtype, device=device)
        console.print(f"attention from the answer position onto a hidden pass key (max over heads, mean of "
                      f"{ret['prompts']} passkey prompts per length, depths 0..1):", highlight=False)
        table = Table(title="retrieval attention per layer")
        table.add_column("layer", justify="right")
        for n in ret["by_length"]:
            table.add_column(format_length(int(n)), justify="right")
        for i in range(data["num_layers"]):
            table.add_row(str(i), *[f"{v[i]:.3f}" for v in ret["by_length"].values()])
        console.print(table)
        mean = [sum(v[i] for v in ret["by_length"].values()) / len(ret["by_length"]) for i in range(data["num_layers"])]
        top = sorted(sorted(range(len(mean)), key=lambda i: -mean[i])[:4])
        console.print(f"retrieving layers (top 4 by mean): {','.join(map(str, top))}", highlight=False)


_MAX_MEMORY_HELP = ("Run a model that does not fit one device, onloading layer by layer: DEV=SIZE,... with DEV N, "
                    "cuda:N or cpu and SIZE like 40GiB, 512MB, 1.5GB (e.g. 0=40GiB,cpu=100GiB). Whole decoder layers "
                    "fill the listed devices in order, the rest stay on disk; an offloaded layer's weights move to the "
                    "first listed GPU (else the CPU) just for its forward. Excludes --device.")
_OFFLOAD_DIR_HELP = ("With --max-memory: where weights offloaded to disk may be written (a private folder, removed at "
                     "exit; default: under the linearize cache).")


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
    dtype: Optional[str] = typer.Option(None, "--dtype", help=_DTYPE_HELP),
    device: Optional[str] = typer.Option(None, "--device", help=_DEVICE_HELP),
    max_memory: Optional[str] = typer.Option(None, "--max-memory", help=_MAX_MEMORY_HELP),
    offload_dir: Optional[Path] = typer.Option(None, "--offload-dir", help=_OFFLOAD_DIR_HELP),
):
    """Generate text (greedy, or sampled with --temperature), streaming tokens as they come."""
    from .generation import stream_generate
    from .sources import check_placement

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


@app.command("eval")
@user_errors
def eval_cmd(
    spec: str = typer.Argument(..., help="Model spec or hybrid checkpoint directory to evaluate."),
    task: str = typer.Option(..., "--task", help="niah,passkey,copy,ppl,recall,agreement,speed,swapback,lm-eval:TASKS (comma-separated)."),
    against: Optional[str] = typer.Option(None, "--against", help="The original model, evaluated on identical prompts."),
    out: Optional[Path] = typer.Option(None, "-o", "--output", help="Report directory (default: a new eval-MODEL-TASKS-DATE-TIME per run)."),
    lengths: str = typer.Option("1K,2K,4K", "--lengths", help="Context lengths in the model's tokens, e.g. 1K,2K,4K,8K."),
    depths: str = typer.Option("5", "--depths", help="Needle depths: a count (11 = 0%,10%,...,100%) or fractions 0,0.5,1."),
    seeds: str = typer.Option("2", "--seeds", help="Samples per (length, depth) cell: a count or explicit seeds."),
    chat_template: Optional[bool] = typer.Option(None, "--chat-template/--no-chat-template", help="Use the tokenizer's chat template (default: when it has one)."),
    data: Optional[str] = typer.Option(None, "--data", help="Held-out text: wiki (default), books, code, docs, a "
                                       ".txt/.jsonl file or folder, or several: ppl scores each (wiki,code,docs)."),
    batch: str = typer.Option("1", "--batch", help="Batch sizes for the speed task, e.g. 1,8."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Override each task's generation length."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier eval report (a folder eval wrote, with its .linearize-output.json); never a model checkpoint or anything else."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help=_DTYPE_HELP),
    device: Optional[str] = typer.Option(None, "--device", help=_DEVICE_HELP),
    max_memory: Optional[str] = typer.Option(None, "--max-memory", help=_MAX_MEMORY_HELP + " Applies to --against too."),
    offload_dir: Optional[Path] = typer.Option(None, "--offload-dir", help=_OFFLOAD_DIR_HELP),
):
    """Evaluate recall, quality and speed, side by side with the original (results table on stdout)."""
    from .evals.report import summary_table
    from .evals.runner import EvalOptions, LoadOptions, ReportOptions, default_out_dir, run_eval
    from .outputs import command_scope

    out = out or default_out_dir(spec, task)
    options = EvalOptions(lengths=lengths, depths=depths, seeds=seeds, chat_template=chat_template, data=data,
                          batch_sizes=batch, max_new_tokens=max_new_tokens)
    load = LoadOptions(device=device, dtype=dtype, max_memory=max_memory, offload_dir=offload_dir)
    with command_scope("eval"):  # -o: never a model checkpoint; --overwrite: only an earlier eval report
        summary = run_eval(spec, task, ReportOptions(out, overwrite=overwrite, console=err_console, table=False),
                           against=against, options=options, load=load)
    console.print(summary_table(summary))
    console.print(f"wrote {out}", highlight=False)


@bench_app.command("kernels")
@user_errors
def bench_kernels_cmd(
    lengths: str = typer.Option("2K,8K,32K,128K", "--lengths", help="Sequence lengths T (B*T = --tokens)."),
    tokens: int = typer.Option(32768, "--tokens", help="Tokens per call (B = tokens / T, at least 1)."),
    heads: int = typer.Option(32, "--heads"),
    dim: int = typer.Option(128, "--dim", help="Key and value head dimension."),
    window: int = typer.Option(64, "--window", help="Window of the hybrid rows."),
    hedgehog_dim: int = typer.Option(256, "--hedgehog-dim", help="Feature dimension of the Hedgehog rows."),
    decode_batch: int = typer.Option(8, "--decode-batch", help="Batch of the decode-step rows."),
    check: str = typer.Option("full", "--check", help="Correctness check before timing: full | accuracy | none."),
    tune: bool = typer.Option(False, "--tune", help="Sweep launch configurations first."),
    tune_only: Optional[str] = typer.Option(None, "--tune-only", help="Comma-separated kernel families to sweep (implies --tune): lin_fwd, lin_fb, win_fwd, win_fb, lin_fused_fwd, win_fused_fwd, lin_step, win_step."),
    out: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the rows as JSON here."),
):
    """Time our kernels against fla and SDPA on the GPU (median of triton.testing.do_bench)."""
    import torch

    from .bench import bench_kernels, parse_families, print_table, tune_kernels
    from .evals.common import parse_lengths

    if check not in ("full", "accuracy", "none"):
        fail(f"--check {check!r}: expected full, accuracy or none")
    families = parse_families(tune_only) if tune_only is not None else None
    if not torch.cuda.is_available():
        fail("bench kernels needs a CUDA GPU (none is visible)")
    log = lambda m: err_console.print(m, highlight=False)  # noqa: E731
    if tune or families:
        tune_kernels(heads=heads, dim=dim, progress=log, families=families)
    rows = bench_kernels(out, lengths=parse_lengths(lengths), tokens=tokens, heads=heads, dim=dim, window=window,
                         hedgehog_dim=hedgehog_dim, decode_batch=decode_batch, check=check, progress=log)
    print_table(rows)


@bench_app.command("model")
@user_errors
def bench_model_cmd(
    spec: str = typer.Argument(..., help="Hybrid checkpoint dir, or a model spec converted on the fly (surgery only, untrained)."),
    against: Optional[str] = typer.Option(None, "--against", help="The original (default: SPEC itself, or the base model a hybrid names)."),
    random_weights: bool = typer.Option(False, "--random-weights", help="Random weights from a shipped config (alias, e.g. llama-3-8b) or a config.json path: nothing downloaded."),
    ratio: str = typer.Option(DEFAULT_RATIO, "--ratio", help="A:B layout of the on-the-fly conversion."),
    recipe: str = typer.Option(DEFAULT_RECIPE, "--recipe", help="Recipe of the on-the-fly conversion (name or YAML path)."),
    lengths: str = typer.Option("4K,32K,128K", "--lengths", help="Context lengths T."),
    batch: str = typer.Option("1,8", "--batch", help="Batch sizes B."),
    decode_steps: int = typer.Option(64, "--decode-steps", help="Timed single-token decode steps per row."),
    sdpa: str = typer.Option("flash,cudnn", "--sdpa", help="SDPA backends to try (the fastest is kept): flash, cudnn, efficient, math."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bfloat16 | float16 | float32 (default: bfloat16 on GPU, float32 on CPU)."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda | cuda:N | cpu (default: cuda when available)."),
    out: Optional[Path] = typer.Option(None, "-o", "--output", help="Output directory for bench_model.json (default: bench-model-NAME)."),
    profile: bool = typer.Option(False, "--profile", help="Also split a few eager decode steps per row by kernel category (matmul, softmax attention, linear attention, other)."),
):
    """Hybrid vs original: prefill and decode tokens/s, peak memory, cache + state bytes (JSON + table)."""
    from .benchmodel import RESULT_FILE, bench_model, print_result

    out = out or Path(f"bench-model-{Path(spec).stem if spec.endswith('.json') else spec.rstrip('/').split('/')[-1]}")
    result = bench_model(spec, against=against, random_weights=random_weights, ratio=ratio, recipe=recipe,
                         lengths=lengths, batches=batch, decode_steps=decode_steps, dtype=dtype, device=device,
                         sdpa=sdpa, out_dir=out, log=lambda m: err_console.print(m, highlight=False, soft_wrap=True),
                         profile=profile)
    print_result(result)
    console.print(f"wrote {out / RESULT_FILE}", highlight=False)


@bench_app.command("train")
@user_errors
def bench_train_cmd(
    spec: str = typer.Argument(..., help="Model spec, or with --random-weights a shipped config alias (llama-3-8b) or config.json path."),
    random_weights: bool = typer.Option(False, "--random-weights", help="Random weights from a shipped config: nothing downloaded."),
    ratio: str = typer.Option(DEFAULT_RATIO, "--ratio", help="A:B layout of the conversion."),
    recipe: str = typer.Option(DEFAULT_RECIPE, "--recipe", help="Recipe (name or YAML path): layers, data, losses."),
    stages: str = typer.Option("distill,finetune", "--stages", help="Stages to time: distill, finetune."),
    seq_len: int = typer.Option(2048, "--seq-len", help="Tokens per sequence."),
    batch: int = typer.Option(4, "--batch", help="Sequences per micro-batch (under torchrun: over all processes)."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step."),
    steps: int = typer.Option(10, "--steps", help="Timed steps per stage."),
    warmup_steps: int = typer.Option(2, "--warmup-steps", help="Untimed steps first (compilation, autotuning)."),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="Conversion budget to project, split evenly (default: the recipe's)."),
    tokenizer: str = typer.Option(DEFAULT_MODEL, "--tokenizer", help="Tokenizer for --random-weights (its ids must fit the vocabulary)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bfloat16 | float16 | float32 (default: bfloat16 on GPU, float32 on CPU)."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda | cuda:N | cpu (default: cuda when available)."),
    out: Path = typer.Option(Path("bench-train"), "-o", "--output", help="Output directory for bench_train.json."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe field: section.field=value (repeatable)."),
):
    """Training throughput per conversion stage and the projected conversion time (data parallel under torchrun)."""
    from .benchtrain import RESULT_FILE, bench_train, print_result

    result = bench_train(spec, random_weights=random_weights, ratio=ratio, recipe=recipe, stages=stages,
                         seq_len=seq_len, batch=batch, grad_accum=grad_accum, steps=steps, warmup=warmup_steps,
                         tokens=tokens, tokenizer=tokenizer, dtype=dtype, device=device, out_dir=out,
                         overrides=_overrides(set_), log=lambda m: err_console.print(m, highlight=False, soft_wrap=True))
    from .distributed import is_main

    if is_main():  # torchrun: rank 0 alone prints
        print_result(result, console)
        console.print(f"wrote {out / RESULT_FILE}", highlight=False)


@app.command("recipes")
@user_errors
def recipes_cmd(name: Optional[str] = typer.Argument(None, help="Show this recipe's YAML instead of the list.")):
    """List the shipped recipes, or show one."""
    from . import recipe as R

    if name is not None:
        console.print(R.find(name).read_text(), highlight=False, markup=False)
        return
    table = Table(title="recipes")
    table.add_column("name")
    table.add_column("feature map")
    table.add_column("window")
    table.add_column("description")
    for n in R.available():
        r = R.load(n)
        table.add_row(n, r["attention"]["feature_map"], str(r["attention"]["window"]), r[""]["description"])
    console.print(table)


def main() -> None:
    """Console-script entry point."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    sys.exit(run_app())


def _kind(e: BaseException, name: str) -> bool:
    """Whether ``e`` is a click exception called ``name`` (click itself or the copy newer typer vendors)."""
    return any(c.__name__ == name for c in type(e).__mro__)


def run_app(args: Optional[List[str]] = None) -> int:
    """Run the CLI; a usage error (unknown option, bad value, missing argument) is one line, exit 2."""
    from rich.markup import escape

    try:
        code = app(args=args, standalone_mode=False)
    except Exception as e:  # click's exceptions, matched by name (see _kind)
        if _kind(e, "NoArgsIsHelpError"):
            e.show()  # a bare command prints its help
            return e.exit_code
        if _kind(e, "UsageError"):
            ctx = getattr(e, "ctx", None)
            where = " ".join(["linearize", *ctx.command_path.split()[1:]]) if ctx is not None else "linearize"
            err_console.print(f"[bold red]error:[/] {escape(e.format_message())} (see `{where} --help`)",
                              highlight=False, soft_wrap=True)
            return 2
        if _kind(e, "Abort"):
            err_console.print("interrupted")
            return 130
        raise
    return code if isinstance(code, int) else 0

if __name__ == "__main__":
    main()

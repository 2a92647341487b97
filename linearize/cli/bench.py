"""``linearize bench kernels | model | train``: kernel timings, hybrid vs original model speed, training
throughput (:mod:`linearize.bench`, :mod:`linearize.bench.model`, :mod:`linearize.bench.train`)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..settings import DEFAULT_MODEL, DEFAULT_RATIO, DEFAULT_RECIPE
from .app import bench_app, console, err_console, fail, user_errors
from .options import BENCH_DEVICE, BENCH_DTYPE, FSDP, SET, overrides


@bench_app.command("kernels")
@user_errors
def bench_kernels_cmd(
    lengths: Optional[str] = typer.Option(None, "--lengths", help="Sequence lengths T (default 2K,8K,32K; with --full 2K,8K,32K,128K); B*T = --tokens."),
    tokens: int = typer.Option(32768, "--tokens", help="Tokens per call (B = tokens / T, at least 1)."),
    heads: int = typer.Option(32, "--heads"),
    dim: int = typer.Option(128, "--dim", help="Key and value head dimension."),
    window: int = typer.Option(64, "--window", help="Window of the hybrid rows."),
    hedgehog_dim: int = typer.Option(256, "--hedgehog-dim", help="Feature dimension of the Hedgehog rows."),
    decode_batch: int = typer.Option(8, "--decode-batch", help="Batch of the decode-step rows."),
    check: str = typer.Option("quick", "--check", help="quick: each kernel once, at the first shape it is timed at, against the PyTorch path (output; gradients for fwd+bwd) | accuracy: quick, then long-sequence accuracy | full: quick, then every variant in fp32 and bf16 | none."),
    gated: bool = typer.Option(False, "--gated", help="Add the gated rows: our log_decay kernels vs fla's chunk_simple_gla and chunk_gla (fla autotunes their kernels: minutes on a fresh machine)."),
    delta: bool = typer.Option(False, "--delta", help="Add the gated delta rule rows: our gated_delta_rule (fwd, fwd+bwd) and decode step vs fla's chunk_gated_delta_rule and fused_recurrent_gated_delta_rule (fla autotunes its kernels)."),
    hedgehog: bool = typer.Option(False, "--hedgehog", help="Add the Hedgehog rows: features of --hedgehog-dim, and the forwards that compute the features in the kernel."),
    full: bool = typer.Option(False, "--full", help="Every row: 128K, --gated, --delta, --hedgehog and the unnormalised forwards."),
    fla: bool = typer.Option(True, "--fla/--no-fla", help="Time fla's kernels beside ours where fla is installed (their first call autotunes)."),
    tune: bool = typer.Option(False, "--tune", help="Sweep launch configurations first (long; without it the shipped or saved configuration is timed)."),
    tune_only: Optional[str] = typer.Option(None, "--tune-only", help="Comma-separated kernel families to sweep (implies --tune): lin_fwd, lin_fb, win_fwd, win_fb, lin_fused_fwd, win_fused_fwd, lin_step, win_step."),
    out: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the rows as JSON here (rewritten after every row)."),
):
    """Time our kernels against fla and SDPA on the GPU, one row at a time (median of triton.testing.do_bench)."""
    # start-up time: torch, Triton and the kernels
    import torch

    from ..bench.kernels import (CHECK_MODES, DEFAULT_LENGTHS, FULL_LENGTHS, bench_kernels, parse_families,
                                 parse_lengths, print_table, row_groups, tune_kernels)

    if check not in CHECK_MODES:
        fail(f"--check {check!r}: expected {', '.join(CHECK_MODES)}")
    for name, value in (("--tokens", tokens), ("--heads", heads), ("--dim", dim), ("--window", window),
                        ("--hedgehog-dim", hedgehog_dim), ("--decode-batch", decode_batch)):
        if value < 1:
            fail(f"{name} {value}: expected a positive whole number")
    Ts = parse_lengths(lengths) if lengths is not None else list(FULL_LENGTHS if full else DEFAULT_LENGTHS)
    families = parse_families(tune_only) if tune_only is not None else None
    if not torch.cuda.is_available():
        fail("bench kernels needs a CUDA GPU (none is visible)")
    log = lambda m: err_console.print(m, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    if tune or families:
        tune_kernels(heads=heads, dim=dim, progress=log, families=families)
    rows = bench_kernels(out, lengths=Ts, tokens=tokens, heads=heads, dim=dim, window=window,
                         hedgehog_dim=hedgehog_dim, decode_batch=decode_batch, check=check,
                         groups=row_groups(gated=gated, hedgehog=hedgehog, delta=delta, full=full, fla=fla), progress=log)
    print_table(rows)
    if out is not None:
        console.print(f"wrote {out}", highlight=False)


@bench_app.command("model")
@user_errors
def bench_model_cmd(
    spec: str = typer.Argument(..., help="Hybrid checkpoint dir, or a model spec converted on the fly (surgery only, untrained)."),
    against: Optional[str] = typer.Option(None, "--against", help="The original (default: SPEC itself, or the base model a hybrid names)."),
    random_weights: bool = typer.Option(False, "--random-weights", help="Random weights from a shipped config (alias, e.g. llama-3-8b) or a config.json path: nothing downloaded."),
    ratio: str = typer.Option(DEFAULT_RATIO, "--ratio", help="A:B layout of the on-the-fly conversion, or a comma list (3:1,7:1): one original run, one table per layout."),
    recipe: str = typer.Option(DEFAULT_RECIPE, "--recipe", help="Recipe of the on-the-fly conversion (name or YAML path)."),
    lengths: str = typer.Option("4K,32K,128K", "--lengths", help="Context lengths T."),
    batch: str = typer.Option("1,8", "--batch", help="Batch sizes B."),
    decode_steps: int = typer.Option(64, "--decode-steps", help="Timed single-token decode steps per row."),
    sdpa: str = typer.Option("flash,cudnn", "--sdpa", help="SDPA backends to try (the fastest is kept): flash, cudnn, efficient, math."),
    dtype: Optional[str] = BENCH_DTYPE,
    device: Optional[str] = BENCH_DEVICE,
    out: Optional[Path] = typer.Option(None, "-o", "--output", help="Output directory for bench_model.json (default: bench-model-NAME)."),
    profile: bool = typer.Option(False, "--profile", help="Also split a few eager decode steps per row by kernel category (matmul, softmax attention, linear attention, other)."),
    prefill_chunk: Optional[int] = typer.Option(None, "--prefill-chunk", help="Tokens per piece of the hybrids' chunked prefill, all rows together, for this run (default: their config's, 131072; 0: one whole forward)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override an attention.* field of the recipe for the on-the-fly conversion, e.g. attention.window=2048 (repeatable)."),
):
    """Hybrid vs original: prefill and decode tokens/s, peak memory, cache + state bytes (JSON + table)."""
    from ..bench.model import RESULT_FILE, bench_model, print_result  # start-up time: torch and transformers

    out = out or Path(f"bench-model-{Path(spec).stem if spec.endswith('.json') else spec.rstrip('/').split('/')[-1]}")
    result = bench_model(spec, against=against, random_weights=random_weights, ratio=ratio, recipe=recipe,
                         lengths=lengths, batches=batch, decode_steps=decode_steps, dtype=dtype, device=device,
                         sdpa=sdpa, out_dir=out, log=lambda m: err_console.print(m, highlight=False, soft_wrap=True),
                         profile=profile, prefill_chunk=prefill_chunk, overrides=overrides(set_))
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
    dtype: Optional[str] = BENCH_DTYPE,
    device: Optional[str] = BENCH_DEVICE,
    out: Path = typer.Option(Path("bench-train"), "-o", "--output", help="Output directory for bench_train.json."),
    set_: Optional[List[str]] = SET,
    fsdp: bool = FSDP,
):
    """Training throughput per conversion stage and the projected conversion time (data parallel under torchrun;
    sharded with --fsdp)."""
    # start-up time: torch, transformers and the training stages
    from ..bench.train import RESULT_FILE, bench_train, print_result
    from ..distributed import is_main

    result = bench_train(spec, random_weights=random_weights, ratio=ratio, recipe=recipe, stages=stages,
                         seq_len=seq_len, batch=batch, grad_accum=grad_accum, steps=steps, warmup=warmup_steps,
                         tokens=tokens, tokenizer=tokenizer, dtype=dtype, device=device, out_dir=out,
                         overrides=overrides(set_), fsdp=fsdp,
                         log=lambda m: err_console.print(m, highlight=False, soft_wrap=True))
    if is_main():  # torchrun: rank 0 alone prints
        print_result(result, console)
        console.print(f"wrote {out / RESULT_FILE}", highlight=False)


"""`linearize bench train`: how fast each conversion stage trains, and what a whole conversion would cost.

The model is built as `bench model` builds it (a shipped published config with ``--random-weights``: nothing
downloaded; or any model spec), converted with surgery only, and each stage's own training loop
(:func:`linearize.train.distill.distill`, :func:`linearize.train.finetune.finetune`) runs first ``warmup`` steps (Triton
compilation, autotuning, allocator growth) and then ``steps`` timed steps of ``batch x seq_len`` tokens on the
recipe's data. With random weights the text is tokenized by ``tokenizer`` (default: the embedded SmolLM2
tokenizer, whose ids fit any larger vocabulary): which tokens flow does not change the speed.

Per stage the result holds tokens/s and seconds per step of the timed run (its own training time, without the
held-out evaluation around it), the peak GPU memory, and from them the projected wall time of a conversion
with ``tokens`` split evenly across the stages (or the recipe's budgets): the figure a conversion plan needs
(a 40M-token conversion of an 8B model in at most one hour of one H200).

Under ``torchrun`` the stages train data parallel as ``convert`` does (:mod:`linearize.distributed`): ``batch``
is the global micro-batch, split by rows over the processes, tokens/s are global, the peak memory is rank 0's
and the target is judged on GPU-hours (wall time x processes). Rank 0 alone prints and writes. With ``fsdp``
(``--fsdp``) the model is sharded over the processes as ``convert --fsdp`` shards it (:mod:`linearize.train.fsdp`:
rank 0 builds it on the CPU and does the surgery, every rank keeps its shards): the way to time a model that
does not fit one device; each row then also holds tokens/s per GPU.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
from rich.table import Table
from transformers import AutoTokenizer

from .. import distributed as dist
from .. import recipe as recipes
from ..convert.selection import describe_layout, select_layout
from ..convert.surgery import linearize_model
from ..errors import LinearizeError, ResourceError, SpecError
from ..io.checkpoint import check_output_dir
from ..io.sources import check_device, load_model, local_dir, resolve, resolve_dtype
from ..progress import make_console
from ..settings import DEFAULT_MODEL, DEFAULT_RATIO, DEFAULT_RECIPE
from ..train.distill import distill
from ..train import fsdp as sharding
from ..train.finetune import finetune
from ..units import format_tokens, parse_tokens
from .model import _versions, _write, load_config, random_model

RESULT_FILE = "bench_train.json"
STAGES = ("distill", "finetune")
#: the conversion goal: 40M tokens (20M + 20M) within one hour of one GPU
TARGET_TOKENS, TARGET_SECONDS = 40_000_000, 3600.0


def parse_stages(value: str) -> list[str]:
    """``"distill,finetune"`` -> ``["distill", "finetune"]`` in pipeline order."""
    names = [v.strip() for v in str(value).split(",") if v.strip()]
    bad = [n for n in names if n not in STAGES]
    if not names or bad:
        raise LinearizeError(f"--stages {value!r}: expected a comma list of {', '.join(STAGES)}")
    return [s for s in STAGES if s in names]


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LinearizeError(f"{name} {value!r}: expected a whole number >= 1")
    return value


def _build(spec: str, *, random_weights: bool, tokenizer: str, dtype, device):
    """``(model, tokenizer, name)``; random weights come with ``tokenizer``'s tokenizer."""
    if not random_weights:
        model, tok = load_model(spec, dtype=dtype, device=device)
        return model, tok, model.linearize_source.name

    config, name = load_config(spec)
    if config.model_type == "linearize":
        raise SpecError(f"{spec}: a hybrid config; bench train needs the original model's config")
    tok = AutoTokenizer.from_pretrained(local_dir(resolve(tokenizer)))
    if len(tok) > config.vocab_size:
        raise SpecError(f"--tokenizer {tokenizer}: its {len(tok):,} tokens do not fit {name}'s vocabulary of "
                        f"{config.vocab_size:,}; pass a tokenizer with at most that many")
    return random_model(config, dtype=dtype, device=device), tok, f"{name} (random weights)"


def _stage_recipe(rec, stage: str, *, seq_len: int, batch: int, tokens: int, grad_accum: int = 1):
    return rec.with_overrides({f"{stage}.seq_len": seq_len, f"{stage}.batch_size": batch,
                               f"{stage}.grad_accum": grad_accum, f"{stage}.tokens": tokens, f"{stage}.eval_seqs": 1,
                               f"{stage}.checkpoint_every": 1_000_000, f"{stage}.warmup_steps": 0})


def _run_stage(model, tok, rec, stage: str, tokens: int, quiet: Callable[[str], None]) -> tuple[Any, dict]:
    if stage == "distill":
        return model, distill(model, tok, rec, state_dir=None, tokens=tokens, progress=False, log=quiet)

    return finetune(model, tok, rec, state_dir=None, tokens=tokens, progress=False, log=quiet)


def bench_train(spec: str, *, random_weights: bool = False, ratio: str = DEFAULT_RATIO, recipe: str = DEFAULT_RECIPE,
                stages: str = "distill,finetune", seq_len: int = 2048, batch: int = 4, grad_accum: int = 1,
                steps: int = 10, warmup: int = 2, tokens: str | int | None = None, tokenizer: str = DEFAULT_MODEL,
                dtype: str | None = None, device: str | None = None, out_dir: Path | str = "bench-train",
                overrides: dict | None = None, fsdp: bool = False, log: Callable[[str], None] = print) -> dict:
    """Time ``steps`` training steps of each stage after ``warmup`` steps; write ``out_dir/bench_train.json``.
    ``overrides`` (``--set``) change recipe fields; the timing options above take precedence over them; ``fsdp``
    (under torchrun) shards the model over the processes instead of copying it to each."""
    names = parse_stages(stages)
    seq_len, batch, steps = _positive("--seq-len", seq_len), _positive("--batch", batch), _positive("--steps", steps)
    grad_accum = _positive("--grad-accum", grad_accum)
    warmup = _positive("--warmup-steps", warmup)
    total = parse_tokens(tokens) if tokens is not None else None
    rec = recipes.load(recipe, overrides or None)
    check_device(device)
    if fsdp:
        sharding.check_options(train=True)
    if batch % dist.world_size():  # torchrun: the global batch is split by rows
        raise LinearizeError(f"--batch {batch} cannot be split over {dist.world_size()} torchrun processes; use a "
                             f"multiple of {dist.world_size()}")
    device = dist.init(device)  # torchrun: join the process group; this rank's device
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    main = dist.is_main()
    if not main:
        log = lambda m: None  # noqa: E731 - rank 0 alone prints
    dt = resolve_dtype(dtype, dev)
    out_dir = Path(out_dir)
    if main:
        check_output_dir(out_dir, overwrite=True)

    def build(device, dtype):  # -> (model, (tokenizer, name))
        model, tok, name = _build(spec, random_weights=random_weights, tokenizer=tokenizer, dtype=dtype, device=device)
        return model, (tok, name)

    def convert(model):
        return linearize_model(model, select_layout(model.config.num_hidden_layers, ratio=ratio), rec)

    if fsdp:  # rank 0 builds the model on the CPU and converts it; every rank keeps only its shards
        hybrid, (tok, name) = sharding.build_and_shard(lambda: build(*sharding.load_device(device, dtype)), device,
                                                       prepare=convert, log=log)
    else:
        model, (tok, name) = build(dev, dt)
        hybrid = convert(model)
    layer_types = list(hybrid.config.hybrid_layer_types)
    n = sum(p.numel() for p in hybrid.parameters())
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    log(f"{name}: {describe_layout(layer_types)}, {size} parameters, {str(dt).replace('torch.', '')} on {dev}")
    result: dict[str, Any] = {
        "model": name, "recipe": rec.name, "overrides": dict(overrides or {}),
        "layout": describe_layout(layer_types), "device": str(dev),
        "dtype": str(dt).replace("torch.", ""), "seq_len": seq_len, "batch": batch, "grad_accum": grad_accum,
        "steps": steps, "warmup_steps": warmup, "world_size": dist.world_size(), "fsdp": bool(fsdp),
        "versions": _versions(),
        "date": time.strftime("%Y-%m-%d"), "stages": {},
    }
    step_tokens = seq_len * batch * grad_accum  # one optimizer step
    quiet = lambda m: None  # noqa: E731 - the stages' own progress lines would drown the table

    def run(stage: str, n_steps: int):
        tokens = n_steps * step_tokens
        srec = _stage_recipe(rec, stage, seq_len=seq_len, batch=batch, tokens=tokens, grad_accum=grad_accum)
        return _run_stage(hybrid, tok, srec, stage, tokens, quiet)

    for stage in names:
        row: dict[str, Any] = {"status": "ok"}
        try:
            hybrid, _ = run(stage, warmup)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            hybrid, rep = run(stage, steps)
            tps = float(rep["tokens_per_second"])  # from the unrounded training time of the timed run
            row.update({"tokens": int(rep["tokens"]), "train_seconds": rep["train_seconds"],
                        "tokens_per_second": tps, "tokens_per_second_per_gpu": tps / dist.world_size(),
                        "seconds_per_step": round(step_tokens / max(tps, 1e-9), 4),
                        # the timed steps' global losses: a run on N GPUs should log the 1-GPU run's
                        "losses": [h["loss"] for h in rep.get("history", [])],
                        # > 1: each micro-batch ran as that many passes to fit memory (linearize.train.memory)
                        "passes_per_micro_batch": rep.get("passes_per_micro_batch", 1),
                        "activation_checkpointing": bool(rep.get("activation_checkpointing", False))})
            if dev.type == "cuda":
                row["peak_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
            if stage == "finetune":
                row["loss"] = rep.get("loss")
        except ResourceError as e:
            if dist.world_size() > 1:
                raise  # the other ranks wait in a collective: end them all (torchrun stops the group)
            row = {"status": "oom", "note": str(e)}
        result["stages"][stage] = row
        if row["status"] == "ok":
            log(f"{stage}: {row['tokens_per_second']:,.0f} tokens/s ({row['seconds_per_step']} s/step"
                + (f", peak {row['peak_gib']} GiB" if "peak_gib" in row else "")
                + (f", {row['passes_per_micro_batch']} passes per micro-batch to fit memory"
                   if row.get("passes_per_micro_batch", 1) > 1 else "")
                + (", activation checkpointing" if row.get("activation_checkpointing") else "") + ")")
        else:  # the out-of-memory line names its stage already
            log(row["note"] if row["note"].startswith(f"{stage}:") else f"{stage}: {row['note']}")
        if main:
            _write_result(out_dir, result)
    result["projection"] = project(result["stages"], rec, total, processes=dist.world_size())
    if main:
        _write_result(out_dir, result)
    return result


def project(rows: dict[str, dict], rec, total: int | None, processes: int = 1) -> dict:
    """Projected seconds of a conversion: each stage's budget over its measured tokens/s (global over
    ``processes`` GPUs, whose GPU-hours the target counts)."""
    if total is not None:
        budgets = {"distill": total // 2, "finetune": total - total // 2}
    else:
        budgets = {s: parse_tokens(rec[s]["tokens"]) for s in STAGES}
    out: dict[str, Any] = {"budgets": budgets}
    if all(rows.get(s, {}).get("status") == "ok" for s in STAGES):
        secs = {s: budgets[s] / rows[s]["tokens_per_second"] for s in STAGES}
        out["seconds"] = {s: round(v, 1) for s, v in secs.items()}
        out["total_seconds"] = round(sum(secs.values()), 1)
        out["gpu_seconds"] = round(out["total_seconds"] * processes, 1)
        if sum(budgets.values()) == TARGET_TOKENS:
            out["target"] = {"what": "a 40M-token conversion in <= 1 hour of one GPU",
                             "met": out["gpu_seconds"] <= TARGET_SECONDS}
    return out


def _write_result(out_dir: Path, result: dict) -> None:
    """Rewritten after every stage, so a run cut short keeps what it measured."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(out_dir / RESULT_FILE, result)


def print_result(result: dict, console=None) -> None:
    """A table of the stages and the projected conversion time."""
    console = console or make_console()
    shape = f"batch {result['batch']} x {result['seq_len']}"
    if result.get("grad_accum", 1) > 1:
        shape += f" x {result['grad_accum']} micro-batches"
    per_gpu = result.get("world_size", 1) > 1
    if per_gpu:
        shape += f" over {result['world_size']} processes" + (", sharded (FSDP)" if result.get("fsdp") else "")
    table = Table(title=f"bench train: {result['model']} | {result['layout']} | {result['dtype']} on "
                        f"{result['versions'].get('gpu', result['device'])} | {shape}")
    cols = ("stage", "tokens/s", *(("tokens/s per GPU",) if per_gpu else ()), "s/step", "peak GiB", "projected")
    for col in cols:
        table.add_column(col, justify="right" if col != "stage" else "left")
    proj = result.get("projection", {})
    for stage, row in result["stages"].items():
        if row["status"] != "ok":
            table.add_row(stage, "oom", *[""] * (len(cols) - 2))
            continue
        p = proj.get("seconds", {}).get(stage)
        gpu = (f"{row['tokens_per_second_per_gpu']:,.0f}",) if per_gpu else ()
        table.add_row(stage, f"{row['tokens_per_second']:,.0f}", *gpu, f"{row['seconds_per_step']:.3f}",
                      str(row.get("peak_gib", "n/a")),
                      f"{format_tokens(proj['budgets'][stage])} tokens: {p / 60:.1f} min" if p else "")
    console.print(table)
    if "total_seconds" in proj:
        line = f"projected conversion: {format_tokens(sum(proj['budgets'].values()))} tokens in {proj['total_seconds'] / 60:.1f} min"
        if result.get("world_size", 1) > 1:
            line += f" ({proj['gpu_seconds'] / 3600:.2f} GPU-hours)"
        if "target" in proj:
            line += f" ({'meets' if proj['target']['met'] else 'misses'} the 1-hour target)"
        console.print(line, highlight=False)

"""The conversion pipeline: spec -> load -> select -> swap -> (train) -> save.

Each step is a plain function; :func:`convert` builds the conversion's plan (:mod:`linearize.convert.plan`) and runs it
through them, for the CLI.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from .. import distributed as dist
from .. import recipe as recipes
from ..data.checks import check_text_files, check_training_source
from ..errors import DataError, LinearizeError
from ..evals import copyspan, passkey, stats
from ..evals.common import EvalError
from ..evals.copyspan import POOL_TOKENS
from ..evals.corpus import heldout_stream
from ..io.checkpoint import check_output_dir, save_checkpoint, verify_checkpoint
from ..io.outputs import is_hybrid_dir
from ..io.sources import check_device, load_model, local_dir, resolve
from ..model.layout import training_width, widest_window
from ..settings import DEFAULT_MODEL, DEFAULT_RECIPE
from ..train import fsdp as sharding  # the module (a rerun's `fsdp` is its flag)
from ..train.distill import STATE_FILE as DISTILL_STATE
from ..train.distill import distill
from ..train.finetune import STATE_FILE, finetune
from ..train.loop import resume_refusal, saved_settings, stage_settings
from ..units import parse_tokens
from .plan import (AutoSelect, LayoutOptions, RunOptions, TrainingOptions, build_plan, check_context,
                   load_recipe)
from .probe import apply_feature_maps, run_probe, score_weights, seats_for, select_report, swap_check
from .selection import (SEAT_KINDS, choose_softmax_layers, describe_layout, layout_from_softmax_layers,
                        rank_layers, seated, selection_boundary, softmax_indices)


def convert(spec: str = DEFAULT_MODEL, *, recipe: str = DEFAULT_RECIPE, overrides: dict[str, Any] | None = None,
            layout: LayoutOptions = LayoutOptions(), training: TrainingOptions = TrainingOptions(),
            run: RunOptions = RunOptions(), log: Callable[[str], None] = print) -> Path:
    """Convert ``spec`` into a hybrid checkpoint; returns its path (``run.out``, default ``MODEL-LAYOUT-RECIPE``).

    ``layout``: ``ratio`` (default 3:1) gives the interleave pattern, or with ``select="auto"`` only the number
    of softmax layers; ``kv_budget`` (``BYTES@LENGTH``, auto only) gives that number from a cache budget
    instead. ``softmax_layers`` overrides both. ``select=None`` takes the recipe's ``select.method``
    (lolcats: auto) where auto can run: training, not ``fsdp``, a count strictly between 0 and every
    layer, a budget the probe fits, scoring (forward tokens) no larger than the training budget;
    interleave otherwise. Everything the user can get wrong is checked before the model is loaded
    (:func:`linearize.convert.plan.build_plan`), so a bad call writes nothing. ``run.fsdp`` (under torchrun) shards the
    model over the ranks with FSDP2 instead of replicating it (:mod:`linearize.train.fsdp`).
    """
    plan = build_plan(spec, recipe=recipe, overrides=overrides, layout=layout, training=training, run=run, log=log)
    rec, config = plan.recipe, plan.base_config
    if plan.train:  # data, recall text, batch over ranks, --resume settings: before the model loads
        recall_stage = rec["finetune" if plan.finetune else "distill"]
        check_before_loading(rec, plan.tokens, source=plan.source_dir, out=plan.out, resume=plan.resume,
                             loss=plan.loss, layer_types=plan.layer_types, attention=dict(rec["attention"]),
                             recall={"data": recall_stage["data"],
                                     "length": RecallCheck.length_for(recall_stage, config)},
                             probe=plan.auto is not None)
    device = dist.init(plan.device)  # torchrun: join the process group; this rank's device
    t0 = time.time()
    # start-up time: the model code imports transformers; a bad spec is one line before it loads
    from .surgery import linearize_model

    layer_types = plan.layer_types
    if plan.fsdp:  # rank 0 loads and converts the model, every rank keeps only its shards (linearize.train.fsdp)
        hybrid, tokenizer = sharding.load_and_shard(plan.source, device, plan.dtype, log=log,
                                           prepare=lambda m: linearize_model(m, layer_types, rec))
        model = None
    else:
        model, tokenizer = load_model(plan.source, dtype=plan.dtype, device=device)
    reports = {}
    probe = swaps = None
    if plan.auto is not None:
        count = plan.auto.count
        log(f"select: auto, {count} softmax layer{'' if count == 1 else 's'} of {config.num_hidden_layers} "
            f"(from {plan.auto.count_from})")
        layer_types, probe, swaps = run_auto_select(model, tokenizer, rec, plan.auto, log=log)
        layer_types = dist.broadcast_object(layer_types)  # torchrun: every rank takes rank 0's choice
    log(f"layers: {describe_layout(layer_types)}")
    trained, tuned = training_width(rec["attention"]), training_width(rec["attention"], rec["finetune"])
    if plan.train and (trained or tuned):
        served = rec["attention"]["window"]
        log(f"windows: the windowed layers train at {trained or served} tokens"
            + (f" (stage 2 at {tuned or served})" if tuned != trained else "") + f" and serve at {served}"
            + (f" (layers {rec['attention']['layer_windows']})" if rec["attention"]["layer_windows"] else ""))
    if not plan.fsdp:
        hybrid = linearize_model(model, layer_types, rec)
    distill_tokens = plan.tokens["distill"]
    if plan.auto is not None:
        reports["select"] = auto_report(hybrid, rec, plan.auto, probe, swaps, train=plan.train, log=log)
        if probe is not None and plan.train:
            distill_tokens = plan.auto.stage1_tokens - probe.tokens  # the probe's tokens are part of stage 1
    t_load = time.time() - t0
    if plan.train:
        recall = RecallCheck.measure(hybrid, tokenizer, rec, finetune=plan.finetune, log=log)  # the teacher first
        reports["distill"] = run_distill(hybrid, tokenizer, rec, plan.out, tokens=distill_tokens,
                                         resume=plan.resume, log=log)
        if plan.finetune:
            hybrid, reports["finetune"] = run_finetune(hybrid, tokenizer, rec, plan.out,
                                                       tokens=plan.tokens["finetune"], loss=plan.loss,
                                                       resume=plan.resume, log=log)
        reports["recall"] = recall.finish(hybrid)
        if probe is not None:  # the share as run: probe / (probe + stage 1 + stage 2)
            sel = reports["select"]
            sel["total_tokens"] = probe.tokens + sum(int(reports[s].get("tokens", 0)) for s in ("distill", "finetune")
                                                     if s in reports)
            sel["probe_share_of_total_tokens"] = round(probe.tokens / max(1, sel["total_tokens"]), 4)
    full = _gather(hybrid)  # --fsdp: the full weights on rank 0 (every rank takes part); None otherwise
    if dist.is_main():  # torchrun: every rank holds the same weights; rank 0 writes, the others wait
        dtype_name = str(next(hybrid.parameters()).dtype).replace("torch.", "")
        save_checkpoint(
            hybrid, tokenizer, plan.out, base=plan.source.name, recipe=rec, overwrite=plan.overwrite,
            reports=reports, state_dict=full,
            resolved={**plan.layout.recorded(), "layer_types": layer_types, "dtype": dtype_name,
                      "load_and_surgery_seconds": round(t_load, 2)},
        )

        shutil.rmtree(state_dir_for(plan.out), ignore_errors=True)
    dist.barrier()
    return plan.out


def _gather(model):
    """The full state dict of an FSDP-sharded model on rank 0 (``{}`` elsewhere); None for an unsharded one."""
    return sharding.full_state_dict(model) if sharding.is_sharded(model) else None


class RecallCheck:
    """The conversion's built-in recall check, run on the teacher (the hybrid with its softmax attention, before
    any training) and on the result with the same samples, at the last stage's sequence length (at most 2,048 and
    the model's context): ``eval``'s ``copy`` task (a held-out span repeated at the end of the sequence, share of
    its tokens predicted exactly; 12 samples) and its ``passkey`` task (10 prompts at five depths, the key read
    off the model's argmax: :func:`linearize.evals.passkey.quick_check`). The two can part: training on other
    text has kept copying and lost the passkey. Its report goes into report.json and the card."""

    MAX_LENGTH = 2048

    def __init__(self, tokenizer, *, length: int, data: str, teacher: dict[str, Any], span: int | None = None,
                 teacher_passkey: dict[str, Any] | None = None, seconds: float = 0.0,
                 log: Callable[[str], None] = print):
        self.tokenizer, self.length, self.data, self.teacher = tokenizer, length, data, teacher
        self.teacher_passkey = teacher_passkey
        self.span, self.seconds, self.log = span, seconds, log

    @classmethod
    def measure(cls, hybrid, tokenizer, rec, *, finetune: bool, log: Callable[[str], None]) -> RecallCheck:
        """Score the teacher now: the hybrid in softmax mode, before any training changes its projections."""
        stage = rec["finetune"] if finetune else rec["distill"]
        length = cls.length_for(stage, hybrid.config)
        t = time.time()
        hybrid.set_attention_mode("softmax")
        try:
            teacher = copyspan.quick_check(hybrid, tokenizer, length=length, data=stage["data"])
            teacher_passkey = passkey.quick_check(hybrid, tokenizer, length=length)
        finally:
            hybrid.set_attention_mode("linear")
        return cls(tokenizer, length=length, data=stage["data"], teacher=teacher, teacher_passkey=teacher_passkey,
                   seconds=time.time() - t, log=log)

    @classmethod
    def length_for(cls, stage: dict[str, Any], config) -> int:
        """The check's length for a stage's settings and the model's config (no weights needed)."""
        limit = getattr(config, "max_position_embeddings", None) or cls.MAX_LENGTH
        return min(int(stage["seq_len"]), cls.MAX_LENGTH, int(limit))

    @classmethod
    def from_report(cls, report: dict[str, Any], tokenizer, *, log: Callable[[str], None]) -> RecallCheck:
        """A check whose teacher scores come from an earlier report (a rerun of a stage on a checkpoint whose
        projections may already hold merged adapters, so its softmax mode is no longer the teacher); a report
        without a passkey part (written before it existed) gives a check without one."""
        pk = report.get("passkey") or {}
        return cls(tokenizer, length=report["length"], data=report["data"], span=report["span"], log=log,
                   teacher={"score": report["teacher"], "strict": report["teacher_strict"]},
                   teacher_passkey=({"score": pk["teacher"], "found": pk.get("teacher_found")} if "teacher" in pk
                                    else None))

    def finish(self, hybrid) -> dict[str, Any]:
        """Score the trained hybrid and return the report (``teacher`` / ``hybrid`` copy scores; ``passkey``: the
        passkey part's, or why it was skipped)."""
        if "skipped" in self.teacher:
            return dict(self.teacher)

        t = time.time()
        extra = {"span": self.span} if self.span else {}
        result = copyspan.quick_check(hybrid, self.tokenizer, length=self.length, data=self.data, **extra)
        rep = {"task": "copy", "length": self.length, "span": result["span"], "samples": result["samples"],
               "data": result["data"], "teacher": self.teacher["score"], "hybrid": result["score"],
               "teacher_strict": self.teacher["strict"], "hybrid_strict": result["strict"]}
        self.log(f"recall check (copy, {self.length} tokens, {rep['samples']} held-out samples): teacher "
                 f"{100 * rep['teacher']:.1f}% -> hybrid {100 * rep['hybrid']:.1f}%")
        tpk = self.teacher_passkey
        if tpk is not None and "skipped" in tpk:
            rep["passkey"] = {"skipped": tpk["skipped"]}
        elif tpk is not None:
            pk = passkey.quick_check(hybrid, self.tokenizer, length=self.length)
            rep["passkey"] = {"length": self.length, "prompts": pk["prompts"], "teacher": tpk["score"],
                              "hybrid": pk["score"]}
            paired = ""
            if len(tpk.get("found") or ()) == len(pk["found"]):  # the same prompts: which side found which key
                split = stats.paired(pk["found"], tpk["found"])
                rep["passkey"].update(better=split["better"], worse=split["worse"], p=split["p"],
                                      teacher_found=list(tpk["found"]), hybrid_found=pk["found"])
                paired = f" ({stats.paired_note(split['better'], split['worse'], split['p'])})"
            lost = pk["score"] < 0.5 * tpk["score"]
            windowed = int((getattr(hybrid.config, "linear_attention", None) or {}).get("window") or 0) > 0
            self.log(f"recall check (passkey, {self.length} tokens, {pk['prompts']} prompts): teacher "
                     f"{100 * rep['passkey']['teacher']:.0f}% -> hybrid {100 * pk['score']:.0f}%{paired}"
                     + ("; the hybrid lost most of the teacher's retrieval (check it with `linearize eval --task "
                        "passkey,niah --against`" if lost else "")
                     + ("; a served window as long as your prompts with stage 2 fitted to it, --set "
                        "attention.window=4096 --set attention.train_window=64 --set finetune.train_window=0, "
                        "kept it at 7:1: docs/guide.md" if lost and windowed else "")
                     + (")" if lost else ""))
        rep["seconds"] = round(self.seconds + time.time() - t, 1)
        return rep


def run_auto_select(model, tokenizer, rec, auto: AutoSelect, *, log: Callable[[str], None] = print):
    """Probe (or read the cached probe) and choose the softmax layers; ``(layer_types, probe result or None,
    swap check report or None)``."""
    n, count = model.config.num_hidden_layers, auto.count
    if count in (0, n):
        log(f"select: {count} of {n} layers softmax leaves nothing to choose; probe skipped")
        return layout_from_softmax_layers(list(range(count)), n), None, None
    probe = run_probe(model, tokenizer, rec, probe_tokens=auto.probe_tokens, log=log)
    scores = probe.scores(score_weights(rec))
    by_kind = seats_for(probe, rec, count)
    for kind in SEAT_KINDS:
        if by_kind[kind.field]:
            got = probe.measurements[kind.term]
            log(f"select: {kind.label} for {kind.reason}: "
                + ", ".join(f"L{i} {got[i]:{kind.fmt}}" for i in by_kind[kind.field]) + f" ({kind.measure})")
    seats = seated(by_kind)
    softmax = choose_softmax_layers(scores, count, seats)
    top = rank_layers(scores)[: min(n, count + 3)]
    log(f"select: keeps softmax layers {','.join(map(str, softmax))} (interleave would keep "
        f"{','.join(map(str, auto.interleave))}); top scores " + ", ".join(f"L{i} {scores[i]:.3f}" for i in top))
    edge = selection_boundary(scores, count, seats)
    if edge and edge["close_call"]:
        log(f"select: close call: layer {edge['kept']} kept ({edge['kept_score']:.4f}), layer {edge['dropped']} not "
            f"({edge['dropped_score']:.4f}), {100 * edge['relative_margin']:.1f}% apart; recall can hinge on such a "
            f"pair: compare both with --softmax-layers"
            + ("" if rec["select"]["swap_rounds"] else ", or check swaps jointly with --set select.swap_rounds=2"))
    swaps = None
    if rec["select"]["swap_rounds"] > 0:
        softmax, swaps = swap_check(model, tokenizer, rec, probe, softmax, scores, reserved=seats, log=log)
        if swaps["final_layers"] != swaps["start_layers"]:
            log(f"select: after the swap check keeps softmax layers {','.join(map(str, softmax))}")
    return layout_from_softmax_layers(softmax, n), probe, swaps


def auto_report(hybrid, rec, auto: AutoSelect, probe, swaps: dict | None, *, train: bool,
                log: Callable[[str], None] = print) -> dict:
    """The ``select`` stage report (``swaps``: the swap check's); with training, the linear layers start from the
    probe's trained maps."""
    softmax = softmax_indices(hybrid.config.layer_types)
    if probe is None:
        return {"method": "auto", "softmax_count": len(softmax), "count_from": auto.count_from,
                "softmax_layers": ",".join(map(str, softmax)), "probe": "skipped (nothing to choose)",
                **({"kv_budget": auto.kv_detail} if auto.kv_detail else {})}
    initialized = []
    if train and probe.maps:
        initialized = apply_feature_maps(hybrid, probe.maps)
        log(f"probe: {len(initialized)} linear layers start from the probe's trained feature maps")
    return select_report(probe, rec, softmax, count_from=auto.count_from, interleave=list(auto.interleave),
                         total_tokens=auto.total_tokens, kv_budget=auto.kv_detail, initialized=initialized,
                         swap_check=swaps)


def run_finetune(model, tokenizer, rec, out: Path, *, tokens=None, loss=None, resume: bool = False,
                 adapter_only_dir: Path | None = None, log: Callable[[str], None] = print):
    """The LoRA stage with its state beside ``out``; returns ``(model, report)``."""
    model, report = finetune(model, tokenizer, rec, state_dir=state_dir_for(out), resume=resume, tokens=tokens,
                             loss=loss, adapter_only_dir=adapter_only_dir, log=log)
    if "heldout_ppl_end" in report:
        log(f"finetune: held-out ppl {report['heldout_ppl_start']:.2f} -> {report['heldout_ppl_end']:.2f} "
            f"(teacher {report['heldout_ppl_teacher']:.2f}), {report['tokens']:,} tokens in {report['train_seconds']}s")
    return model, report


def check_before_loading(rec, stages: dict[str, Any], *, source: Path, out: Path, resume: bool = False,
                         loss: str | None = None, layer_types: list[str] | None = None,
                         attention: dict[str, Any] | None = None, recall: dict[str, Any] | None = None,
                         probe: bool = False) -> None:
    """The checks of a training run that need no model, before one loads (each refusal one line, nothing written):
    each stage's data (text, at least one batch, enough held-out text for its evaluation; tokenized with the
    tokenizer in ``source``), the recall check's held-out text (``recall``: its ``data`` and ``length``), the batch
    over torchrun processes and, with ``resume``, the settings a stage's saved state was written with (the first
    that differs is named). ``stages`` maps a stage to its token budget (None: the recipe's); ``probe``: stage 1
    starts after the ``--select auto`` probe, so its budget and layer layout are not known yet."""
    for stage in stages:
        dist.check_batch(stage, rec[stage]["batch_size"])
    if resume:
        _check_resume(rec, stages, state_dir_for(out), loss=loss, layer_types=layer_types, attention=attention,
                      probe=probe)
    tokenizer = _tokenizer(source)
    if tokenizer is None:  # load_model names what is missing, before any weights load
        return
    for stage in stages:
        cfg = rec[stage]
        check_training_source(tokenizer, cfg["data"], field=f"{stage}.data", seq_len=cfg["seq_len"],
                              batch_size=cfg["batch_size"], eval_seqs=cfg["eval_seqs"])
    if recall is not None:
        field = next((f"{s}.data" for s in reversed(list(stages)) if rec[s]["data"] == recall["data"]), "data")
        _check_recall_text(tokenizer, recall["data"], int(recall["length"]), field)


def _tokenizer(path: Path):
    """The tokenizer in ``path`` (no model), or None when it does not load."""
    # start-up time: transformers, after the spec's one-line errors
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception:  # noqa: BLE001 - load_model reports it in one line
        return None


def _check_recall_text(tokenizer, data: str, length: int, field: str) -> None:
    """The recall check's held-out text, read as the check reads it."""
    if not check_text_files(data, field=field).cacheable:
        return  # streamed: not measured in advance
    try:
        heldout_stream(tokenizer, data, max(POOL_TOKENS, 2 * length), at_least=length)
    except (DataError, EvalError):
        raise DataError(f"{field}: the held-out part of {data!r} (the documents never trained on) is too small for "
                        f"the conversion's recall check (copy, {length:,} tokens); use --set {field}=wiki (the "
                        f"embedded corpus) or a larger source") from None


def _check_resume(rec, stages: dict[str, Any], sdir: Path, *, loss: str | None, layer_types: list[str] | None,
                  attention: dict[str, Any] | None, probe: bool = False) -> None:
    """Refuse a ``--resume`` whose stage state in ``sdir`` was written with other settings, naming the first."""
    for stage, tokens in stages.items():
        ckpt = sdir / (DISTILL_STATE if stage == "distill" else STATE_FILE)
        if not ckpt.is_file():
            continue
        budget = parse_tokens(tokens if tokens is not None else rec[stage]["tokens"])
        now = stage_settings(rec, stage, budget, (loss or rec["finetune"]["loss"]) if stage == "finetune" else None)
        if stage == "distill" and probe:
            now.pop("tokens")  # stage 1 less the probe's tokens: known once the probe has run
        if layer_types is not None:
            now["layers"] = list(layer_types)
        now.update({f"attention.{k}": v for k, v in (attention or {}).items()})
        refusal = resume_refusal(stage, ckpt, saved_settings(ckpt), now)
        if refusal is not None:
            raise refusal


def state_dir_for(out: Path) -> Path:
    """Where resumable training state for output ``out`` lives (a hidden sibling directory)."""
    out = Path(out)
    return out.parent / f".{out.name}.state"


def run_distill(model, tokenizer, rec, out: Path, *, tokens=None, resume: bool = False,
                log: Callable[[str], None] = print) -> dict:
    """Attention transfer with its state beside ``out``; the state is removed once the output is saved."""
    sdir = state_dir_for(out)
    if sdir.exists() and not resume and dist.is_main():
        shutil.rmtree(sdir)
    report = distill(model, tokenizer, rec, state_dir=sdir, resume=resume, tokens=tokens, log=log)
    if "heldout_mse_reduction_mean" in report:
        log(f"distill: held-out attention MSE {report['heldout_mse_start_mean']:.4g} -> "
            f"{report['heldout_mse_end_mean']:.4g} (mean per-layer reduction {report['heldout_mse_reduction_mean']:.1f}x), "
            f"{report['tokens']:,} tokens in {report['train_seconds']}s")
    return report


def rerun_stage(stage: str, path: str, *, out: Path | None = None, overrides: dict[str, Any] | None = None,
                tokens=None, loss: str | None = None, adapter_only: bool = False, resume: bool = False,
                dtype: str | None = None, device: str | None = None, fsdp: bool = False,
                train_length: str | int | None = None, log: Callable[[str], None] = print) -> Path:
    """(Re)run ``"distill"`` or ``"finetune"`` on a hybrid checkpoint; write to ``out`` (default: in place).

    With ``adapter_only`` (finetune), only the LoRA adapter is written, to ``out`` (default ``PATH-adapter``).
    ``train_length``: the stage's sequence length (``--train-length``, as for ``convert``).
    """
    resolved = resolve(path)
    src = Path(resolved.path if resolved.kind == "dir" else local_dir(resolved))
    if not is_hybrid_dir(src):
        raise LinearizeError(f"{path}: not a linearize hybrid checkpoint; use `linearize convert {path}` first")
    verify_checkpoint(src)  # a missing or truncated shard, named first (without the model code local_dir imports)
    rec = load_recipe(str(src / "linearize_recipe.yaml"), overrides, train_length, (stage,))
    if tokens is not None:
        parse_tokens(tokens)
    if loss is not None and loss not in ("xent", "kl"):
        raise LinearizeError(f"--loss {loss!r}: expected xent or kl")
    check_device(device)
    if fsdp:
        sharding.check_options(adapter_only=adapter_only)
    config = json.loads((src / "config.json").read_text())
    check_context(rec, config.get("max_position_embeddings"), path, stages=(stage,))
    window = widest_window(config.get("linear_attention") or {})
    recipes.check_training(rec, {stage: tokens}, window=window)  # the model's windows, not the recipe text's
    if adapter_only:
        out = Path(out) if out is not None else src.with_name(src.name + "-adapter")
    else:
        out = Path(out) if out is not None else src
    in_place = out.resolve() == src.resolve()
    check_output_dir(out, overwrite=in_place)  # in place: the parent must still take the new directory
    summary = json.loads((src / "report.json").read_text()) if (src / "report.json").is_file() else {}
    stages = dict(summary.get("stages", {}))
    recall = None  # the recall check follows the weights: re-scored after this stage, the teacher kept
    if not adapter_only:
        if "teacher" in (stages.get("recall") or {}):
            recall = {"data": stages["recall"]["data"], "length": stages["recall"]["length"]}
        elif "finetune" not in stages:  # no adapters merged yet: softmax mode is still the teacher
            recall_stage = rec["finetune" if stage == "finetune" else "distill"]
            recall = {"data": recall_stage["data"], "length": RecallCheck.length_for(
                recall_stage, SimpleNamespace(max_position_embeddings=config.get("max_position_embeddings")))}
    check_before_loading(rec, {stage: tokens}, source=src, out=out, resume=resume, loss=loss,
                         layer_types=config.get("layer_types"), attention=config.get("linear_attention"),
                         recall=recall)
    device = dist.init(device)  # torchrun: join the process group; this rank's device
    if fsdp:  # rank 0 loads the model, every rank keeps only its shards (linearize.train.fsdp)
        model, tokenizer = sharding.load_and_shard(str(src), device, dtype, log=log)
    else:
        model, tokenizer = load_model(str(src), dtype=dtype, device=device)
    if recall is not None:
        if "teacher" in (stages.get("recall") or {}):
            recall = RecallCheck.from_report(stages["recall"], tokenizer, log=log)
        else:
            recall = RecallCheck.measure(model, tokenizer, rec, finetune=stage == "finetune", log=log)
    if stage == "distill":
        report = run_distill(model, tokenizer, rec, out, tokens=tokens, resume=resume, log=log)
    else:
        model, report = run_finetune(model, tokenizer, rec, out, tokens=tokens, loss=loss, resume=resume,
                                     adapter_only_dir=out if adapter_only else None, log=log)
    stages[stage] = report
    stages.pop("recall", None)
    if recall is not None:
        stages["recall"] = recall.finish(model)
    full = _gather(model) if not adapter_only else None  # --fsdp: the full weights on rank 0
    if dist.is_main():  # torchrun: every rank holds the same weights; rank 0 writes, the others wait
        if not adapter_only:
            save_checkpoint(model, tokenizer, out, base=summary.get("base_model", path), recipe=rec,
                            overwrite=in_place, reports=stages, state_dict=full)
        shutil.rmtree(state_dir_for(out), ignore_errors=True)
    dist.barrier()
    return out

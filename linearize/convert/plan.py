"""One plan per conversion: the command line's options checked and resolved, once, before any weight loads.

:func:`build_plan` turns the option groups (:class:`LayoutOptions`, :class:`TrainingOptions`, :class:`RunOptions`)
into a frozen :class:`ConvertPlan`: the recipe with its ``--set`` overrides, the spec resolved once, the layout
decided once (:class:`Layout`: named softmax layers, the interleave pattern, or ``--select auto`` with its count
from ``--ratio`` or ``--kv-budget``, and what the probe will cost: :class:`AutoSelect`), the token budget of each
stage, dtype and device, the output directory. Everything a user can get wrong is refused here, in one line,
so a bad call writes nothing; :func:`linearize.convert.pipeline.convert` then runs the plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .. import recipe as recipes
from ..errors import LinearizeError, SelectionError
from ..io import sources
from ..io.checkpoint import check_output_dir
from ..settings import DEFAULT_RATIO, DEFAULT_RECIPE
from ..train import fsdp
from ..units import parse_length, parse_tokens
from .probe import plan_probe_tokens, plan_scoring_tokens, score_weights
from .selection import (check_select, layout_from_ratio, parse_layer_list, parse_ratio, select_layout,
                        softmax_count_for_budget, softmax_count_from_ratio, softmax_indices)

#: the most the ``--select auto`` probe may take of a conversion's tokens
PROBE_MAX_SHARE = 0.25

#: how the softmax layers are chosen: named (``--softmax-layers``), the ``--ratio`` pattern, or ``--select auto``
#: keeping the count of ``--ratio`` or the most ``--kv-budget`` fits
LAYOUT_MODES = ("softmax_layers", "interleave", "auto_count", "auto_kv")


# ------------------------------------------------------------------------------------------- the options


@dataclass(frozen=True)
class LayoutOptions:
    """``--ratio``, ``--softmax-layers``, ``--select``, ``--kv-budget`` as given (None: not given)."""

    ratio: str | None = None
    softmax_layers: str | None = None
    select: str | None = None
    kv_budget: str | None = None


@dataclass(frozen=True)
class TrainingOptions:
    """Which stages run (``--no-train``, ``--no-finetune``), their budgets as given (``--tokens``,
    ``--distill-tokens``, ``--finetune-tokens``), the training sequences' length (``--train-length``), ``--loss``
    and ``--resume``."""

    train: bool = True
    finetune: bool = True
    tokens: str | int | None = None
    distill_tokens: str | int | None = None
    finetune_tokens: str | int | None = None
    loss: str | None = None
    resume: bool = False
    train_length: str | int | None = None


@dataclass(frozen=True)
class RunOptions:
    """Where the result goes (``-o``, ``--overwrite``) and where the work runs (``--dtype``, ``--device``,
    ``--fsdp``)."""

    out: Path | None = None
    overwrite: bool = False
    dtype: str | None = None
    device: str | None = None
    fsdp: bool = False


# ------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Layout:
    """How the softmax layers are chosen (:data:`LAYOUT_MODES`), decided once from the options and the recipe."""

    mode: str
    ratio: str  # --ratio or the default: the interleave pattern, or auto_count's count
    softmax_layers: str | None = None
    kv_budget: str | None = None  # as given, also where --softmax-layers overrides it
    select: str = "interleave"  # --select as the checkpoint records it: interleave or auto
    optional: bool = False  # auto from the recipe's select.method: interleave where it cannot run or does not pay

    @property
    def auto(self) -> bool:
        return self.mode in ("auto_count", "auto_kv")

    def fall_back(self) -> Layout:
        """The interleave layout an optional auto gives way to."""
        return dataclasses.replace(self, mode="interleave", select="interleave", optional=False)

    def name_part(self) -> str:
        """The layout in ``-o``'s default name: ``3to1``, ``3to1-auto``, ``kv2GB-32K-auto`` or ``custom``."""
        if self.mode == "softmax_layers":
            return "custom"
        if self.mode == "auto_kv":
            return f"kv{self.kv_budget.replace('@', '-')}-auto"
        return self.ratio.replace(":", "to") + ("-auto" if self.auto else "")

    def recorded(self) -> dict[str, Any]:
        """The layout options as the checkpoint's report records them."""
        ratio = self.ratio if self.softmax_layers is None and self.kv_budget is None else None
        return {"ratio": ratio, "softmax_layers": self.softmax_layers, "select": self.select,
                "kv_budget": self.kv_budget}


@dataclass(frozen=True)
class AutoSelect:
    """What ``--select auto`` does, known before the model loads: how many softmax layers and from what, which
    ones interleave would keep instead, and the probe's budget."""

    count: int
    count_from: str  # "--ratio 3:1" or "--kv-budget 2GB@32K"
    interleave: tuple[int, ...]
    kv_detail: dict[str, Any] | None  # softmax_count_for_budget's arithmetic (auto_kv)
    stage1_tokens: int  # the probe's tokens are part of stage 1
    probe_tokens: int
    total_tokens: int | None  # stage 1 + stage 2; None without training
    scoring_tokens: int  # forward-only tokens of scoring the layers and the swap check


@dataclass(frozen=True)
class ConvertPlan:
    """A conversion, checked and resolved: what :func:`linearize.convert.pipeline.convert` runs."""

    spec: str
    source: sources.ResolvedSpec
    source_dir: Path  # a local Hugging Face directory of the source (a GGUF de-quantized)
    base_config: Any
    recipe: recipes.Recipe  # with the --set overrides
    layout: Layout
    auto: AutoSelect | None  # with an auto layout
    layer_types: list[str] | None  # None: the probe chooses them once the model has loaded
    train: bool
    finetune: bool
    tokens: dict[str, int | None]  # stage -> budget (None: the recipe's), for the stages that run
    loss: str | None
    resume: bool
    dtype: str | None
    device: str | None
    fsdp: bool
    out: Path
    overwrite: bool


def build_plan(spec: str, *, recipe: str = DEFAULT_RECIPE, overrides: dict[str, Any] | None = None,
               layout: LayoutOptions = LayoutOptions(), training: TrainingOptions = TrainingOptions(),
               run: RunOptions = RunOptions(), log: Callable[[str], None] = print) -> ConvertPlan:
    """Check every option, resolve the spec (once) and read its config (no weights); the :class:`ConvertPlan`.

    Each refusal is one line and nothing is written. The option checks come first, then the spec, then what
    needs the model's config (the auto count and probe budget, the layer layout), then the output directory.
    """
    rec = load_recipe(recipe, overrides, training.train_length)
    train = training.train
    chosen = decide_layout(layout, method=rec["select"]["method"], train=train, fsdp=run.fsdp, log=log)
    if run.fsdp:
        fsdp.check_options(select_auto=chosen.auto, train=train)
    if chosen.auto:
        score_weights(rec)  # all weights 0: one line
    if run.dtype is not None:
        sources.resolve_dtype(run.dtype, run.device or "cpu")
    tokens = split_tokens(training)
    if training.loss is not None and training.loss not in ("xent", "kl"):
        raise LinearizeError(f"--loss {training.loss!r}: expected xent or kl")
    sources.check_device(run.device)
    if train:  # window vs seq_len, budgets vs one step, data specs
        recipes.check_training(rec, tokens)
    source = sources.resolve(spec)
    source_dir = sources.local_dir(source)
    from .surgery import load_base_config  # imports transformers' model code (seconds): only after the option checks

    base_config = load_base_config(spec, source_dir)  # encoder-only, no attention, ...: one line
    note = sources.vision_language_note(source_dir)
    if note:
        log(note)
    if train:
        rec = fit_context(rec, recipe, overrides or {}, training.train_length,
                          getattr(base_config, "max_position_embeddings", None), spec, log=log)
    chosen, auto = plan_auto_select(chosen, base_config, rec, tokens, dtype=run.dtype, device=run.device,
                                    train=train, log=log)
    layer_types = None if auto is not None else select_layout(
        base_config.num_hidden_layers, ratio=chosen.ratio, softmax_layers=chosen.softmax_layers)
    if train:
        check_context(rec, getattr(base_config, "max_position_embeddings", None), spec,
                      stages=("distill", "finetune") if training.finetune else ("distill",))
    out = Path(run.out or default_output_name(source.name, chosen, rec.name))
    check_output_dir(out, run.overwrite)
    return ConvertPlan(spec=spec, source=source, source_dir=source_dir, base_config=base_config, recipe=rec,
                       layout=chosen, auto=auto, layer_types=layer_types, train=train, finetune=training.finetune,
                       tokens=tokens, loss=training.loss, resume=training.resume, dtype=run.dtype, device=run.device,
                       fsdp=run.fsdp, out=out, overwrite=run.overwrite)


def load_recipe(source: str, overrides: dict[str, Any] | None, train_length: str | int | None,
                stages: tuple[str, ...] = ("distill", "finetune")) -> recipes.Recipe:
    """The recipe with the ``--set`` overrides and, given ``train_length``, ``--train-length``'s for ``stages``."""
    rec = recipes.load(source, overrides)
    if train_length is None:
        return rec
    length = parse_length(train_length, what="--train-length")
    return recipes.load(source, {**(overrides or {}), **train_length_overrides(rec, length, overrides or {}, stages)})


def train_length_overrides(rec: recipes.Recipe, length: int, given: dict[str, Any],
                           stages: tuple[str, ...] = ("distill", "finetune")) -> dict[str, Any]:
    """``--train-length LENGTH`` as recipe overrides: the ``stages`` train on ``length``-token sequences, with
    ``batch_size`` and ``eval_seqs`` scaled so that a step's tokens and the held-out tokens stay the recipe's (at
    least one sequence each). Refused in one line where ``--set`` already gives a stage's ``seq_len``."""
    out: dict[str, Any] = {}
    for stage in stages:
        if f"{stage}.seq_len" in given:
            raise LinearizeError(f"--train-length and --set {stage}.seq_len both set the training length: "
                                 "give one of them")
        cfg = rec[stage]
        old = int(cfg["seq_len"])
        scaled = {"seq_len": length, "batch_size": max(1, int(cfg["batch_size"]) * old // length),
                  "eval_seqs": max(1, int(cfg["eval_seqs"]) * old // length)}
        out.update({f"{stage}.{f}": v for f, v in scaled.items() if f"{stage}.{f}" not in given})
    return out


def fit_context(rec: recipes.Recipe, source: str, given: dict[str, Any], train_length: str | int | None,
                limit: int | None, spec: str, *, log: Callable[[str], None] = print) -> recipes.Recipe:
    """The recipe with its own training length cut to the model's context ``limit`` (``max_position_embeddings``)
    where it is longer, as ``--train-length LIMIT`` would (one log line). A length the user gave
    (``--train-length``, ``--set STAGE.seq_len``) is left to :func:`check_context` to refuse."""
    if not limit or train_length is not None:
        return rec
    stages = tuple(s for s in ("distill", "finetune") if f"{s}.seq_len" not in given
                   and int(rec[s]["seq_len"]) > int(limit))
    if not stages:
        return rec
    log(f"training at {int(limit)} tokens, {spec}'s context (the recipe's {int(rec[stages[0]]['seq_len'])} is "
        "longer)")
    return load_recipe(source, given, int(limit), stages)


def check_context(rec: recipes.Recipe, limit: int | None, spec: str, *, stages: tuple[str, ...]) -> None:
    """Refuse (one line) a training length beyond the model's context ``limit`` (``max_position_embeddings``;
    None: unknown): positions it never saw in pretraining would be what the conversion learns from."""
    for stage in stages:
        seq_len = int(rec[stage]["seq_len"])
        if limit and seq_len > int(limit):
            raise LinearizeError(f"{stage}.seq_len {seq_len} is beyond {spec}'s context ({int(limit)} tokens, its "
                                 f"max_position_embeddings): use --train-length {int(limit)} or less")


def default_output_name(name: str, layout: Layout, recipe_name: str) -> str:
    """``-o``'s default, ``smollm2-135m-3to1-lolcats`` style: ``-3to1-auto-`` with ``--select auto``,
    ``-kv2GB-32K-auto-`` with ``--kv-budget 2GB@32K``, ``-custom-`` with ``--softmax-layers``."""
    return f"{name}-{layout.name_part()}-{recipe_name}"


# ----------------------------------------------------------------------------------------- the layout


def decide_layout(options: LayoutOptions, *, method: str, train: bool, fsdp: bool,
                  log: Callable[[str], None] = print) -> Layout:
    """The layout the options ask for, checked (one line each); ``method`` is the recipe's ``select.method``.

    ``--softmax-layers`` overrides ``--ratio`` and ``--select`` (with a log line where it overrides auto);
    ``--kv-budget`` implies auto. Without ``--select`` and ``--kv-budget`` the recipe's method applies, and its
    auto is optional: interleave with named layers, surgery only (the probe trains) or ``--fsdp``, and later
    where :func:`plan_auto_select` finds it cannot run or does not pay."""
    optional = options.select is None and options.kv_budget is None
    select = check_select(options.select, kv_budget=options.kv_budget, ratio_given=options.ratio is not None,
                          default=method)
    ratio = options.ratio or DEFAULT_RATIO
    if options.softmax_layers is not None:
        parse_layer_list(options.softmax_layers)
    else:
        parse_ratio(ratio)
    if optional and select == "auto" and (options.softmax_layers is not None or not train or fsdp):
        if fsdp and options.softmax_layers is None and train:
            log("select: interleave (the recipe's auto selection does not run under --fsdp)")
        select = "interleave"
    if options.softmax_layers is not None:
        if select == "auto":
            log("select: --softmax-layers overrides --select auto (no probe)")
        return Layout("softmax_layers", ratio, options.softmax_layers, options.kv_budget, select)
    if select == "interleave":
        return Layout("interleave", ratio)
    mode = "auto_kv" if options.kv_budget is not None else "auto_count"
    return Layout(mode, ratio, kv_budget=options.kv_budget, select="auto", optional=optional)


def plan_auto_select(layout: Layout, base_config, rec, tokens: dict[str, int | None], *, dtype, device,
                     train: bool, log: Callable[[str], None] = print) -> tuple[Layout, AutoSelect | None]:
    """``(layout, its AutoSelect)`` for an auto layout, ``(layout, None)`` for any other. An optional (the
    recipe's) auto gives way to interleave, ``(layout.fall_back(), None)``, where there is nothing to choose,
    the probe does not fit the budget, or scoring the layers would take more forward tokens than the whole
    training budget (the last two with a log line); an explicit one refuses what cannot work instead."""
    if not layout.auto:
        return layout, None
    if not layout.optional:
        return layout, plan_auto(layout, base_config, rec, tokens, dtype=dtype, device=device, train=train)
    try:
        auto = plan_auto(layout, base_config, rec, tokens, dtype=dtype, device=device, train=train)
    except SelectionError as e:
        log(f"select: interleave (the recipe's auto selection does not fit: {e})")
        return layout.fall_back(), None
    if auto.count in (0, base_config.num_hidden_layers):
        return layout.fall_back(), None
    if auto.scoring_tokens > auto.total_tokens:
        log(f"select: interleave (the recipe's auto selection would score the layers on about "
            f"{auto.scoring_tokens:,} forward tokens, more than the {auto.total_tokens:,} training tokens; "
            f"--select auto runs it anyway)")
        return layout.fall_back(), None
    return layout, auto


def plan_auto(layout: Layout, base_config, rec, tokens: dict[str, int | None], *, dtype, device,
              train: bool) -> AutoSelect:
    """How many softmax layers ``--select auto`` keeps and what its probe costs; one-line errors for a budget
    that cannot work. Nothing is loaded."""
    n = base_config.num_hidden_layers
    interleave = tuple(softmax_indices(layout_from_ratio(layout.ratio, n)))
    if layout.mode == "auto_kv":
        dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype_bytes = torch.empty((), dtype=sources.resolve_dtype(dtype, dev)).element_size()
        count, kv_detail = softmax_count_for_budget(base_config, rec["attention"], layout.kv_budget, dtype_bytes)
        count_from = f"--kv-budget {layout.kv_budget}"
    else:
        count, kv_detail = softmax_count_from_ratio(layout.ratio, n), None
        count_from = f"--ratio {layout.ratio}"
    d = rec["distill"]
    stage1 = parse_tokens(tokens["distill"] if tokens["distill"] is not None else d["tokens"])
    stage2 = 0
    if "finetune" in tokens:
        stage2 = parse_tokens(tokens["finetune"] if tokens["finetune"] is not None else rec["finetune"]["tokens"])
    probe_tokens = plan_probe_tokens(rec, stage1)
    auto = AutoSelect(count=count, count_from=count_from, interleave=interleave, kv_detail=kv_detail,
                      stage1_tokens=stage1, probe_tokens=probe_tokens, total_tokens=stage1 + stage2 if train else None,
                      scoring_tokens=plan_scoring_tokens(rec, n, getattr(base_config, "max_position_embeddings", None)))
    if train and 0 < count < n:
        batch = d["seq_len"] * d["batch_size"]
        if stage1 - probe_tokens < batch:
            raise SelectionError(f"--select auto: the stage-1 budget of {stage1:,} tokens leaves "
                                 f"{stage1 - probe_tokens:,} after the probe's {probe_tokens:,}, less than one batch "
                                 f"({batch:,}); raise --tokens / --distill-tokens")
        share = probe_tokens / (stage1 + stage2)
        if share > PROBE_MAX_SHARE:
            raise SelectionError(f"--select auto: the probe's {probe_tokens:,} tokens (at least one step of "
                                 f"distill.seq_len x batch_size x grad_accum) would be {share:.0%} of the "
                                 f"conversion's {stage1 + stage2:,} tokens (limit {PROBE_MAX_SHARE:.0%}); raise "
                                 f"--tokens or lower select.probe_fraction")
    return auto


# ------------------------------------------------------------------------------------------ the budgets


def split_tokens(training: TrainingOptions) -> dict[str, int | None]:
    """Each running stage's budget (distill, and finetune unless ``--no-finetune``): ``--tokens`` splits evenly
    across them (LoLCATs: 20M + 20M); ``--distill-tokens`` / ``--finetune-tokens`` set one stage; None keeps
    the recipe's. Every budget given is checked (one line), also one for a stage that does not run."""
    given = [parse_tokens(v) if v is not None else None  # one-line error for a bad budget
             for v in (training.tokens, training.distill_tokens, training.finetune_tokens)]
    total, distill, finetune = given
    if total is not None:
        share = total // 2 if training.finetune else total
        distill = distill if distill is not None else share
        finetune = finetune if finetune is not None else total - share
    return {"distill": distill, **({"finetune": finetune} if training.finetune else {})}

"""``run_eval``: run evaluation tasks on a model (and the original it is compared against),
write ``results.jsonl``, ``summary.json``, ``report.md`` and PNGs atomically."""

from __future__ import annotations

import datetime as _dt
import gc
import json
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Sequence

import torch
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from linearize.atomic import atomic_write
from linearize.io.outputs import check_output, normalize_modes, write_marker
from linearize.io.sources import check_placement, load_model, placement, resolve
from linearize.progress import make_console, make_progress
from linearize.train.guards import is_oom, oom_error
from linearize.units import format_length

from . import agreement, copyspan, lm_eval, niah, passkey, ppl, recall, speed, swapback
from .common import (EvalConfig, EvalError, ModelHandle, Progress, parse_batch_sizes, parse_depths, parse_lengths,
                     parse_seeds)
from .corpus import check_data
from .earlier import is_report, load_earlier
from .report import summary_table, task_difference, write_report
from .stats import paired_by_length

TASKS: dict[str, ModuleType] = {
    "niah": niah, "passkey": passkey, "copy": copyspan, "ppl": ppl, "recall": recall,
    "agreement": agreement, "speed": speed, "lm-eval": lm_eval, "swapback": swapback,
}
ALIASES = {"perplexity": "ppl", "lm_eval": "lm-eval", "lmeval": "lm-eval", "mqar": "recall", "swap-back": "swapback"}
LENGTH_TASKS = ("niah", "passkey", "copy", "ppl", "agreement", "speed", "swapback")
ALLOWED = ("niah[:VARIANTS], passkey, copy[:SPAN], ppl[:TOKENS], recall[:PAIRS], agreement[:TOKENS], "
           "speed[:DECODE_TOKENS], swapback, lm-eval:TASKS")


@dataclass
class TaskSpec:
    name: str
    arg: str | None
    args: dict

    @property
    def module(self) -> ModuleType:
        return TASKS[self.name]

    @property
    def label(self) -> str:
        return self.name if not self.arg else f"{self.name}:{self.arg}"


def parse_tasks(value: str | Sequence[str]) -> list[TaskSpec]:
    """Parse and validate a task list: ``"niah,ppl"``, ``["passkey", "recall:8+16"]``,
    ``"lm-eval:hellaswag,piqa"`` (names after ``lm-eval:`` that are not linearize tasks go to
    lm-eval). Raises :class:`EvalError` naming the bad value and the allowed ones."""
    items = [s.strip() for s in (value.split(",") if isinstance(value, str) else value)]
    items = [s for s in items if s]
    if not items:
        raise EvalError(f"no task given: expected one or more of {ALLOWED}")
    specs: list[TaskSpec] = []
    raw: dict[str, str | None] = {}
    for item in items:
        name, sep, arg = item.partition(":")
        key = ALIASES.get(name.strip().lower(), name.strip().lower())
        if key not in TASKS:
            if specs and specs[-1].name == "lm-eval" and not sep:
                raw["lm-eval"] = f"{raw['lm-eval']}+{item}"
                specs[-1].arg = raw["lm-eval"]
                continue
            raise EvalError(f"unknown task {item!r}: expected one of {ALLOWED}")
        if key in raw:
            raise EvalError(f"task {key!r} is given twice: give each task once")
        raw[key] = arg.strip() if sep else None
        specs.append(TaskSpec(key, raw[key], {}))
    for s in specs:
        s.args = s.module.parse_args(s.arg)
    return specs


def _default_loader() -> Callable:
    """The loader a run uses unless ``LoadOptions.loader`` names another (the tests swap it here)."""
    return load_model


class _RichProgress(Progress):
    def __init__(self, console):
        self.console = console
        self.p = make_progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TimeElapsedColumn(), TimeRemainingColumn(), console=console)
        self.task = None

    def __enter__(self):
        self.p.__enter__()
        return self

    def __exit__(self, *exc):
        self.p.__exit__(*exc)

    def start(self, label: str, total: int) -> None:
        self.task = self.p.add_task(label, total=max(1, total))

    def advance(self, n: int = 1) -> None:
        if self.task is not None:
            self.p.advance(self.task, n)

    def note(self, text: str) -> None:
        self.p.console.log(text)


class _Quiet(Progress):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _versions() -> dict:
    out = {}

    for pkg in ("linearize", "torch", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def _resolve_chat(tokenizer, chat_template: bool | None, spec: str) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat_template is None:
        return has
    if chat_template and not has:
        raise EvalError(f"{spec} has no chat template: drop --chat-template")
    return bool(chat_template)


def _check_limit(spec: str, limit: int | None, cfg: EvalConfig, specs: list[TaskSpec]) -> None:
    """Refuse context lengths beyond the model's ``max_position_embeddings`` (one line)."""
    if not limit or not any(s.name in LENGTH_TASKS for s in specs):
        return
    too_long = [L for L in cfg.lengths if L > limit]
    if too_long:
        raise EvalError(f"length {format_length(too_long[0])} ({too_long[0]} tokens) exceeds the position limit of "
                        f"{spec} ({limit} tokens, max_position_embeddings): use lengths up to {limit}")


def default_out_dir(spec: str, tasks: str | Sequence[str], *, now: _dt.datetime | None = None,
                    parent: str | Path = ".") -> Path:
    """A new report folder for this run: ``eval-MODEL-TASKS-YYYYMMDD-HHMMSS`` (``eval-smollm2-135m-passkey,ppl-
    20261204-143012``), with ``-2``, ``-3``, ... when that name is taken, so runs never collide."""
    names = ",".join(dict.fromkeys(s.name for s in parse_tasks(tasks)))
    stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    base = Path(parent) / f"eval-{resolve(spec).name}-{names}-{stamp}"
    out, n = base, 1
    while out.exists() or out.is_symlink():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def _peek_max_positions(spec: str) -> int | None:
    """``max_position_embeddings`` from a local checkpoint's config.json, without loading it."""
    try:
        cfg = json.loads((Path(spec) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    n = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    return int(n) if isinstance(n, int) else None


#: tasks whose rows score one prompt each (niah, passkey, copy): compared prompt by prompt with the original
PAIRED_TASKS = ("niah", "passkey", "copy")


def _row_key(r: dict) -> tuple | None:
    if r["task"] in ("niah", "passkey", "copy"):
        return (r["task"], r.get("variant"), r["seed"], r["length"], r["depth"])
    if r["task"] == "recall":
        return (r["task"], r["pairs"], r["seed"])
    if r["task"] == "agreement":
        return (r["task"], r["length"], r["seed"])
    return None


def _prompts_identical(rows: dict[str, list[dict]]) -> bool | None:
    if "against" not in rows:
        return None
    a = {k: r["prompt_sha1"] for r in rows["against"] if (k := _row_key(r)) and "prompt_sha1" in r}
    m = {k: r["prompt_sha1"] for r in rows["model"] if (k := _row_key(r)) and "prompt_sha1" in r}
    common = set(a) & set(m)
    if not common:
        return None
    return all(a[k] == m[k] for k in common)


@dataclass(frozen=True)
class EvalOptions:
    """What every task runs on: the grid, the text, generation limits (parsed into an :class:`EvalConfig`).

    lengths: context lengths in tokens, ``"1K,2K,4K"`` or ints (niah, passkey, copy, ppl, agreement, speed).
    depths: needle depths, a count (``11`` -> 0, 10%, ..., 100%) or fractions ``"0,0.5,1"``.
    seeds: a count (``2`` -> seeds 0, 1) or explicit seeds; samples per grid cell.
    chat_template: None = use it when the tokenizer has one; True = require it; False = plain text.
    data: held-out text for ppl and agreement (default: the embedded corpus' held-out split).
    batch_sizes: batch sizes for the speed task, ``"1,8"``.
    max_new_tokens: override every generation task's own small default.
    gen_batch_size: prompts generated together (they have the same length: never any padding);
        None = automatic, 16384 // length clamped to 1..8.
    """

    lengths: Any = "1K,2K,4K"
    depths: Any = 5
    seeds: Any = 2
    chat_template: bool | None = None
    data: str | None = None
    batch_sizes: Any = "1"
    max_new_tokens: int | None = None
    gen_batch_size: int | None = None

    def check_counts(self) -> None:
        """One-line :class:`EvalError` for a ``max_new_tokens`` or ``gen_batch_size`` that is not a positive int."""
        n, g = self.max_new_tokens, self.gen_batch_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n <= 0):
            raise EvalError(f"bad max_new_tokens {n!r}: expected a positive integer")
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g <= 0):
            raise EvalError(f"bad gen_batch_size {g!r}: expected a positive integer (or None for automatic)")

    def config(self) -> EvalConfig:
        """The options checked and parsed; one-line :class:`EvalError` for a bad value."""
        self.check_counts()
        return EvalConfig(lengths=parse_lengths(self.lengths), depths=parse_depths(self.depths),
                          seeds=parse_seeds(self.seeds), chat_template=self.chat_template, data=self.data,
                          batch_sizes=parse_batch_sizes(self.batch_sizes), max_new_tokens=self.max_new_tokens,
                          gen_batch_size=self.gen_batch_size)


@dataclass(frozen=True)
class LoadOptions:
    """How both models load.

    device, dtype: passed to the loader.
    max_memory, offload_dir: layer-wise onloading for models that do not fit (``{0: "40GiB", "cpu": "100GiB"}``
        or ``"0=40GiB,cpu=100GiB"``; see ``linearize.io.sources.load_model``), for both models; passed to the
        loader only when given.
    loader: ``loader(spec, dtype=, device=) -> (model, tokenizer)``; default ``linearize.io.sources.load_model``.
    """

    device: Any = None
    dtype: Any = None
    max_memory: Any = None
    offload_dir: str | Path | None = None
    loader: Callable | None = None


@dataclass(frozen=True)
class ReportOptions:
    """Where the report goes and what is shown while it is made.

    out_dir: report directory; written atomically (:func:`linearize.atomic.atomic_write`: ``.NAME.tmp-PID`` renamed).
    overwrite: replace an existing ``out_dir``: never a model checkpoint (nor write inside one), never another
        command's output; on the command line only an earlier eval output (:mod:`linearize.io.outputs`).
    progress: rich progress bars (and with ``table`` the summary table) on the terminal (stderr).
    console: a rich Console to draw on (default: stderr).
    table: print the summary table on ``console`` at the end (with ``progress``); the command line prints it
        on stdout itself.
    """

    out_dir: str | Path
    overwrite: bool = False
    progress: bool = True
    console: Any = None
    table: bool = True


def run_eval(spec: str, tasks: str | Sequence[str], report: ReportOptions, *, against: str | None = None,
             options: EvalOptions = EvalOptions(), load: LoadOptions = LoadOptions()) -> dict:
    """Evaluate ``spec`` (and ``against``, the original, on identical prompts); write the report; return the summary.

    ``spec`` is the model to evaluate: an alias (``smollm2-135m``), checkpoint dir, .gguf or hub id; ``tasks``
    ``"niah,passkey,copy,ppl,recall,agreement,speed,lm-eval:TASKS"`` (string or list), task arguments after
    ``:``, e.g. ``niah:single-filler+multikey``, ``recall:8+16+32``; ``against`` the original model to compare
    with, evaluated first on the same prompts, or an earlier eval report whose original (or model) results are
    taken when its grid is this run's (:mod:`linearize.evals.earlier`). ``report``, ``options`` and ``load``: see
    their classes.
    """
    t_start = time.time()
    specs = parse_tasks(tasks)
    options.check_counts()
    placement: dict = {}
    if load.max_memory is not None or load.offload_dir is not None:  # bad values fail here, before any model loads

        placement = {"max_memory": check_placement(load.device, load.max_memory, load.offload_dir),
                     "offload_dir": load.offload_dir}
    cfg = options.config()
    if against is None and any(s.name == "agreement" for s in specs):
        raise EvalError("task 'agreement' needs against= (--against SPEC): the original generates the text it is scored on")
    check_data(cfg.data)  # a bad --data spec or a missing corpus: one line, before any model loads
    # --against an earlier eval report: the original's rows come from it (same grid), no original is loaded
    earlier = load_earlier(against, [s.label for s in specs], cfg) if is_report(against) else None
    out_dir, overwrite = Path(report.out_dir), report.overwrite

    # a model checkpoint, a folder inside one, another command's output, a read-only or file parent: one line here,
    # before any model is loaded
    check_output(out_dir, overwrite=overwrite, command="eval", error=EvalError)
    for s_ in (spec, against):  # local checkpoints: check before loading anything
        if s_:
            _check_limit(s_, _peek_max_positions(s_), cfg, specs)
    if any(s.name == "lm-eval" for s in specs):
        lm_eval.require_lm_eval()  # fail before loading any model
    loader = load.loader or _default_loader()

    console = report.console
    if console is None and report.progress:
        console = make_console(stderr=True)
    ui = _RichProgress(console) if report.progress else _Quiet()
    roles = ([("against", against)] if against and not earlier else []) + [("model", spec)]
    results: dict[str, dict] = {}
    rows_by_role: dict[str, list[dict]] = {}
    shared: dict = {}
    meta: dict = {"chat_template": {}, "device": None, "dtype": None}
    with atomic_write(out_dir, directory=True) as tmp:  # renamed to out_dir at the end; removed on any error
        with ui, open(tmp / "results.jsonl", "w", encoding="utf-8") as fout:
            if earlier:
                for r in earlier.rows:
                    fout.write(json.dumps({"model": "against", "spec": earlier.spec, **r}, ensure_ascii=False) + "\n")
                rows_by_role["against"] = earlier.rows
                results["against"] = {"model": earlier.spec, "chat_template": earlier.chat_template,
                                      "tasks": earlier.tasks, "from_report": str(earlier.path)}
                meta["chat_template"]["against"] = earlier.chat_template
                ui.note(f"original: {earlier.spec}, from the report {earlier.path}")
            for role, s in roles:
                model, tokenizer = loader(s, dtype=load.dtype, device=load.device, **placement)
                model.eval()
                handle = ModelHandle(spec=s, role=role, model=model, tokenizer=tokenizer,
                                     chat=_resolve_chat(tokenizer, cfg.chat_template, s))
                _check_limit(s, handle.max_positions, cfg, specs)
                meta["chat_template"][role] = handle.chat
                meta["device"] = _placement(model, handle)
                if placement:
                    ui.note(f"{ROLE_NAME[role]} ({s}): {meta['device']}")
                meta["dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
                if earlier and earlier.dtype and earlier.dtype != meta["dtype"]:
                    raise EvalError(f"--against {earlier.path}: that report ran in {earlier.dtype}, this model loads "
                                    f"in {meta['dtype']}: pass --dtype {earlier.dtype} or evaluate the original again")
                per_task: dict[str, dict] = {}
                rows_by_role[role] = []
                for ts in specs:
                    ui.start(f"{ROLE_NAME[role]} · {ts.label}", ts.module.count(cfg, ts.args))
                    t0 = time.time()
                    try:
                        rows = ts.module.run(handle, cfg, ts.args, ui, shared)
                    except Exception as e:  # out of memory: one line naming task, model, layer and batch

                        if not is_oom(e):
                            raise
                        raise oom_error(e, "eval", where=f"in task {ts.label} on the {ROLE_NAME[role]} ({s})",
                                        advice="try shorter --lengths, --dtype bfloat16, --max-memory (offload layers) "
                                               "or --device cpu") from None
                    summ = ts.module.summarize(rows, cfg)
                    if ts.name == "ppl" and summ.get("by_length"):  # its headline score is at the longest length
                        summ.setdefault("score_length", max(int(k) for k in summ["by_length"]))
                    summ["seconds"] = round(time.time() - t0, 2)
                    if ts.arg:
                        summ["spec"] = ts.label
                    per_task[ts.name] = summ
                    for r in rows:
                        fout.write(json.dumps({"model": role, "spec": s, **r}, ensure_ascii=False) + "\n")
                    fout.flush()
                    rows_by_role[role].extend(rows)
                results[role] = {"model": s, "chat_template": handle.chat, "tasks": per_task}
                del handle, model, tokenizer
                _free()
        summary: dict = {
            "model": spec,
            "tasks": results["model"]["tasks"],
            "against": results.get("against"),
            "difference": ({t: task_difference(t, results["model"]["tasks"][t], results["against"]["tasks"][t])
                            for t in results["model"]["tasks"] if t in results["against"]["tasks"]}
                           if "against" in results else None),
            "config": {
                "tasks": [s.label for s in specs], "lengths": cfg.lengths, "depths": cfg.depths, "seeds": cfg.seeds,
                "chat_template": meta["chat_template"], "data": cfg.data or "wiki", "batch_sizes": cfg.batch_sizes,
                "max_new_tokens": cfg.max_new_tokens, "gen_batch_size": cfg.gen_batch_size,
                "device": meta["device"], "dtype": meta["dtype"],
            },
            "prompts_identical": _prompts_identical(rows_by_role),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": _versions(),
        }
        for t, d in (summary["difference"] or {}).items():  # recall tasks: prompt by prompt against the original
            if t in PAIRED_TASKS:
                d["paired_by_length"] = paired_by_length([r for r in rows_by_role["model"] if r["task"] == t],
                                                         [r for r in rows_by_role["against"] if r["task"] == t],
                                                         _row_key)
        if earlier and summary["prompts_identical"] is False:
            raise EvalError(f"--against {earlier.path}: that report's prompts differ from this run's (another "
                            f"tokenizer or chat template): evaluate the original again")
        summary["elapsed_s"] = round(time.time() - t_start, 1)
        write_report(tmp, summary)
        (tmp / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        write_marker(tmp, "eval")
        normalize_modes(tmp)  # the usual file modes, whatever a writer used
        check_output(out_dir, overwrite=overwrite, command="eval", error=EvalError)  # what is there now (a run beside)
    if report.progress and report.table and console is not None:
        console.print(summary_table(summary))
    return summary


ROLE_NAME = {"model": "model", "against": "original"}


def _placement(model, handle: ModelHandle) -> str:
    """``cpu`` / ``cuda:0``, or for a model dispatched by accelerate (``--max-memory``)
    ``cuda:0 + offload (cpu, disk): decoder layers 20 on cuda:0, 8 on cpu, 4 on disk``."""
    try:
        return placement(model)
    except Exception:  # noqa: BLE001  # pragma: no cover - a stand-in model from a custom loader
        return str(handle.device)


def _free() -> None:
    gc.collect()
    try:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001  # pragma: no cover
        pass

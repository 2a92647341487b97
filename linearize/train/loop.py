"""The training loop of both stages: attention transfer (:mod:`.distill`) and LoRA (:mod:`.finetune`).

A stage hands the loop a :class:`Stage`: the parameters it trains, one pass over a piece of a micro-batch (its
losses, and the loss to back-propagate unless the pass back-propagated as it went), a step's entry in the history
and its part of the resumable state. :class:`StageLoop` does the rest the same way for both:

- AdamW (betas 0.9, 0.95) with a linear warmup and a cosine decay to ``min_lr_ratio`` x ``lr`` (:func:`lr_lambda`);
- the memory plan: the first micro-batch is measured at 1 and 2 rows and every micro-batch then runs as that many
  equal passes (:func:`.memory.plan_pieces`); gradients add up over the passes and the ``grad_accum``
  micro-batches of a step;
- under torchrun each rank trains on its rows of the global micro-batch (:func:`linearize.distributed.shard`);
  gradients are averaged over ranks by DDP or, where no DDP wrapper runs (stage 1, ``--fsdp``), once per step
  here; they are clipped to norm 1;
- the guards (:mod:`.guards`): a non-finite or exploding loss and a non-finite gradient stop the run before the
  update; Ctrl-C and out of memory save the state as of the last completed step; an optimizer step is never cut
  in half;
- a resumable state every ``checkpoint_every`` steps and at the end, and a progress line per step;
- with the stage's ``lengths``, each step's rows cut into rows of a length drawn by the seed and the step
  (:func:`step_length`): the same tokens, trained at several context lengths.

The state file (``distill-state.pt`` / ``finetune-state.pt`` in a folder beside the output) records the settings
fingerprint (:func:`fingerprint`): ``resume=True`` continues from it only when the model, the recipe's math, the
data, the seed and the budget match, and a refusal names the first setting that differs (:func:`open_state`).
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import itertools
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch

from .. import distributed as dist
from ..atomic import atomic_write
from ..convert.selection import describe_layout
from ..errors import TrainingError
from ..progress import step_progress
from .guards import LossGuard, whole_step
from .memory import plan_pieces

#: fields of a stage's recipe section that change no math: never part of a resume fingerprint
NOT_FINGERPRINTED = ("checkpoint_every", "activation_checkpointing", "max_loss_ratio")
#: fields added after states were first written: fingerprinted only when set to something else than this value
#: (what every run did before they existed), so those states still resume
ADDED_LATER = {"copy_fraction": 0, "layers": "linear", "windows": [], "lengths": [], "train_window": None}
#: history entries a run keeps (the report's ``history``)
HISTORY = 200


# ----------------------------------------------------------------------------------------- per-step draws


def step_choice(values: list, seed: int, step: int, what: str):
    """One of ``values`` for optimizer step ``step``, drawn by the seed, the step and ``what`` alone (so a resumed
    run draws the same), or None when ``values`` is empty."""
    return random.Random(f"{seed}:{what}:{step}").choice(values) if values else None


def step_length(cfg: dict[str, Any], step: int) -> int | None:
    """The row length step ``step`` trains at: drawn from the stage's ``lengths`` (each divides ``seq_len``), or
    None (``seq_len``) when the list is empty."""
    return step_choice(cfg["lengths"], cfg["seed"], step, "length")


@contextlib.contextmanager
def training_window(model, window: int | None) -> Iterator[None]:
    """Every windowed linear layer of ``model`` at ``window`` tokens for the block (``None``: unchanged), then
    back at its own."""
    mods = [m for m in model.linear_modules() if window and getattr(m, "window", 0) > 0]
    own = [m.window for m in mods]
    for m in mods:
        m.window = window
    try:
        yield
    finally:
        for m, w in zip(mods, own):
            m.window = w


# ----------------------------------------------------------------------------------------- settings


def stage_settings(recipe, stage: str, tokens: int, loss: str | None = None) -> dict[str, Any]:
    """The recipe's part of a stage's resume fingerprint, flat and in schema order: ``distill.lr`` ..., the token
    budget (``tokens``) and, for finetune, the loss. Known before any model is loaded."""
    out: dict[str, Any] = {f"{stage}.{k}": v for k, v in recipe[stage].items() if k not in NOT_FINGERPRINTED}
    out["tokens"] = int(tokens)
    if loss is not None:
        out["loss"] = loss
    return out


def model_settings(config) -> dict[str, Any]:
    """The model's part of a resume fingerprint: the layer layout, the linear-attention settings, the source."""
    return {"layers": list(config.layer_types),
            **{f"attention.{k}": v for k, v in (config.linear_attention or {}).items()},
            "base": getattr(config, "_name_or_path", "")}


def fingerprint(model, recipe, stage: str, tokens: int, loss: str | None = None) -> str:
    """What must match for a stage's state to be resumed: the model's source and layout, the stage's recipe
    section (but for :data:`NOT_FINGERPRINTED`), its data, seed and token budget and, for finetune, the loss."""
    cfg, section = model.config, recipe[stage]
    math_fields = {k: v for k, v in section.items()
                   if k not in NOT_FINGERPRINTED and not (k in ADDED_LATER and v == ADDED_LATER[k])}
    blob = {"base": getattr(cfg, "_name_or_path", ""), "layers": cfg.layer_types, "attention": cfg.linear_attention,
            stage: math_fields, "data": section["data"], "seed": section["seed"], "tokens": tokens}
    if loss is not None:
        blob["loss"] = loss
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _show(key: str, value: Any) -> str:
    if key == "layers" and isinstance(value, list):
        return describe_layout(value)
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def first_difference(stage: str, saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """``distill.lr differs (checkpoint 0.001, now 0.002)`` for the first setting of ``now`` that ``saved`` (a resume
    state's settings) records with another value; None when every shared setting matches."""
    labels = {"tokens": f"the {stage} token budget", "loss": f"the {stage} loss (--loss)",
              "layers": "the layer layout", "base": "the model"}
    for key, value in now.items():
        if key in saved and saved[key] != value:
            return (f"{labels.get(key, key)} differs (checkpoint {_show(key, saved[key])}, "
                    f"now {_show(key, value)})")
    return None


def resume_refusal(stage: str, ckpt: Path, saved: dict[str, Any] | None, now: dict[str, Any],
                   hashes: tuple[str | None, str] | None = None) -> TrainingError | None:
    """The one-line refusal of a ``--resume`` whose settings differ from those its state ``ckpt`` was written with
    (named setting first; the two fingerprints only for a state that recorded no settings). With ``hashes`` (the
    state's fingerprint, this run's) those decide; without, the settings known so far (before the model loads)."""
    if hashes is not None and hashes[0] == hashes[1]:
        return None
    diff = first_difference(stage, saved or {}, now)
    if diff is not None:
        return TrainingError(f"--resume: {diff}, and a {stage} state resumes only with the settings of its "
                             f"fingerprint ({ckpt}); pass the checkpoint's value, or drop --resume to start over")
    if hashes is not None:
        return TrainingError(f"cannot resume from {ckpt}: it was written with other settings (model, recipe, data, "
                             f"seed, budget; fingerprint {hashes[0]} != {hashes[1]}); remove it or drop --resume")
    return None


def saved_settings(ckpt: Path) -> dict[str, Any] | None:
    """The settings a resume state was written with, read without its tensors (None: an older state records none)."""
    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: one line
        raise TrainingError(f"--resume: cannot read {ckpt} ({type(e).__name__}); remove it or drop --resume") from None
    settings = state.get("settings") if isinstance(state, dict) else None
    return settings if isinstance(settings, dict) else None


# ----------------------------------------------------------------------------------------- state file


@dataclass
class StateFile:
    """A stage's resumable state: where it is kept (None: nowhere), what this run's must record, and the state
    read back for ``--resume`` (None: the run starts at step 0)."""

    path: Path | None
    fingerprint: str
    settings: dict[str, Any]
    saved: dict[str, Any] | None = None


def open_state(stage: str, filename: str, model, recipe, tokens: int, *, state_dir: Path | None, resume: bool,
               loss: str | None = None) -> StateFile:
    """The state of ``stage`` in ``state_dir``, read when ``resume`` and one exists; raises the one-line refusal
    when it was written with other settings (before the caller touches the model)."""
    fp = fingerprint(model, recipe, stage, tokens, loss)
    settings = {**stage_settings(recipe, stage, tokens, loss), **model_settings(model.config)}
    path = Path(state_dir) / filename if state_dir is not None else None
    state = StateFile(path, fp, settings)
    if resume and path is not None and path.is_file():
        state.saved = torch.load(path, map_location="cpu", weights_only=False)
        refusal = resume_refusal(stage, path, state.saved.get("settings"), settings,
                                 (state.saved.get("fingerprint"), fp))
        if refusal is not None:
            raise refusal
    return state


def _save_state(path: Path, state: dict[str, Any]) -> None:
    """``torch.save`` ``state`` to ``path`` atomically: a kill leaves the old state or the new."""
    with atomic_write(path) as tmp:
        torch.save(state, tmp)


def rng_state(device: torch.device) -> dict[str, Any]:
    """The global RNG state (CPU, and ``device``'s on CUDA), to be put back by :func:`set_rng_state`."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def lr_lambda(total_steps: int, warmup: int, floor: float) -> Callable[[int], float]:
    """The learning-rate factor at an optimizer step: linear warmup over ``warmup`` steps, then a cosine from 1 to
    ``floor`` at ``total_steps``."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = (step - warmup) / max(1, total_steps - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


# ----------------------------------------------------------------------------------------- the loop


class Stage(abc.ABC):
    """What a training stage hands :class:`StageLoop`.

    Attributes:
        name: the recipe section (``"distill"``, ``"finetune"``): messages, progress, ``--set`` advice.
        cfg: that section's values.
        params: the parameters that train (optimized, clipped, averaged over ranks).
        device: where the micro-batches go.
        dtype: the model's parameter dtype (out-of-memory advice).
        layers: the layer index of each loss :meth:`micro` returns, or None for one loss.
        lean: ``(what, switch_on)``, a leaner mode the memory plan turns on when one row does not fit, or None.
        average_gradients: average the gradients over torchrun ranks once per step (no DDP wrapper does it).
        step: the optimizer step under way (0-based), set by the loop before each pass (a per-step draw's index).
    """

    name: str

    def __init__(self, cfg: dict[str, Any], params: list[torch.nn.Parameter], model, *,
                 layers: list[int] | None = None, lean: tuple[str, Callable[[], None]] | None = None,
                 average_gradients: bool = False):
        self.cfg, self.params = cfg, params
        self.device, self.dtype = model.device, next(model.parameters()).dtype
        self.layers, self.lean, self.average_gradients = layers, lean, average_gradients
        self.step = 0

    @abc.abstractmethod
    def micro(self, ids: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of ``ids`` [b, T] (this rank's rows): this rank's losses (detached; one per entry of
        ``layers``, or a scalar) and the loss to back-propagate, already divided by ``parts`` (the passes that
        make the step), or None when the pass back-propagated its loss / ``parts`` itself."""

    def no_sync(self) -> ContextManager:
        """Around a pass whose gradients are not yet to be averaged over ranks (DDP: all but a step's last)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def summary(self, losses: list[torch.Tensor], pieces: int, lr: float) -> dict[str, Any]:
        """A step's history entry (after its ``step``) from the global losses of its passes (``pieces`` per
        micro-batch, in order) and the learning rate it ran at."""

    @abc.abstractmethod
    def info(self, entry: dict[str, Any]) -> str:
        """The progress line's text for a history entry."""

    @abc.abstractmethod
    def saved(self, loop: StageLoop) -> dict[str, Any]:
        """The stage's part of the resumable state (its trained tensors and whatever else it resumes from)."""

    @abc.abstractmethod
    def restore(self, state: dict[str, Any], loop: StageLoop) -> None:
        """Put back what :meth:`saved` wrote (before the optimizer's state is loaded)."""


class StageLoop:
    """Optimizer, schedule and resume of one stage (at construction), then its training loop (:meth:`run`).

    After :meth:`run`: ``step``, ``tokens_seen`` (over all runs), ``tokens_this_run``, ``pieces`` (passes per
    micro-batch), ``train_seconds`` (this run, without the memory measurement) and ``history`` (the last
    :data:`HISTORY` entries)."""

    def __init__(self, stage: Stage, state: StateFile, total_steps: int, *, log: Callable[[str], None] = print):
        cfg = stage.cfg
        self.stage, self.state, self.total, self.log = stage, state, total_steps, log
        self.opt = torch.optim.AdamW(stage.params, lr=cfg["lr"], weight_decay=cfg["weight_decay"], betas=(0.9, 0.95))
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lr_lambda(total_steps, cfg["warmup_steps"], cfg["min_lr_ratio"]))
        self.step, self.history = 0, []
        if state.saved is not None:
            stage.restore(state.saved, self)
            self.opt.load_state_dict(state.saved["optimizer"])
            self.sched.load_state_dict(state.saved["scheduler"])
            self.step = state.saved["step"]
            log(f"{stage.name}: resumed at step {self.step}/{total_steps} from {state.path}")
        self.tokens_seen = self.step * cfg["grad_accum"] * cfg["batch_size"] * cfg["seq_len"]
        self.tokens_this_run, self.pieces, self.train_seconds, self._t_train = 0, 0, 0.0, 0.0
        self.rng: dict[str, Any] = {}  # the RNG state as of the last completed step (what a resume starts from)

    def save(self) -> None:
        """Write the resumable state as of the last completed step (rank 0; nothing without a state file)."""
        if self.state.path is not None and dist.is_main():
            _save_state(self.state.path, {"fingerprint": self.state.fingerprint, "settings": self.state.settings,
                                          "step": self.step, "optimizer": self.opt.state_dict(),
                                          "scheduler": self.sched.state_dict(), **self.stage.saved(self)})

    def run(self, batches: Iterator[torch.Tensor], *, progress: bool = True) -> None:
        """Train from ``step`` to the last step on ``batches`` (global micro-batches [B, T] from the first; those
        of the completed steps are skipped)."""
        stage, cfg = self.stage, self.stage.cfg
        accum = cfg["grad_accum"]
        # a batch depends only on the data, the seed and its index: skipping the consumed ones keeps a resume exact
        batches = itertools.islice(batches, self.step * accum, self.total * accum)
        self.rng = rng_state(stage.device)
        guard = LossGuard(stage.name, cfg, ckpt=self.state.path, layers=stage.layers, dtype=stage.dtype)
        bar = step_progress(stage.name, disable=not (progress and dist.is_main()))
        self._t_train = time.time()
        with guard.stops(lambda: self.step, self.total, self.save, self.opt), bar:
            task = bar.add_task(stage.name, total=self.total, completed=self.step, info="", unit="steps")
            while self.step < self.total:
                self.opt.zero_grad(set_to_none=True)
                losses: list[torch.Tensor] = []
                for i in range(accum):
                    losses += self._micro_batch(next(batches), guard, last=i == accum - 1)
                entry = self._update(losses, guard)
                rate = self.tokens_this_run / max(1e-9, time.time() - self._t_train)
                bar.update(task, completed=self.step, info=f"{stage.info(entry)}  {rate:,.0f} tok/s")
                if self.step % cfg["checkpoint_every"] == 0 or self.step == self.total:
                    self.save()
        self.train_seconds = time.time() - self._t_train

    def _micro_batch(self, batch: torch.Tensor, guard: LossGuard, *, last: bool) -> list[torch.Tensor]:
        """Forward and backward of one global micro-batch ``batch`` [B, T] (this rank's rows, in ``pieces``
        passes; ``last``: the step's last micro-batch); returns the global losses of the passes."""
        stage, accum = self.stage, self.stage.cfg["grad_accum"]
        rows = dist.shard(batch).to(stage.device)  # [B / ranks, T]
        if not self.pieces:  # measure a pass at 1 and 2 rows; split micro-batches that would not fit
            t_plan = time.time()
            self.pieces = plan_pieces(stage.name, rows.shape[0], stage.cfg["seq_len"], stage.device,
                                      lambda n: self._measure(rows[:n]), log=self.log, lean=stage.lean)
            self.opt.zero_grad(set_to_none=True)
            self._t_train += time.time() - t_plan  # measuring is not training time
        out = []
        stage.step = self.step
        length = step_length(stage.cfg, self.step)
        for j, piece in enumerate(rows.chunk(self.pieces)):
            sync = last and j == self.pieces - 1  # DDP averages the gradients over ranks after the step's last pass
            if length and length != piece.shape[1]:
                piece = piece.reshape(-1, length)  # [b, T] -> [b T / length, length]: the same tokens
            with stage.no_sync() if not sync else contextlib.nullcontext():
                local, pending = stage.micro(piece, accum * self.pieces)
                loss = dist.all_reduce_mean(local)  # the global batch's
                guard.check(loss, self.step)  # NaN/Inf or exploding: stop before the update
                if pending is not None:
                    pending.backward()
            del pending
            out.append(loss)
        self.tokens_seen += batch.numel()
        self.tokens_this_run += batch.numel()
        return out

    def _measure(self, ids: torch.Tensor) -> None:
        """Forward and backward of ``ids`` without averaging over ranks (the memory plan's measurement)."""
        with self.stage.no_sync():
            _, pending = self.stage.micro(ids, 1)
            if pending is not None:
                pending.backward()

    def _update(self, losses: list[torch.Tensor], guard: LossGuard) -> dict[str, Any]:
        """The optimizer step on the accumulated gradients; returns its history entry."""
        stage = self.stage
        if stage.average_gradients:
            dist.average_gradients(stage.params)  # the mean over ranks, once per optimizer step
        guard.check_gradient(torch.nn.utils.clip_grad_norm_(stage.params, 1.0), self.step)
        lr = self.sched.get_last_lr()[0]
        with whole_step():  # Ctrl-C waits for the update and what the saved state records
            self.opt.step()
            self.sched.step()
            self.step += 1
            self.rng = rng_state(stage.device)
            entry = {"step": self.step, **stage.summary(losses, self.pieces, lr)}
            self.history = (self.history + [entry])[-HISTORY:]
        return entry

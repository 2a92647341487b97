"""Guards for long runs: stop on a bad loss, turn out-of-memory into one line, never lose the work done.

Shared by the training loop of both stages (:mod:`linearize.train.loop`), evaluation
(:mod:`linearize.evals.runner`), model loading and the CLI's last-resort handler:

- :meth:`LossGuard.check` looks at each micro-batch's loss before the optimizer update. NaN/Inf, or a
  loss more than the stage's ``max_loss_ratio`` times its running mean (an exploding run), stops the run
  with a :class:`~linearize.errors.TrainingError` naming the stage, layer and step; so does a non-finite
  gradient (:meth:`LossGuard.check_gradient`). Nothing is saved from the bad step: the last periodic
  checkpoint is kept.
- :meth:`LossGuard.out_of_memory` turns a CUDA or host out-of-memory error inside the training loop
  into a :class:`~linearize.errors.ResourceError` (exit 3). Like Ctrl-C, it first saves the
  resumable state as of the last completed optimizer step (unless the optimizer step itself was cut
  short), so ``--resume`` continues; the message names the stage, layer, step and what to change.
- :func:`is_oom` recognises the three ways memory runs out (``torch.OutOfMemoryError``,
  ``MemoryError``, the CPU allocator's ``RuntimeError``) and :func:`oom_error` describes one anywhere
  else (evaluation, loading, generation). The layer and the batch shape are read from the
  traceback: the innermost module frame with a ``layer_idx`` and the innermost ``input_ids``.

The exploding-loss factor is the recipe's ``distill.max_loss_ratio`` / ``finetune.max_loss_ratio``; 0 turns
the check off (a run whose loss legitimately jumps, e.g. a data set that switches domain).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from ..errors import ResourceError, TrainingError, TrainingInterrupted
from ..recipe import MAX_LOSS_RATIO

#: micro-batches seen before the exploding-loss check starts (the running mean settles first)
WARMUP_MICRO_BATCHES = 10
#: weight of the past in the running mean (exponential moving average)
EMA_BETA = 0.9
#: per-layer losses are compared with at least this share of the mean over layers
SMALL_LAYER_SHARE = 0.01


# ----------------------------------------------------------------------------------------- out of memory


def is_oom(exc: BaseException) -> bool:
    """True for an out-of-memory error: CUDA (``torch.OutOfMemoryError``), Python's ``MemoryError``, the CPU
    allocator's ``RuntimeError`` ("can't allocate memory") or cuBLAS failing to allocate its workspace
    (``CUBLAS_STATUS_ALLOC_FAILED``, raised as a plain ``RuntimeError``)."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return ("can't allocate memory" in text or "out of memory" in text.lower()
                or "CUBLAS_STATUS_ALLOC_FAILED" in text)
    return False


def memory_kind(exc: BaseException) -> str:
    """``"host"`` or ``"GPU"``: which memory ran out."""
    if isinstance(exc, MemoryError) or "can't allocate memory" in str(exc) or "CPUAllocator" in str(exc):
        return "host"
    return "GPU"


def _traceback_context(exc: BaseException) -> dict[str, Any]:
    """The innermost decoder/attention layer (``self.layer_idx``), the innermost ``input_ids`` batch
    shape and the linearize stage whose code was running, read from the traceback's frames."""
    layer = batch = stage = None
    stages = {"distill.py": "distill", "finetune.py": "finetune", "generation.py": "generate",
              "sources.py": "loading the model"}
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if "/linearize/" in path:
            name = path.rsplit("/", 1)[-1]
            stage = "eval" if "/linearize/evals/" in path else stages.get(name, stage)
        try:
            local = frame.f_locals
        except Exception:  # noqa: BLE001 - a frame we cannot inspect tells us nothing
            local = {}
        me = local.get("self")
        idx = getattr(me, "layer_idx", None) if isinstance(me, torch.nn.Module) else None
        if isinstance(idx, int) and not isinstance(idx, bool):
            layer = idx
        ids = local.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:
            batch = tuple(ids.shape)
        tb = tb.tb_next
    return {"layer": layer, "batch": batch, "stage": stage}


def _free_memory(exc: BaseException) -> None:
    """Drop what the failed step held (frames' activations, the allocator's cache) before saving."""
    traceback.clear_frames(exc.__traceback__)  # frames still running (the training loop) are kept
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _oom_head(exc: BaseException, stage: str | None, *, where: str | None = None, step: str | None = None) -> str:
    """``STAGE: out of GPU memory [where] [in layer L] [at step S] [(batch B x T tokens)]``."""
    ctx = _traceback_context(exc)
    stage = stage or ctx["stage"]
    parts = [f"{stage + ': ' if stage else ''}out of {memory_kind(exc)} memory"]
    if where:
        parts.append(where)
    if ctx["layer"] is not None:
        parts.append(f"in layer {ctx['layer']}")
    if step:
        parts.append(f"at step {step}")
    if ctx["batch"] is not None:
        b, t = ctx["batch"]
        parts.append(f"(batch {b} x {t:,} tokens)")
    return " ".join(parts)


def oom_error(exc: BaseException, stage: str | None = None, *, where: str | None = None, step: str | None = None,
              advice: str | None = None) -> ResourceError:
    """One line for an out-of-memory ``exc``: where it happened (stage, layer, step, batch shape; unknown
    parts come from the traceback or are left out) and ``advice``."""
    if advice is None:
        advice = ("try --dtype bfloat16, shorter inputs or --device cpu" if memory_kind(exc) == "GPU"
                  else "try --dtype bfloat16, shorter inputs or a machine with more memory")
    return ResourceError(f"{_oom_head(exc, stage, where=where, step=step)}; {advice}")


# ----------------------------------------------------------------------------------------- training


class LossGuard:
    """Per-run checks for a training stage (``"distill"`` or ``"finetune"``).

    Args:
        stage: the recipe section, used in messages and suggestions (``--set STAGE.lr=...``).
        cfg: that section's values (lr, batch_size, grad_accum, seq_len, checkpoint_every, max_loss_ratio).
        ckpt: the resumable state file, or None when the caller keeps no state.
        layers: layer indices of the losses passed to :meth:`check` (per-layer losses), or None for one loss.
        dtype: the model's parameter dtype (suggestions: ``--dtype bfloat16`` only helps from fp32).
        max_ratio: the exploding-loss factor (default ``cfg["max_loss_ratio"]``, else the recipe's default; 0 = off).
    """

    def __init__(self, stage: str, cfg: dict[str, Any], *, ckpt: Path | None = None,
                 layers: Sequence[int] | None = None, dtype: torch.dtype | None = None,
                 max_ratio: float | None = None, warmup: int = WARMUP_MICRO_BATCHES):
        self.stage, self.cfg, self.ckpt = stage, cfg, ckpt
        self.layers = list(layers) if layers is not None else None
        self.dtype = dtype
        self.max_ratio = float(cfg.get("max_loss_ratio", MAX_LOSS_RATIO) if max_ratio is None else max_ratio)
        self.warmup = warmup
        self.mean: torch.Tensor | None = None  # running mean per loss, fp64 on the CPU
        self.seen = 0

    # -- loss ------------------------------------------------------------------------------------

    def check(self, losses: torch.Tensor | Sequence[torch.Tensor], step: int) -> None:
        """Stop on a non-finite or exploding loss of one micro-batch (call before ``backward``).

        ``losses`` is one scalar or one scalar per layer (in the order of ``layers``); ``step`` is the
        0-based optimizer step being computed (= steps completed)."""
        if isinstance(losses, torch.Tensor):
            values = losses.detach().reshape(-1)
        else:
            values = torch.stack([v.detach().reshape(()) for v in losses])
        values = values.to("cpu", torch.float64)  # one device sync for all layers
        bad = (~torch.isfinite(values)).nonzero()
        if len(bad):
            i = int(bad[0])
            raise TrainingError(f"{self.stage}: non-finite loss{self._layer(i)} at step {step}; {self._kept()}; "
                                f"{self._lr_advice()}")
        if self.mean is not None and self.seen >= self.warmup and self.max_ratio > 0:
            # a layer whose loss is already ~0 (all its attention inside the window) must not trip on noise:
            # its reference is at least 1% of the mean over layers
            ref = torch.maximum(self.mean, SMALL_LAYER_SHARE * self.mean.mean()).clamp_min(1e-30)
            ratio = values / ref
            i = int(ratio.argmax())
            if ratio[i] > self.max_ratio:
                raise TrainingError(
                    f"{self.stage}: exploding loss{self._layer(i)} at step {step}: {values[i]:.3g} is "
                    f"{ratio[i]:,.0f}x its running mean {ref[i]:.3g} (limit {self.max_ratio:g}x, "
                    f"{self.stage}.max_loss_ratio); {self._kept()}; {self._lr_advice()}")
        self.mean = values.clone() if self.mean is None else EMA_BETA * self.mean + (1 - EMA_BETA) * values
        self.seen += 1

    def check_gradient(self, norm: torch.Tensor, step: int) -> None:
        """Stop on a non-finite gradient norm (the clipped step's, before the update) at 0-based ``step``."""
        if not torch.isfinite(norm):
            raise TrainingError(f"{self.stage}: non-finite gradient at step {step}; the last good checkpoint is kept "
                                f"({self.ckpt or 'none'}); try a lower {self.stage}.lr")

    def _layer(self, i: int) -> str:
        return f" in layer {self.layers[i]}" if self.layers is not None and i < len(self.layers) else ""

    def _kept(self) -> str:
        if self.ckpt is None:
            return "no checkpoint is kept by this call"
        if not Path(self.ckpt).is_file():
            return f"no checkpoint yet (the first comes at step {self.cfg.get('checkpoint_every', '?')})"
        return f"the last good checkpoint is kept ({self.ckpt})"

    def _lr_advice(self) -> str:
        lr = self.cfg.get("lr")
        tip = f"--set {self.stage}.lr={lr / 4:.2g}" if isinstance(lr, (int, float)) else f"--set {self.stage}.lr=..."
        return f"start over with a lower learning rate, e.g. {tip}"

    # -- out of memory ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def stops(self, steps: Callable[[], int], total: int, save: Callable[[], None],
              optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
        """Around a training loop (``steps()`` = optimizer steps completed): Ctrl-C saves the state and
        ends in a one-line note on how to resume; out of memory saves it too (:meth:`out_of_memory`);
        anything else propagates."""
        try:
            yield
        except KeyboardInterrupt:
            if self.ckpt is None:
                raise
            save()  # trainable parameters and optimizer as of the last completed step
            raise TrainingInterrupted(f"{self.stage} interrupted at step {steps()}/{total}; checkpoint saved "
                                      f"in {Path(self.ckpt).parent}; run the same command with --resume to "
                                      f"continue") from None
        except Exception as e:  # noqa: BLE001 - only out of memory is turned into a message
            if not is_oom(e):
                raise
            raise self.out_of_memory(e, step=steps(), total=total, save=save, optimizer=optimizer) from None

    def out_of_memory(self, exc: BaseException, *, step: int, total: int, save: Callable[[], None] | None = None,
                      optimizer: torch.optim.Optimizer | None = None) -> ResourceError:
        """Save the resumable state (when the optimizer is at a step boundary) and describe the OOM.

        Call from the training loop's ``except`` with ``step`` = optimizer steps completed; raise
        the result ``from None``."""
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)  # the failed step's gradients are never applied
        head = _oom_head(exc, self.stage, step=f"{step}/{total}")  # before the frames are cleared
        _free_memory(exc)
        note, resumable = None, False
        if save is not None and self.ckpt is not None:
            if _at_step_boundary(optimizer, step):
                try:
                    save()
                    note, resumable = f"state saved in {Path(self.ckpt).parent}", True
                except Exception as e:  # noqa: BLE001 - saving may itself run out of memory
                    note = f"could not save the state ({type(e).__name__}), so {self._kept()}"
            else:
                note = f"the optimizer step was cut short, so {self._kept()}"
            resumable = resumable or Path(self.ckpt).is_file()
        parts = [head]
        if note:
            parts.append(note)
        if resumable:
            fp32 = self.dtype in (torch.float32, torch.float64)
            bf16 = " (adding --dtype bfloat16 roughly halves the memory)" if fp32 else ""
            parts.append(f"run the same command with --resume{bf16}, or start over with " + self._memory_advice())
        else:
            parts.append("start over with " + self._memory_advice())
        return ResourceError("; ".join(parts))

    def _memory_advice(self) -> str:
        bsz, accum, seq = self.cfg.get("batch_size"), self.cfg.get("grad_accum"), self.cfg.get("seq_len")
        s = self.stage
        if isinstance(bsz, int) and bsz > 1 and isinstance(accum, int):
            return (f"half the memory per step and the same effective batch: --set {s}.batch_size={bsz // 2} "
                    f"--set {s}.grad_accum={accum * 2}")
        if isinstance(seq, int) and seq >= 32:
            return f"shorter sequences: --set {s}.seq_len={seq // 2}"
        return "--dtype bfloat16 or on a machine with more memory"


@contextlib.contextmanager
def whole_step() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) until the block ends, then raise it: wrapped around an optimizer step and the
    bookkeeping that the resumable state records (step counter, scheduler, RNG), so an interrupt saves either
    the step before or the step after, never a half-applied one. Outside the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[tuple[int, Any]] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        if callable(previous):
            previous(*held[0])  # Python's default handler raises KeyboardInterrupt
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt


def _at_step_boundary(optimizer: torch.optim.Optimizer | None, step: int) -> bool:
    """True when every parameter's optimizer state says ``step`` steps were taken: an OOM inside
    ``optimizer.step()`` leaves some parameters updated and some not, which must not be saved."""
    if optimizer is None:
        return True
    for state in optimizer.state.values():
        n = state.get("step") if isinstance(state, dict) else None
        if n is not None and int(n) != step:
            return False
    return True

"""Stage 1, attention transfer: train feature maps so each linear layer reproduces its softmax layer.

The model runs in ``distill`` mode: every linearized layer computes the original softmax output
(which flows on to the next layer, so layers train independently and no second model copy is held)
and its linear output from the same q, k, v. The loss is the mean over layers of the per-layer
normalized MSE ``|o_lin - o_soft|² / |o_soft|²`` on per-head outputs before ``o_proj``, so layers
with large outputs do not dominate. Only feature maps and window mixing logits train. Each layer's loss is
back-propagated as soon as that layer has run (:func:`backward_per_layer`), so a step holds one layer's
graph; a micro-batch that would still not fit the free memory runs as several passes (:mod:`linearize.memory`).

Long runs checkpoint every ``checkpoint_every`` optimizer steps into a state directory beside the
output; ``resume=True`` continues from it only when the fingerprint (model, recipe, data, seed)
matches; the settings it hashes are saved beside it, so a refusal names the first one that differs. A
non-finite or exploding loss stops the run naming the layer and step, keeping the last checkpoint; running out of
memory saves the state first, like Ctrl-C (:mod:`linearize.guards`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from . import distributed as dist
from .data import heldout_sequences, num_batches, packed_batches, parse_tokens
from .errors import TrainingError, TrainingInterrupted  # noqa: F401 - re-exported for callers
from .guards import LossGuard, whole_step
from .memory import plan_pieces


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """Freeze everything but the learned parts of the linear layers; return those parameters."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = []
    for m in model.linear_modules():
        for fm in (m.feature_map_q, m.feature_map_k):
            if fm.learnable:
                params += list(fm.parameters())
        if m.window_logit is not None:
            params.append(m.window_logit)
    for p in params:
        p.requires_grad_(True)
    return params


def layer_loss(module, mse_weight: float = 1.0, xent_weight: float = 0.0,
               reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The loss of one linear layer's last ``distill``-mode forward: ``mse_weight`` x normalized MSE of the
    outputs + ``xent_weight`` x Hedgehog's attention-weight cross-entropy. ``reduce`` (data parallel: the mean
    over ranks) makes the normalizer that of the global batch, so the mean of the ranks' losses is the
    single-process loss."""
    s, t = (x.float() for x in module.distill_pair)
    norm = t.pow(2).mean()
    if reduce is not None:
        norm = reduce(norm)
    loss = mse_weight * (s - t).pow(2).mean() / norm.clamp_min(1e-12)
    if xent_weight > 0 and module.distill_xent is not None:
        loss = loss + xent_weight * module.distill_xent
    return loss


@contextlib.contextmanager
def backward_per_layer(model, scale: float, mse_weight: float = 1.0, xent_weight: float = 0.0,
                       reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Iterator[list[torch.Tensor]]:
    """While active, each linear layer's ``distill``-mode forward ends with its :func:`layer_loss` appended
    (detached, in layer order) to the yielded list and, when gradients are on, ``(loss * scale).backward()``.

    The layers train independently (each learns its own softmax layer, whose output flows on), so each loss can
    be back-propagated as soon as its layer has run and its graph freed: a step holds one layer's autograd graph
    at a time instead of all of them (the embedded model on the CPU: 5.8 GB per 2,048-token row before)."""
    losses: list[torch.Tensor] = []

    def hook(module, args, output) -> None:
        loss = layer_loss(module, mse_weight, xent_weight, reduce)
        module.distill_pair = module.distill_xent = None  # the graph lives on only through `loss`
        losses.append(loss.detach())
        if torch.is_grad_enabled() and loss.requires_grad:
            with torch.autocast(loss.device.type, enabled=False):
                (loss * scale).backward()

    handles = [m.register_forward_hook(hook) for m in model.linear_modules()]
    try:
        yield losses
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def evaluate_layers(model, ids: torch.Tensor, batch_size: int = 4) -> dict[str, list[float]]:
    """Held-out per-layer MSE (raw and normalized) of the linear layers against softmax."""
    model.set_attention_mode("distill")
    raw = torch.zeros(len(model.linear_modules()), dtype=torch.float64)
    norm = torch.zeros_like(raw)
    n = 0
    for i in range(0, ids.shape[0], batch_size):
        batch = ids[i : i + batch_size].to(model.device)
        model(input_ids=batch, use_cache=False, logits_to_keep=1)  # the losses live in the layers: skip the vocabulary
        for j, m in enumerate(model.linear_modules()):
            s, t = (x.float() for x in m.distill_pair)
            raw[j] += (s - t).pow(2).mean().item() * batch.shape[0]
            norm[j] += ((s - t).pow(2).mean() / t.pow(2).mean().clamp_min(1e-12)).item() * batch.shape[0]
        n += batch.shape[0]
    model.set_attention_mode("linear")
    return {"mse": (raw / n).tolist(), "normalized_mse": (norm / n).tolist()}


#: fields of a stage's recipe section that change no math: never part of a resume fingerprint
NOT_FINGERPRINTED = ("checkpoint_every", "activation_checkpointing")
DISTILL_STATE = "distill-state.pt"


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


def _show(key: str, value: Any) -> str:
    if key == "layers" and isinstance(value, list):
        from .select import describe_layout

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
                   hashes: tuple[str, str] | None = None) -> TrainingError | None:
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


def fingerprint(model, recipe, data: str, seed: int, tokens: int) -> str:
    """What must match for a checkpoint to be resumed."""
    cfg = model.config
    blob = json.dumps({"base": getattr(cfg, "_name_or_path", ""), "layers": cfg.layer_types,
                       "attention": cfg.linear_attention, "distill": {k: v for k, v in recipe["distill"].items()
                                                                    if k != "checkpoint_every"
                                                                    and not (k == "copy_fraction" and v == 0)},
                       "data": data, "seed": seed, "tokens": tokens}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _lr_lambda(total_steps: int, warmup: int, floor: float) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = (step - warmup) / max(1, total_steps - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def _save_state(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def distill(model, tokenizer, recipe, *, state_dir: Path | None = None, resume: bool = False,
            tokens: int | str | None = None, progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Run attention transfer on ``model`` in place; return the stage report."""
    cfg = recipe["distill"]
    budget = parse_tokens(tokens if tokens is not None else cfg["tokens"])
    seq_len, bsz, accum = cfg["seq_len"], cfg["batch_size"], cfg["grad_accum"]
    params = trainable_parameters(model)
    if not params:
        model.set_attention_mode("linear")
        log("distill: the recipe's layers have nothing to learn (fixed feature map, no window); skipped")
        return {"skipped": "nothing to train"}
    device = model.device
    dist.check_batch("distill", bsz)
    master = [p for p in params]
    for p in master:  # train in fp32 even when the model is bf16
        if p.dtype != torch.float32:
            p.data = p.data.float()
    fp = fingerprint(model, recipe, cfg["data"], cfg["seed"], budget)
    settings = {**stage_settings(recipe, "distill", budget), **model_settings(model.config)}
    ckpt = Path(state_dir) / DISTILL_STATE if state_dir is not None else None
    state = None
    if resume and ckpt is not None and ckpt.is_file():  # before any work: a refusal comes at once
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        refusal = resume_refusal("distill", ckpt, state.get("settings"), settings, (state["fingerprint"], fp))
        if refusal is not None:
            raise refusal
    heldout = heldout_sequences(tokenizer, cfg["data"], seq_len=seq_len, n_seqs=cfg["eval_seqs"])
    t_start = time.time()
    before = evaluate_layers(model, heldout)
    micro_total = num_batches(budget, seq_len, bsz)
    total_steps = max(1, micro_total // accum)
    opt = torch.optim.AdamW(master, lr=cfg["lr"], weight_decay=cfg["weight_decay"], betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(total_steps, cfg["warmup_steps"], cfg["min_lr_ratio"]))
    step = 0
    if state is not None:
        for p, saved in zip(master, state["params"]):
            p.data.copy_(saved.to(p.device))
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step = state["step"]
        log(f"distill: resumed at step {step}/{total_steps} from {ckpt}")
    use_autocast = device.type == "cuda"
    # copy augmentation of batch i depends only on (seed, i): skipping the consumed batches keeps a resume exact
    batches = packed_batches(tokenizer, cfg["data"], seq_len=seq_len, tokens=budget, batch_size=bsz,
                             seed=cfg["seed"], copy_fraction=cfg["copy_fraction"])
    batches = itertools.islice(batches, step * accum, total_steps * accum)
    model.set_attention_mode("distill")
    for m in model.linear_modules():
        m.xent_rows = cfg["xent_rows"] if cfg["xent_weight"] > 0 else 0
    model.train()
    # data parallel (and --fsdp, whose stage-1 parameters are replicated): rank 0's starting values everywhere,
    # gradients averaged over ranks once per optimizer step (no DDP wrapper: each layer back-propagates during
    # the forward, see backward_per_layer)
    dist.broadcast_tensors(master)
    reduce = dist.all_reduce_mean if dist.world_size() > 1 else None
    n_layers = len(model.linear_modules())

    def forward_backward(ids: torch.Tensor, scale: float) -> torch.Tensor:
        """One forward of ``ids`` [b, T] in distill mode, each layer's loss x ``scale`` back-propagated as it
        comes; returns the per-layer losses [n_layers] (the global batch's under data parallel)."""
        with backward_per_layer(model, scale, cfg["mse_weight"], cfg["xent_weight"], reduce) as losses:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                # the losses are taken in the layers; logits_to_keep=1 skips the vocabulary projection
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
        lv = torch.stack(losses).float()
        return dist.all_reduce_mean(lv) if reduce is not None else lv

    history: list[dict[str, float]] = []
    run = {"step": step, "tokens_seen": step * accum * bsz * seq_len, "tokens_this_run": 0}
    t_train = time.time()

    def save() -> None:
        if ckpt is not None and dist.is_main():
            _save_state(ckpt, {"fingerprint": fp, "settings": settings, "step": run["step"],
                               "params": [p.detach().cpu() for p in master],
                               "optimizer": opt.state_dict(), "scheduler": sched.state_dict()})

    from .progress import step_progress

    guard = LossGuard("distill", cfg, ckpt=ckpt, layers=[m.layer_idx for m in model.linear_modules()],
                      dtype=next(model.parameters()).dtype)
    bar = step_progress("distill", disable=not (progress and dist.is_main()))
    try:
        with guard.stops(run, total_steps, save, opt), bar:
            task = bar.add_task("distill", total=total_steps, completed=step, info="", unit="steps")
            pieces = 0
            while run["step"] < total_steps:
                opt.zero_grad(set_to_none=True)
                per_layer = torch.zeros(n_layers)
                for _ in range(accum):
                    batch = next(batches)  # the global micro-batch; this rank trains on its rows
                    rows = dist.shard(batch).to(device)
                    if not pieces:  # measure a pass at 1 and 2 rows; split micro-batches that would not fit
                        t_plan = time.time()
                        pieces = plan_pieces("distill", rows.shape[0], seq_len, device,
                                             lambda n: forward_backward(rows[:n], 1.0), log=log)
                        opt.zero_grad(set_to_none=True)
                        t_train += time.time() - t_plan  # measuring is not training time
                    for piece in rows.chunk(pieces):
                        lv = forward_backward(piece, 1.0 / (n_layers * accum * pieces))
                        guard.check(lv, run["step"])  # NaN/Inf, exploding: stop before the update
                        per_layer += lv.cpu() / pieces
                    run["tokens_seen"] += batch.numel()
                    run["tokens_this_run"] += batch.numel()
                if dist.world_size() > 1:
                    dist.average_gradients(master)  # the mean over ranks, once per optimizer step
                torch.nn.utils.clip_grad_norm_(master, 1.0)
                with whole_step():  # Ctrl-C waits for the update and the step counter
                    opt.step()
                    sched.step()
                    run["step"] += 1
                per_layer = per_layer / accum
                worst = int(per_layer.argmax())
                rate = run["tokens_this_run"] / max(1e-9, time.time() - t_train)
                history.append({"step": run["step"], "loss": float(per_layer.mean()),
                                "worst_layer": model.linear_modules()[worst].layer_idx,
                                "worst_loss": float(per_layer[worst])})
                bar.update(task, completed=run["step"], info=f"loss {per_layer.mean():.4f}  worst "
                           f"L{history[-1]['worst_layer']} {per_layer[worst]:.4f}  {rate:,.0f} tok/s")
                if run["step"] % cfg["checkpoint_every"] == 0 or run["step"] == total_steps:
                    save()
    finally:
        for m in model.linear_modules():
            m.xent_rows = 0
    step, tokens_seen, tokens_this_run = run["step"], run["tokens_seen"], run["tokens_this_run"]
    model.eval()
    train_seconds = time.time() - t_train
    after = evaluate_layers(model, heldout)
    layers = [m.layer_idx for m in model.linear_modules()]
    ratios = [b / max(a, 1e-30) for a, b in zip(after["mse"], before["mse"])]
    report = {
        "tokens": tokens_seen, "steps": step, "seq_len": seq_len, "batch_size": bsz, "grad_accum": accum,
        "passes_per_micro_batch": max(1, pieces),  # > 1: split to fit memory (linearize.memory)
        "copy_fraction": cfg["copy_fraction"],  # share of training rows with a long-range copy (0 = off)
        "world_size": dist.world_size(),  # torchrun processes sharing each step's global batch
        "train_seconds": round(train_seconds, 1), "total_seconds": round(time.time() - t_start, 1),
        "tokens_per_second": round(tokens_this_run / max(train_seconds, 1e-9), 1),
        "heldout_mse_start_mean": sum(before["mse"]) / len(layers),
        "heldout_mse_end_mean": sum(after["mse"]) / len(layers),
        "heldout_mse_reduction_mean": sum(ratios) / len(ratios),
        "per_layer": [{"layer": l, "mse_start": a, "mse_end": b, "normalized_start": na, "normalized_end": nb}
                      for l, a, b, na, nb in zip(layers, before["mse"], after["mse"], before["normalized_mse"],
                                                 after["normalized_mse"])],
        "history": history[-200:],
    }
    for p in master:  # back to the model's dtype for saving
        p.requires_grad_(False)
    return report

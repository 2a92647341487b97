"""Stage 1, attention transfer: train feature maps so each linear layer reproduces its softmax layer.

The model runs in ``distill`` mode: every linearized layer computes the original softmax output
(which flows on to the next layer, so layers train independently and no second model copy is held)
and its linear output from the same q, k, v. The loss is the mean over layers of the per-layer
normalized MSE ``|o_lin - o_soft|² / |o_soft|²`` on per-head outputs before ``o_proj``, so layers
with large outputs do not dominate. Only feature maps and window mixing logits train. Each layer's loss is
back-propagated as soon as that layer has run (:func:`backward_per_layer`), so a step holds one layer's
graph. With ``distill.windows`` the sliding window's width is drawn per optimizer step from that list (the same
draw for a given seed and step, so a resume repeats it), so the feature maps are fitted on every share of attention
that lies beyond a window, not only the recipe's; the layers keep their own window after the stage.
Optimizer, schedule, memory plan, checkpoints, resume and guards are the stage loop's
(:mod:`linearize.train.loop`); its state here is ``distill-state.pt`` (step, trained parameters, optimizer, schedule).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .. import distributed as dist
from ..data.packing import heldout_sequences, num_batches, packed_batches
from ..units import parse_tokens
from ..model.layout import training_width
from .loop import Stage, StageLoop, open_state, step_choice, training_window

STATE_FILE = "distill-state.pt"


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """Freeze everything but the learned parts of the linear layers; return those parameters."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for m in model.linear_modules() for p in m.learned_parameters()]
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


def step_window(cfg: dict[str, Any], step: int) -> int | None:
    """The sliding window optimizer step ``step`` trains at: drawn from ``distill.windows`` by the seed and the
    step alone (a resumed run draws the same), or None (the layers' own) when the list is empty."""
    return step_choice(cfg["windows"], cfg["seed"], step, "window")


class AttentionTransfer(Stage):
    """Stage 1 for the loop: the feature maps and window logits train (in fp32), each layer's loss is
    back-propagated during the forward, and the per-layer losses are checked and reported per layer. No DDP
    wrapper: the gradients are averaged over ranks once per step."""

    name = "distill"

    def __init__(self, model, cfg: dict[str, Any], params: list[torch.nn.Parameter]):
        super().__init__(cfg, params, model, layers=[m.layer_idx for m in model.linear_modules()],
                         average_gradients=dist.world_size() > 1)
        self.model = model
        self.reduce = dist.all_reduce_mean if dist.world_size() > 1 else None
        self.autocast = model.device.type == "cuda"

    def micro(self, ids: torch.Tensor, parts: int) -> tuple[torch.Tensor, None]:
        """One distill-mode forward of ``ids`` [b, T], each layer's loss / (layers x ``parts``) back-propagated as
        it comes; returns this rank's per-layer losses [n_layers] (normalized by the global batch)."""
        cfg = self.cfg
        scale = 1.0 / (len(self.model.linear_modules()) * parts)
        with training_window(self.model, step_window(cfg, self.step)), \
                backward_per_layer(self.model, scale, cfg["mse_weight"], cfg["xent_weight"], self.reduce) as losses:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                # the losses are taken in the layers; logits_to_keep=1 skips the vocabulary projection
                self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
        return torch.stack(losses).float(), None

    def summary(self, losses: list[torch.Tensor], pieces: int, lr: float) -> dict[str, Any]:
        per_layer = torch.zeros(len(self.layers))  # [n_layers], the mean over the step's micro-batches
        for lv in losses:
            per_layer += lv.cpu() / pieces
        per_layer = per_layer / self.cfg["grad_accum"]
        worst = int(per_layer.argmax())
        return {"loss": float(per_layer.mean()), "worst_layer": self.layers[worst], "worst_loss": float(per_layer[worst])}

    def info(self, entry: dict[str, Any]) -> str:
        return f"loss {entry['loss']:.4f}  worst L{entry['worst_layer']} {entry['worst_loss']:.4f}"

    def saved(self, loop: StageLoop) -> dict[str, Any]:
        return {"params": [p.detach().cpu() for p in self.params]}

    def restore(self, state: dict[str, Any], loop: StageLoop) -> None:
        for p, saved in zip(self.params, state["params"]):
            p.data.copy_(saved.to(p.device))


def distill(model, tokenizer, recipe, *, state_dir: Path | None = None, resume: bool = False,
            tokens: int | str | None = None, progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Run attention transfer on ``model`` in place; return the stage report.

    ``tokens`` overrides ``distill.tokens``. The state goes to ``state_dir/distill-state.pt`` every
    ``checkpoint_every`` optimizer steps; ``resume=True`` continues from it when the fingerprint matches. With
    ``attention.train_window`` the windowed layers train (and are measured) at that width and keep their own
    after the stage; ``distill.windows`` still draws each step's width."""
    with training_window(model, training_width(recipe["attention"])):
        return _distill(model, tokenizer, recipe, state_dir=state_dir, resume=resume, tokens=tokens,
                        progress=progress, log=log)


def _distill(model, tokenizer, recipe, *, state_dir, resume, tokens, progress, log) -> dict:
    cfg = recipe["distill"]
    budget = parse_tokens(tokens if tokens is not None else cfg["tokens"])
    seq_len, bsz, accum = cfg["seq_len"], cfg["batch_size"], cfg["grad_accum"]
    params = trainable_parameters(model)
    if not params:
        model.set_attention_mode("linear")
        log("distill: the recipe's layers have nothing to learn (fixed feature map, no window); skipped")
        return {"skipped": "nothing to train"}
    dist.check_batch("distill", bsz)
    for p in params:  # train in fp32 even when the model is bf16
        if p.dtype != torch.float32:
            p.data = p.data.float()
    # before any work: a refusal comes at once
    state = open_state("distill", STATE_FILE, model, recipe, budget, state_dir=state_dir, resume=resume)
    heldout = heldout_sequences(tokenizer, cfg["data"], seq_len=seq_len, n_seqs=cfg["eval_seqs"])
    t_start = time.time()
    before = evaluate_layers(model, heldout)
    total_steps = max(1, num_batches(budget, seq_len, bsz) // accum)
    stage = AttentionTransfer(model, cfg, params)
    loop = StageLoop(stage, state, total_steps, log=log)
    batches = packed_batches(tokenizer, cfg["data"], seq_len=seq_len, tokens=budget, batch_size=bsz,
                             seed=cfg["seed"], copy_fraction=cfg["copy_fraction"])
    model.set_attention_mode("distill")
    for m in model.linear_modules():
        m.xent_rows = cfg["xent_rows"] if cfg["xent_weight"] > 0 else 0
    model.train()
    # data parallel (and --fsdp, whose stage-1 parameters are replicated): rank 0's starting values everywhere,
    # gradients averaged over ranks once per optimizer step (no DDP wrapper: each layer back-propagates during
    # the forward, see backward_per_layer)
    dist.broadcast_tensors(params)
    try:
        loop.run(batches, progress=progress)
    finally:
        for m in model.linear_modules():
            m.xent_rows = 0
    model.eval()
    after = evaluate_layers(model, heldout)
    for p in params:  # back to the model's dtype for saving
        p.requires_grad_(False)
    return _report(cfg, loop, before, after, stage.layers, time.time() - t_start,
                   training_width(recipe["attention"]))


def _report(cfg: dict[str, Any], loop: StageLoop, before: dict[str, list[float]], after: dict[str, list[float]],
            layers: list[int], seconds: float, train_window: int | None) -> dict[str, Any]:
    """The stage report: the run's figures and the held-out MSE per layer before and after."""
    ratios = [b / max(a, 1e-30) for a, b in zip(after["mse"], before["mse"])]
    return {
        "tokens": loop.tokens_seen, "steps": loop.step, "seq_len": cfg["seq_len"], "batch_size": cfg["batch_size"],
        "grad_accum": cfg["grad_accum"],
        "passes_per_micro_batch": max(1, loop.pieces),  # > 1: split to fit memory (linearize.train.memory)
        "copy_fraction": cfg["copy_fraction"],  # share of training rows with a long-range copy (0 = off)
        "windows": list(cfg["windows"]),  # sliding windows drawn per step ([]: the layers' own)
        "train_window": train_window,  # the width every windowed layer trained at (None: its own)
        "lengths": list(cfg["lengths"]),  # row lengths drawn per step ([]: seq_len)
        "world_size": dist.world_size(),  # torchrun processes sharing each step's global batch
        "train_seconds": round(loop.train_seconds, 1), "total_seconds": round(seconds, 1),
        "tokens_per_second": round(loop.tokens_this_run / max(loop.train_seconds, 1e-9), 1),
        "heldout_mse_start_mean": sum(before["mse"]) / len(layers),
        "heldout_mse_end_mean": sum(after["mse"]) / len(layers),
        "heldout_mse_reduction_mean": sum(ratios) / len(ratios),
        "per_layer": [{"layer": l, "mse_start": a, "mse_end": b, "normalized_start": na, "normalized_end": nb}
                      for l, a, b, na, nb in zip(layers, before["mse"], after["mse"], before["normalized_mse"],
                                                 after["normalized_mse"])],
        "history": loop.history,
    }

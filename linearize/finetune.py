"""Stage 2, LoRA: brief fine-tuning of the linearized layers' projections with peft adapters.

After attention transfer the linear layers approximate their softmax originals; a short LoRA run on
the q/k/v/o projections of those layers (LoLCATs: r=8, alpha=16) closes most of the remaining gap.
Only the adapters train: feature maps, window mixing logits, the softmax layers and everything else
stay frozen. Two losses:

- ``xent``: next-token cross-entropy on packed text (the model's own loss, labels = input ids);
- ``kl``: ``KL(teacher || student)`` on the logits, where the teacher is the *same* model with the
  original softmax attention switched back on and the adapters disabled (no second model copy),
  and the student is the linear model with adapters on.

Adapters are merged (``merge_and_unload``) at the end, so the returned model is a plain
:class:`~linearize.modeling.LinearizeForCausalLM` with the same parameter names and dtypes as
before, and its checkpoint needs no peft to load. With ``adapter_only_dir`` the adapter is written
there with peft's ``save_pretrained`` instead and the model is returned unchanged.

Checkpoints, resume (fingerprinted), the non-finite-loss stop, Ctrl-C (saves a resumable checkpoint,
raises :class:`~linearize.distill.TrainingInterrupted`) and progress follow stage 1
(:mod:`linearize.distill`). Adapter init and LoRA dropout draw from a generator seeded by
``finetune.seed`` whose state is checkpointed, so a resumed run reproduces an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import distributed as dist
from .attention import arch_spec
from .data import heldout_sequences, num_batches, packed_batches, parse_tokens
from .distill import (TrainingError, TrainingInterrupted, _lr_lambda, _save_state, model_settings, resume_refusal,
                      stage_settings)
from .fsdp import is_sharded, merge_lora
from .memory import plan_pieces

__all__ = ["finetune", "lora_target_regex", "fingerprint", "evaluate", "TrainingError", "TrainingInterrupted"]

STATE_FILE = "finetune-state.pt"


def adapter_layers(model, which: str = "linear") -> list[int]:
    """The layers whose attention projections get adapters: the linearized ones, or ``all``."""
    if which == "all":
        return list(range(model.config.num_hidden_layers))
    return list(model.config.linear_layers)


def lora_target_regex(model, targets: list[str], which: str = "linear") -> str:
    """A regex (peft ``target_modules``) matching only ``targets`` inside the adapted layers.

    e.g. ``model\\.layers\\.(3|4|5)\\.self_attn\\.(q_proj|k_proj|v_proj|o_proj)``; peft full-matches it
    against module names, so other layers (the softmax ones unless ``which == "all"``) and the feature maps
    are never touched.
    """
    spec = arch_spec(model.config.base_model_type)
    layers = "|".join(str(i) for i in adapter_layers(model, which))
    projs = "|".join(re.escape(t) for t in spec.lora_targets(targets))
    return rf"model\.layers\.({layers})\.{re.escape(spec.attention)}\.({projs})"


def fingerprint(model, recipe, data: str, seed: int, tokens: int, loss: str) -> str:
    """What must match for a finetune checkpoint to be resumed (layout, recipe, data, seed, budget, loss)."""
    cfg = model.config
    blob = json.dumps({"base": getattr(cfg, "_name_or_path", ""), "layers": cfg.layer_types,
                       "attention": cfg.linear_attention,
                       "finetune": {k: v for k, v in recipe["finetune"].items()  # (memory knobs change no math)
                                    if k not in ("checkpoint_every", "activation_checkpointing")
                                    and not (k == "copy_fraction" and v == 0)
                                    and not (k == "layers" and v == "linear")},
                       "data": data, "seed": seed, "tokens": tokens, "loss": loss}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``KL(teacher || student)``; logits ``[B, T, V]``, computed in fp32."""
    V = student_logits.shape[-1]
    t = F.log_softmax(teacher_logits.float().reshape(-1, V), dim=-1)
    s = F.log_softmax(student_logits.float().reshape(-1, V), dim=-1)
    return F.kl_div(s, t, reduction="batchmean", log_target=True)


#: rows of logits per chunk of the chunked KL: about 2^28 fp32 values (1 GiB) whatever the vocabulary
KL_CHUNK_VALUES = 1 << 28


@contextlib.contextmanager
def _final_hidden(model):
    """Capture the final norm's output (the hidden states the LM head reads) during a forward: yields a list
    that holds it afterwards. The forward can then ask for ``logits_to_keep=1`` and skip the full logits."""
    box: list[torch.Tensor] = []
    handle = model.model.norm.register_forward_hook(lambda mod, args, out: box.append(out))
    try:
        yield box
    finally:
        handle.remove()


def _kl_chunk(lm_head, h_t: torch.Tensor, h_s: torch.Tensor) -> torch.Tensor:
    # sum over the chunk's rows of KL(teacher || student); h_* [n, d]
    with torch.no_grad():
        t = F.log_softmax(lm_head(h_t).float(), dim=-1)
    s = F.log_softmax(lm_head(h_s).float(), dim=-1)
    return F.kl_div(s, t, reduction="sum", log_target=True)


def chunked_kl(lm_head, h_teacher: torch.Tensor, h_student: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """``KL(teacher || student)`` averaged over tokens, from final hidden states ``[B, T, d]`` instead of logits:
    the LM head and the log-softmaxes run per chunk of rows under activation checkpointing, so at most one
    chunk's ``[rows, vocab]`` logits exist at a time (forward and backward) -- equal to :func:`_kl` on the logits.
    When all rows fit one chunk (``KL_CHUNK_VALUES`` logits) nothing is recomputed.
    """
    from torch.utils.checkpoint import checkpoint

    d = h_student.shape[-1]
    hs, ht = h_student.reshape(-1, d), h_teacher.reshape(-1, d)
    n = hs.shape[0]
    rows = chunk_rows or max(1, KL_CHUNK_VALUES // int(lm_head.weight.shape[0]))
    if n <= rows:  # one chunk: no recomputation needed (the logits are small enough to keep)
        return _kl_chunk(lm_head, ht, hs) / n
    total = h_student.new_zeros((), dtype=torch.float32)
    for a in range(0, n, rows):
        total = total + checkpoint(_kl_chunk, lm_head, ht[a:a + rows], hs[a:a + rows], use_reentrant=False)
    return total / n


def _teacher_hidden(peft_model, model, batch: torch.Tensor) -> torch.Tensor:
    """The original softmax model's final hidden states ``[B, T, d]`` (adapters off, no grad, no full logits)."""
    with torch.no_grad(), peft_model.disable_adapter(), _final_hidden(model) as box:
        model.set_attention_mode("softmax")
        try:
            peft_model(input_ids=batch, use_cache=False, logits_to_keep=1)
        finally:
            model.set_attention_mode("linear")
    return box[-1]


@torch.no_grad()
def evaluate(peft_model, model, ids: torch.Tensor, batch_size: int = 4, teacher: bool = True) -> dict[str, float]:
    """Held-out perplexity of the linear model (adapters as they are) and, with ``teacher``, the
    teacher's perplexity and ``KL(teacher || student)`` per token."""
    was_training = peft_model.training
    peft_model.eval()
    model.set_attention_mode("linear")
    device = model.device
    use_autocast = device.type == "cuda"
    nll = nll_t = kl = 0.0
    n_tok = n_pos = 0
    rows = max(1, KL_CHUNK_VALUES // int(model.lm_head.weight.shape[0]))
    for i in range(0, ids.shape[0], batch_size):
        batch = ids[i : i + batch_size].to(device)  # [b, T]
        # final hidden states, then the LM head per chunk of rows: never a whole [b, T, vocab] logits tensor
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            with _final_hidden(model) as box:
                peft_model(input_ids=batch, use_cache=False, logits_to_keep=1)
            h = box[-1].reshape(-1, box[-1].shape[-1])  # [b*T, d]
            h_t = _teacher_hidden(peft_model, model, batch).reshape(h.shape) if teacher else None
            target = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], -100)], 1).reshape(-1)  # next token
            for a in range(0, h.shape[0], rows):
                s_lp = F.log_softmax(model.lm_head(h[a:a + rows]).float(), dim=-1)
                tgt = target[a:a + rows]
                nll += F.nll_loss(s_lp, tgt, ignore_index=-100, reduction="sum").item()
                if h_t is not None:
                    t_lp = F.log_softmax(model.lm_head(h_t[a:a + rows]).float(), dim=-1)
                    nll_t += F.nll_loss(t_lp, tgt, ignore_index=-100, reduction="sum").item()
                    kl += F.kl_div(s_lp, t_lp, reduction="sum", log_target=True).item()
        n_tok += batch.shape[0] * (batch.shape[1] - 1)
        n_pos += batch.numel()
    peft_model.train(was_training)
    out = {"ppl": math.exp(min(nll / max(n_tok, 1), 700.0))}
    if teacher:
        out["teacher_ppl"] = math.exp(min(nll_t / max(n_tok, 1), 700.0))
        out["kl"] = kl / max(n_pos, 1)
    return out


def _adapter_state(peft_model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in peft_model.named_parameters() if p.requires_grad}


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _save_adapter_atomic(peft_model, out: Path) -> Path:
    """``save_pretrained`` into a temporary sibling, then rename over ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    peft_model.save_pretrained(str(tmp))
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def _set_activation_checkpointing(model, on: bool) -> None:
    """Turn transformers' per-decoder-layer activation checkpointing on or off (non-reentrant): a layer keeps only
    its input and runs its forward again during the backward (one more forward per step: 16% fewer tokens/s on the
    H200 at the 8B shape, a fraction of the activation memory). Newer 5.x releases call it
    ``activation_checkpointing_*``, older ones only ``gradient_checkpointing_*``."""
    new, old = ("activation_checkpointing_enable", "gradient_checkpointing_enable") if on else \
        ("activation_checkpointing_disable", "gradient_checkpointing_disable")
    fn = getattr(model, new, None) or getattr(model, old)
    if on:
        key = "activation_checkpointing_kwargs" if fn.__name__ == new else "gradient_checkpointing_kwargs"
        fn(**{key: {"use_reentrant": False}})
    else:
        fn()


def _checkpointing_activations(model) -> bool:
    """Whether any decoder layer of ``model`` has transformers' activation checkpointing on."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _finish(model):
    """Leave the model as callers expect it: frozen, eval mode, linear attention, no peft attributes, no
    activation checkpointing."""
    if _checkpointing_activations(model):
        _set_activation_checkpointing(model, False)
    for p in model.parameters():
        p.requires_grad_(False)
    model.set_attention_mode("linear")
    model.eval()
    if hasattr(model, "peft_config"):
        try:
            del model.peft_config
        except AttributeError:
            pass
    return model


def finetune(model, tokenizer, recipe, *, state_dir: Path | None = None, resume: bool = False,
             tokens: int | str | None = None, loss: str | None = None, adapter_only_dir: Path | None = None,
             progress: bool = True, log: Callable[[str], None] = print) -> tuple[Any, dict]:
    """Run the LoRA stage on ``model`` (a :class:`LinearizeForCausalLM`); return ``(model, report)``.

    ``tokens`` and ``loss`` override the recipe's ``finetune.tokens`` / ``finetune.loss``. The returned
    model has the adapters merged into its weights (same object, same parameter names and dtypes,
    frozen, eval mode, linear attention). With ``adapter_only_dir`` the adapter is saved there
    (peft ``save_pretrained``, atomically) and the model is returned without the adapter.
    Checkpoints go to ``state_dir/finetune-state.pt`` every ``checkpoint_every`` optimizer steps;
    ``resume=True`` continues from there when the fingerprint matches.
    """
    from peft import LoraConfig, get_peft_model

    cfg = recipe["finetune"]
    loss_kind = loss if loss is not None else cfg["loss"]
    if loss_kind not in ("xent", "kl"):
        raise TrainingError(f"finetune: loss {loss_kind!r} is not one of xent, kl")
    budget = parse_tokens(tokens if tokens is not None else cfg["tokens"])
    seq_len, bsz, accum = cfg["seq_len"], cfg["batch_size"], cfg["grad_accum"]
    if not model.config.linear_layers:
        _finish(model)
        log("finetune: the model has no linear-attention layers; skipped")
        return model, {"skipped": "no linear layers"}
    micro_total = num_batches(budget, seq_len, bsz)
    total_steps = micro_total // accum
    if total_steps == 0:
        raise TrainingError(f"finetune: --tokens {budget:,} is smaller than one optimizer step (batch_size {bsz} x "
                            f"seq_len {seq_len} x grad_accum {accum} = {bsz * seq_len * accum:,} tokens)")
    device = model.device
    dist.check_batch("finetune", bsz)
    t_start = time.time()
    # data first: a bad spec or a too-small split fails before the model is touched
    heldout = heldout_sequences(tokenizer, cfg["data"], seq_len=seq_len, n_seqs=cfg["eval_seqs"])
    # copy augmentation of batch i depends only on (seed, i), so the resume's islice below stays exact
    batches = packed_batches(tokenizer, cfg["data"], seq_len=seq_len, tokens=budget, batch_size=bsz,
                             seed=cfg["seed"], copy_fraction=cfg["copy_fraction"])

    names_before = [n for n, _ in model.named_parameters()]
    dtypes_before = {n: p.dtype for n, p in model.named_parameters()}
    pretraining_tp = getattr(model.config, "pretraining_tp", None)
    fp = fingerprint(model, recipe, cfg["data"], cfg["seed"], budget, loss_kind)
    settings = {**stage_settings(recipe, "finetune", budget, loss_kind), **model_settings(model.config)}
    ckpt = Path(state_dir) / STATE_FILE if state_dir is not None else None
    state = None
    if resume and ckpt is not None and ckpt.is_file():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        refusal = resume_refusal("finetune", ckpt, state.get("settings"), settings, (state.get("fingerprint"), fp))
        if refusal is not None:
            raise refusal

    for p in model.parameters():  # feature maps, window logits, everything: frozen; only adapters train
        p.requires_grad_(False)
    target_regex = lora_target_regex(model, cfg["targets"], cfg["layers"])
    lora_cfg = LoraConfig(r=cfg["lora_r"], lora_alpha=cfg["lora_alpha"], lora_dropout=cfg["lora_dropout"],
                          target_modules=target_regex, bias="none")
    rng = contextlib.ExitStack()  # seeded adapter init and dropout; the caller's RNG is left untouched
    rng.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
    torch.manual_seed(cfg["seed"])
    peft_model = None
    try:
        had_input_grad_hook = hasattr(model, "_require_grads_hook")
        with warnings.catch_warnings():  # peft probes a deprecated transformers property
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            peft_model = get_peft_model(model, lora_cfg)
        if pretraining_tp is not None:
            model.config.pretraining_tp = pretraining_tp
        params = [p for p in peft_model.parameters() if p.requires_grad]
        sharded = is_sharded(model)  # --fsdp: adapters injected after sharding stay replicated (not FSDP's)
        if sharded:
            from torch.distributed.tensor import DTensor

            if any(isinstance(p, DTensor) for p in params):
                raise TrainingError("finetune --fsdp: a trainable parameter is sharded by FSDP; only the "
                                    "replicated LoRA adapters may train")
            dist.broadcast_tensors(params)  # the seeded init is the same everywhere; make it exactly rank 0's
        names = [n for n, p in peft_model.named_parameters() if p.requires_grad]
        spec = arch_spec(model.config.base_model_type)
        adapted = set(model.linear_modules())  # the attention modules that should carry adapters
        if cfg["layers"] == "all":
            adapted |= {getattr(layer, spec.attention) for layer in model.model.layers}
        targets = spec.lora_targets(cfg["targets"])
        expected = {f"{n}.{t}" for n, m in model.named_modules() if m in adapted for t in targets}
        wrapped = {n.rsplit(".lora_", 1)[0].removeprefix("base_model.model.") for n in names}
        if wrapped != expected:  # guards the regex against naming surprises
            raise TrainingError(f"finetune: LoRA wrapped {sorted(wrapped)}, expected {sorted(expected)}")
        n_trainable = sum(p.numel() for p in params)
        opt = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=cfg["weight_decay"], betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(total_steps, cfg["warmup_steps"],
                                                                   cfg["min_lr_ratio"]))
        step = 0
        history: list[dict[str, float]] = []
        if state is not None:
            adapter = state["adapter"]
            if sorted(adapter) != sorted(names):
                raise TrainingError(f"cannot resume from {ckpt}: its adapter tensors do not match this model; "
                                    f"remove it or drop --resume")
            by_name = dict(peft_model.named_parameters())
            with torch.no_grad():
                for n in names:
                    by_name[n].copy_(adapter[n].to(by_name[n].device))
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            step = state["step"]
            history = list(state.get("history", []))
            _set_rng_state(state["rng"], device)
            log(f"finetune: resumed at step {step}/{total_steps} from {ckpt}")
        layers = adapter_layers(model, cfg["layers"])
        kind = "linear" if cfg["layers"] == "linear" else "(all)"
        log(f"finetune: LoRA r={cfg['lora_r']} alpha={cfg['lora_alpha']:g} on {','.join(targets)} of "
            f"{len(layers)} {kind} layers ({n_trainable:,} params), loss {loss_kind}, {total_steps} steps")

        eval_bsz = max(1, min(bsz, 8))
        before = evaluate(peft_model, model, heldout, eval_bsz) if state is None else state["before"]
        use_autocast = device.type == "cuda"
        batches = itertools.islice(batches, step * accum, total_steps * accum)
        model.set_attention_mode("linear")
        peft_model.train()
        # data parallel: DDP averages the adapters' gradients over ranks; --fsdp: dist.average_gradients below
        ddp = peft_model if sharded else dist.wrap(peft_model, device)
        run = {"step": step, "tokens_seen": step * accum * bsz * seq_len, "tokens_this_run": 0,
               "rng": _rng_state(device), "history": history}
        t_train = time.time()

        def save() -> None:
            """Adapters, optimizer, schedule and RNG as of the last completed step."""
            if ckpt is not None and dist.is_main():
                _save_state(ckpt, {"fingerprint": fp, "settings": settings, "step": run["step"],
                                   "adapter": _adapter_state(peft_model),
                                   "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                                   "rng": run["rng"], "history": run["history"], "before": before})

        from .guards import LossGuard, whole_step
        from .progress import step_progress

        guard = LossGuard("finetune", cfg, ckpt=ckpt, dtype=next(model.parameters()).dtype)
        bar = step_progress("finetune", disable=not (progress and dist.is_main()))
        no_sync = ddp.no_sync if ddp is not peft_model else contextlib.nullcontext

        def forward(ids: torch.Tensor) -> torch.Tensor:
            """This rank's loss on ``ids`` [b, T] (token mean)."""
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                if loss_kind == "xent":
                    return ddp(input_ids=ids, labels=ids, use_cache=False).loss
                # KL from final hidden states, chunked: no [B, T, vocab] logits are kept
                h_t = _teacher_hidden(peft_model, model, ids)  # [B, T, d], no grad
                with _final_hidden(model) as box:
                    ddp(input_ids=ids, use_cache=False, logits_to_keep=1)
                return chunked_kl(model.lm_head, h_t, box[-1])

        def run_rows(ids: torch.Tensor) -> None:
            """Forward and backward on ``ids`` without DDP's gradient averaging (memory measurement)."""
            with no_sync():
                forward(ids).backward()

        if cfg["activation_checkpointing"] is True:
            _set_activation_checkpointing(model, True)
        lean = (("activation checkpointing (each decoder layer's forward runs again in the backward)",
                 lambda: _set_activation_checkpointing(model, True)) if cfg["activation_checkpointing"] == "auto"
                else None)  # linearize.memory's plan turns it on when one row does not fit

        with guard.stops(run, total_steps, save, opt), bar:
            task = bar.add_task("finetune", total=total_steps, completed=step, info="", unit="steps")
            pieces = 0
            while run["step"] < total_steps:
                opt.zero_grad(set_to_none=True)
                step_loss = 0.0
                for i in range(accum):
                    full = next(batches)  # the global micro-batch [B, T]; this rank trains on its rows
                    rows = dist.shard(full).to(device)
                    if not pieces:  # measure a pass at 1 and 2 rows; split micro-batches that would not fit
                        t_plan = time.time()
                        pieces = plan_pieces("finetune", rows.shape[0], seq_len, device,
                                             lambda n: run_rows(rows[:n]), log=log, lean=lean)
                        opt.zero_grad(set_to_none=True)
                        t_train += time.time() - t_plan  # measuring is not training time
                    for j, piece in enumerate(rows.chunk(pieces)):
                        last = i == accum - 1 and j == pieces - 1  # DDP averages the gradients after the last
                        with no_sync() if not last else contextlib.nullcontext():
                            micro = forward(piece)
                            global_micro = dist.all_reduce_mean(micro.detach())  # the global batch's loss
                            guard.check(global_micro, run["step"])  # NaN/Inf or exploding: stop before the update
                            (micro / (accum * pieces)).backward()
                        step_loss += global_micro.float().item() / (accum * pieces)
                        del micro
                    run["tokens_seen"] += full.numel()
                    run["tokens_this_run"] += full.numel()
                if sharded:
                    dist.average_gradients(params)  # what DDP does, once per optimizer step
                grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
                if not torch.isfinite(grad_norm):
                    raise TrainingError(f"finetune: non-finite gradient at step {run['step']}; the last good "
                                        f"checkpoint is kept ({ckpt or 'none'}); try a lower finetune.lr")
                lr = sched.get_last_lr()[0]
                with whole_step():  # Ctrl-C waits for the update and what the saved state records
                    opt.step()
                    sched.step()
                    run["step"] += 1
                    run["rng"] = _rng_state(device)  # a step boundary: what a resumed run starts from
                    run["history"] = (run["history"] + [{"step": run["step"], "loss": step_loss, "lr": lr}])[-200:]
                rate = run["tokens_this_run"] / max(1e-9, time.time() - t_train)
                bar.update(task, completed=run["step"],
                           info=f"{loss_kind} {step_loss:.4f}  lr {lr:.2e}  {rate:,.0f} tok/s")
                if run["step"] % cfg["checkpoint_every"] == 0 or run["step"] == total_steps:
                    save()
        del ddp
        step, tokens_seen, tokens_this_run, history = (run["step"], run["tokens_seen"], run["tokens_this_run"],
                                                       run["history"])
        train_seconds = time.time() - t_train
        checkpointed = _checkpointing_activations(model)  # (before _finish turns it off)
        after = evaluate(peft_model, model, heldout, eval_bsz)
        adapter_path = None
        if adapter_only_dir is not None:
            adapter_path = Path(adapter_only_dir)
            if dist.is_main():  # every rank holds the same adapter; rank 0 writes it
                _save_adapter_atomic(peft_model, adapter_path)
            base = peft_model.unload()
        elif sharded:  # each rank adds the deltas into its own shards, then the adapters go
            merge_lora(peft_model)
            base = peft_model.unload()
        else:
            base = peft_model.merge_and_unload()
    except BaseException:
        # leave the caller's model as it was: no adapter layers, frozen, linear mode
        if peft_model is not None:
            with contextlib.suppress(Exception):
                peft_model.unload()
        _finish(model)
        rng.close()
        raise
    rng.close()
    assert base is model
    if not had_input_grad_hook and hasattr(model, "_require_grads_hook"):
        model.disable_input_require_grads()  # peft adds it when the model checkpoints activations
    _finish(model)
    names_after = [n for n, _ in model.named_parameters()]
    if names_after != names_before or any(dtypes_before[n] != p.dtype for n, p in model.named_parameters()):
        raise TrainingError("finetune: merging the adapters changed the model's parameter names or dtypes")
    report = {
        "loss": loss_kind, "tokens": tokens_seen, "steps": step, "seq_len": seq_len, "batch_size": bsz,
        "world_size": dist.world_size(),  # torchrun processes sharing each step's global batch
        "grad_accum": accum,
        "passes_per_micro_batch": max(1, pieces),  # > 1: split to fit memory (linearize.memory)
        "activation_checkpointing": checkpointed,  # the recipe's true, or auto when one row did not fit
        "copy_fraction": cfg["copy_fraction"],  # share of training rows with a long-range copy (0 = off)
        "lora": {"r": cfg["lora_r"], "alpha": cfg["lora_alpha"], "dropout": cfg["lora_dropout"],
                 "targets": list(cfg["targets"]), "layers": layers, "target_modules": target_regex,
                 "trainable_params": n_trainable},
        "merged": adapter_only_dir is None, "adapter_dir": str(adapter_path) if adapter_path is not None else None,
        "seconds": round(time.time() - t_start, 1), "train_seconds": round(train_seconds, 1),
        "tokens_per_second": round(tokens_this_run / max(train_seconds, 1e-9), 1),
        "heldout_ppl_teacher": before["teacher_ppl"],
        "heldout_ppl_start": before["ppl"], "heldout_ppl_end": after["ppl"],
        "heldout_kl_start": before["kl"], "heldout_kl_end": after["kl"],
        "history": history[-200:],
    }
    return model, report

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
:class:`~linearize.model.modeling.LinearizeForCausalLM` with the same parameter names and dtypes as
before, and its checkpoint needs no peft to load. With ``adapter_only_dir`` the adapter is written
there with peft's ``save_pretrained`` instead and the model is returned unchanged.

Optimizer, schedule, memory plan, checkpoints, resume (fingerprinted), the loss guards, Ctrl-C and progress are
the stage loop's (:mod:`linearize.train.loop`); its state here is ``finetune-state.pt`` (step, adapters,
optimizer, schedule, RNG, history, the held-out figures before training). Adapter init and LoRA dropout draw
from the global RNG seeded by ``finetune.seed`` (the caller's is put back afterwards) and checkpointed, so a
resumed run reproduces an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
import warnings
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .. import distributed as dist
from ..model.architectures import arch_spec
from ..model.layout import training_width
from ..atomic import atomic_write
from ..data.packing import heldout_sequences, num_batches, packed_batches
from ..errors import TrainingError
from ..units import parse_tokens
from .fsdp import is_sharded, merge_lora
from .loop import Stage, StageLoop, open_state, set_rng_state, training_window

__all__ = ["finetune", "lora_target_regex", "adapter_layers", "evaluate", "chunked_kl", "STATE_FILE"]

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


# ----------------------------------------------------------------------------------------- losses


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


# ----------------------------------------------------------------------------------------- the stage


class LoRA(Stage):
    """Stage 2 for the loop: the adapters train on next-token cross-entropy or the KL to the teacher. Data
    parallel: DDP (``ddp``, set before training) averages their gradients; ``--fsdp`` (adapters replicated
    outside FSDP): the loop averages them once per step."""

    name = "finetune"

    def __init__(self, peft_model, model, cfg: dict[str, Any], params: list[torch.nn.Parameter], loss: str,
                 sharded: bool):
        lean = (("activation checkpointing (each decoder layer's forward runs again in the backward)",
                 lambda: _set_activation_checkpointing(model, True)) if cfg["activation_checkpointing"] == "auto"
                else None)  # linearize.train.memory's plan turns it on when one row does not fit
        super().__init__(cfg, params, model, lean=lean, average_gradients=sharded)
        self.peft_model, self.model, self.loss = peft_model, model, loss
        self.ddp = peft_model  # what the forward runs: the DDP wrapper under torchrun (without --fsdp)
        self.names = [n for n, p in peft_model.named_parameters() if p.requires_grad]
        self.before: dict[str, float] = {}  # the held-out figures before training (kept across a resume)
        self.autocast = model.device.type == "cuda"

    def micro(self, ids: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's loss on ``ids`` [b, T] (token mean), and that loss / ``parts`` to back-propagate."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            if self.loss == "xent":
                loss = self.ddp(input_ids=ids, labels=ids, use_cache=False).loss
            else:  # KL from final hidden states, chunked: no [B, T, vocab] logits are kept
                h_t = _teacher_hidden(self.peft_model, self.model, ids)  # [B, T, d], no grad
                with _final_hidden(self.model) as box:
                    self.ddp(input_ids=ids, use_cache=False, logits_to_keep=1)
                loss = chunked_kl(self.model.lm_head, h_t, box[-1])
        return loss.detach(), loss / parts

    def no_sync(self) -> ContextManager:
        return self.ddp.no_sync() if self.ddp is not self.peft_model else contextlib.nullcontext()

    def summary(self, losses: list[torch.Tensor], pieces: int, lr: float) -> dict[str, Any]:
        step_loss = 0.0
        for loss in losses:
            step_loss += loss.float().item() / (self.cfg["grad_accum"] * pieces)
        return {"loss": step_loss, "lr": lr}

    def info(self, entry: dict[str, Any]) -> str:
        return f"{self.loss} {entry['loss']:.4f}  lr {entry['lr']:.2e}"

    def saved(self, loop: StageLoop) -> dict[str, Any]:
        """Adapters, RNG and history as of the last completed step, and the held-out figures before training."""
        adapter = {n: p.detach().cpu().clone() for n, p in self.peft_model.named_parameters() if p.requires_grad}
        return {"adapter": adapter, "rng": loop.rng, "history": loop.history, "before": self.before}

    def restore(self, state: dict[str, Any], loop: StageLoop) -> None:
        adapter = state["adapter"]
        if sorted(adapter) != sorted(self.names):
            raise TrainingError(f"cannot resume from {loop.state.path}: its adapter tensors do not match this model; "
                                f"remove it or drop --resume")
        by_name = dict(self.peft_model.named_parameters())
        with torch.no_grad():
            for n in self.names:
                by_name[n].copy_(adapter[n].to(by_name[n].device))
        loop.history = list(state.get("history", []))
        set_rng_state(state["rng"], self.device)
        self.before = state["before"]


# ----------------------------------------------------------------------------------------- adapters


def _add_adapters(model, cfg: dict[str, Any], target_regex: str, pretraining_tp):
    """``model`` wrapped by peft with fresh adapters on ``target_regex`` (drawn from the global RNG)."""
    from peft import LoraConfig, get_peft_model  # imports transformers' peft integration: only when training

    lora_cfg = LoraConfig(r=cfg["lora_r"], lora_alpha=cfg["lora_alpha"], lora_dropout=cfg["lora_dropout"],
                          target_modules=target_regex, bias="none")
    with warnings.catch_warnings():  # peft probes a deprecated transformers property
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(model, lora_cfg)
    if pretraining_tp is not None:
        model.config.pretraining_tp = pretraining_tp
    return peft_model


def _trainable_adapters(peft_model, model, cfg: dict[str, Any], sharded: bool) -> list[torch.nn.Parameter]:
    """The adapters' parameters, checked: replicated under ``--fsdp`` (rank 0's values everywhere) and wrapping
    exactly the targeted projections of the adapted layers."""
    params = [p for p in peft_model.parameters() if p.requires_grad]
    if sharded:  # --fsdp: adapters injected after sharding stay replicated (not FSDP's)
        from torch.distributed.tensor import DTensor  # torch.distributed: only under --fsdp

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
    return params


def _remove_adapters(peft_model, adapter_only_dir: Path | None, sharded: bool):
    """Merge the adapters into the weights (or, with ``adapter_only_dir``, save them there and drop them);
    returns the base model and the adapter folder (or None)."""
    if adapter_only_dir is not None:
        if dist.is_main():  # every rank holds the same adapter; rank 0 writes it, whole or not at all
            with atomic_write(adapter_only_dir, directory=True) as tmp:
                peft_model.save_pretrained(str(tmp))
        return peft_model.unload(), Path(adapter_only_dir)
    if sharded:  # each rank adds the deltas into its own shards, then the adapters go
        merge_lora(peft_model)
        return peft_model.unload(), None
    return peft_model.merge_and_unload(), None


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


# ----------------------------------------------------------------------------------------- the run


def finetune(model, tokenizer, recipe, *, state_dir: Path | None = None, resume: bool = False,
             tokens: int | str | None = None, loss: str | None = None, adapter_only_dir: Path | None = None,
             progress: bool = True, log: Callable[[str], None] = print) -> tuple[Any, dict]:
    """Run the LoRA stage on ``model`` (a :class:`LinearizeForCausalLM`); return ``(model, report)``.

    ``tokens`` and ``loss`` override the recipe's ``finetune.tokens`` / ``finetune.loss``. The returned
    model has the adapters merged into its weights (same object, same parameter names and dtypes,
    frozen, eval mode, linear attention). With ``adapter_only_dir`` the adapter is saved there
    (peft ``save_pretrained``, atomically) and the model is returned without the adapter.
    Checkpoints go to ``state_dir/finetune-state.pt`` every ``checkpoint_every`` optimizer steps;
    ``resume=True`` continues from there when the fingerprint matches. With ``finetune.train_window`` (else
    ``attention.train_window``) the windowed layers train (and the held-out figures are taken) at that width; they
    keep their own after it.
    """
    with training_window(model, training_width(recipe["attention"], recipe["finetune"])):
        return _finetune(model, tokenizer, recipe, state_dir=state_dir, resume=resume, tokens=tokens, loss=loss,
                         adapter_only_dir=adapter_only_dir, progress=progress, log=log)


def _finetune(model, tokenizer, recipe, *, state_dir, resume, tokens, loss, adapter_only_dir, progress,
              log) -> tuple[Any, dict]:
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
    total_steps = num_batches(budget, seq_len, bsz) // accum
    if total_steps == 0:
        raise TrainingError(f"finetune: --tokens {budget:,} is smaller than one optimizer step (batch_size {bsz} x "
                            f"seq_len {seq_len} x grad_accum {accum} = {bsz * seq_len * accum:,} tokens)")
    device = model.device
    dist.check_batch("finetune", bsz)
    t_start = time.time()
    # data first: a bad spec or a too-small split fails before the model is touched
    heldout = heldout_sequences(tokenizer, cfg["data"], seq_len=seq_len, n_seqs=cfg["eval_seqs"])
    batches = packed_batches(tokenizer, cfg["data"], seq_len=seq_len, tokens=budget, batch_size=bsz,
                             seed=cfg["seed"], copy_fraction=cfg["copy_fraction"])
    names_before = [n for n, _ in model.named_parameters()]
    dtypes_before = {n: p.dtype for n, p in model.named_parameters()}
    pretraining_tp = getattr(model.config, "pretraining_tp", None)
    state = open_state("finetune", STATE_FILE, model, recipe, budget, state_dir=state_dir, resume=resume,
                       loss=loss_kind)

    for p in model.parameters():  # feature maps, window logits, everything: frozen; only adapters train
        p.requires_grad_(False)
    target_regex = lora_target_regex(model, cfg["targets"], cfg["layers"])
    rng = contextlib.ExitStack()  # seeded adapter init and dropout; the caller's RNG is left untouched
    rng.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
    torch.manual_seed(cfg["seed"])
    peft_model = None
    try:
        had_input_grad_hook = hasattr(model, "_require_grads_hook")
        peft_model = _add_adapters(model, cfg, target_regex, pretraining_tp)
        sharded = is_sharded(model)
        lora = LoRA(peft_model, model, cfg, _trainable_adapters(peft_model, model, cfg, sharded), loss_kind, sharded)
        loop = StageLoop(lora, state, total_steps, log=log)
        layers = adapter_layers(model, cfg["layers"])
        targets = arch_spec(model.config.base_model_type).lora_targets(cfg["targets"])
        kind = "linear" if cfg["layers"] == "linear" else "(all)"
        n_trainable = sum(p.numel() for p in lora.params)
        log(f"finetune: LoRA r={cfg['lora_r']} alpha={cfg['lora_alpha']:g} on {','.join(targets)} of {len(layers)} "
            f"{kind} layers ({n_trainable:,} params), loss {loss_kind}, {total_steps} steps")
        eval_bsz = max(1, min(bsz, 8))
        if state.saved is None:
            lora.before = evaluate(peft_model, model, heldout, eval_bsz)
        model.set_attention_mode("linear")
        peft_model.train()
        # data parallel: DDP averages the adapters' gradients over ranks; --fsdp: the loop does, once per step
        lora.ddp = peft_model if sharded else dist.wrap(peft_model, device)
        if cfg["activation_checkpointing"] is True:
            _set_activation_checkpointing(model, True)
        loop.run(batches, progress=progress)
        lora.ddp = peft_model  # the DDP wrapper (and its gradient hooks) goes before the adapters are merged
        checkpointed = _checkpointing_activations(model)  # (before _finish turns it off)
        after = evaluate(peft_model, model, heldout, eval_bsz)
        base, adapter_path = _remove_adapters(peft_model, adapter_only_dir, sharded)
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
    return model, {
        "loss": loss_kind, "tokens": loop.tokens_seen, "steps": loop.step, "seq_len": seq_len, "batch_size": bsz,
        "world_size": dist.world_size(),  # torchrun processes sharing each step's global batch
        "grad_accum": accum,
        "passes_per_micro_batch": max(1, loop.pieces),  # > 1: split to fit memory (linearize.train.memory)
        "activation_checkpointing": checkpointed,  # the recipe's true, or auto when one row did not fit
        "copy_fraction": cfg["copy_fraction"],  # share of training rows with a long-range copy (0 = off)
        "lengths": list(cfg["lengths"]),  # row lengths drawn per step ([]: seq_len)
        "train_window": training_width(recipe["attention"], cfg),  # every windowed layer trained at it (None: its own)
        "lora": {"r": cfg["lora_r"], "alpha": cfg["lora_alpha"], "dropout": cfg["lora_dropout"],
                 "targets": list(cfg["targets"]), "layers": layers, "target_modules": target_regex,
                 "trainable_params": n_trainable},
        "merged": adapter_only_dir is None, "adapter_dir": str(adapter_path) if adapter_path is not None else None,
        "seconds": round(time.time() - t_start, 1), "train_seconds": round(loop.train_seconds, 1),
        "tokens_per_second": round(loop.tokens_this_run / max(loop.train_seconds, 1e-9), 1),
        "heldout_ppl_teacher": lora.before["teacher_ppl"],
        "heldout_ppl_start": lora.before["ppl"], "heldout_ppl_end": after["ppl"],
        "heldout_kl_start": lora.before["kl"], "heldout_kl_end": after["kl"],
        "history": loop.history,
    }

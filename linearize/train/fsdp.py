"""Sharded training under ``torchrun ... --fsdp`` with PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``).

Data parallel (:mod:`linearize.distributed`) keeps the whole model on every rank; ``--fsdp`` shards the
frozen weights instead, so a model that does not fit one device can be converted. The design:

- **Loading** (:func:`load_and_shard`). Only rank 0 loads the model, into *CPU* memory, and does the
  surgery; it sends the resulting config and the tokenizer to the other ranks, which build the same
  model on the ``meta`` device (no memory). Every rank then shards it (:func:`shard`): the meta ranks
  allocate just their own shards on ``cuda:LOCAL_RANK`` (or the CPU with gloo), and rank 0's full
  weights reach every rank's shards through ``set_model_state_dict(..., broadcast_from_rank0=True)``;
  buffers (e.g. rotary frequencies, not in a state dict) are broadcast too. The host needs the model's
  size in RAM once, not once per rank.
- **What is sharded.** ``fully_shard`` on every decoder layer, then on the root (embeddings, final norm,
  LM head). The *trainable* parameters of both stages are kept out of FSDP and replicated on every rank:
  the stage-1 feature maps and window logits through ``fully_shard(..., ignored_params=...)``, and the
  stage-2 LoRA adapters because peft injects them after sharding (FSDP only manages the parameters it saw).
  They are tiny (LoRA r=8 on q/k/v/o of Llama-70B: ~33M parameters), so replicating them costs little.
- **Gradients.** Stage 1's losses are a side channel taken in the layers and back-propagated there during the
  forward (:func:`linearize.train.distill.backward_per_layer`): the decoder layers' outputs do not require grad, so
  FSDP's backward hooks never fire, and no frozen weight is needed by that backward (the feature maps act on
  activations). Stage 2's backward flows through the decoder layers, and FSDP re-gathers their frozen
  weights for it as usual. In both stages the replicated trainable gradients are averaged over ranks with
  one ``all_reduce`` per optimizer step (:func:`linearize.distributed.average_gradients`), which is what DDP
  would compute.
- **Merge and save.** LoRA deltas are added into each rank's own shard of the base weights
  (:func:`merge_lora`, the arithmetic of peft's ``merge``), the adapters are unloaded, and
  :func:`full_state_dict` gathers the full weights to rank 0's CPU (``get_model_state_dict`` with
  ``full_state_dict=True, cpu_offload=True``), where the usual checkpoint writer saves them.
"""

from __future__ import annotations

import torch

from .. import distributed as dist
from ..errors import LinearizeError
from ..io.sources import load_model, resolve_dtype

__all__ = ["check_options", "load_device", "load_and_shard", "build_and_shard", "shard", "is_sharded",
           "merge_lora", "full_state_dict"]


def check_options(*, select_auto: bool = False, train: bool = True, adapter_only: bool = False) -> None:
    """One line for what ``--fsdp`` cannot do (yet); call before anything is loaded."""
    if not dist.enabled():
        raise LinearizeError("--fsdp shards the model over torchrun processes: start it with "
                             "`torchrun --nproc_per_node N -m linearize.cli ...` (N >= 2)")
    if not train:
        raise LinearizeError("--fsdp with --no-train: nothing to train, so nothing to shard; drop --fsdp")
    if select_auto:
        raise LinearizeError("--fsdp does not support --select auto yet (its probe runs on the whole model); "
                             "use --select interleave or --softmax-layers")
    if adapter_only:
        raise LinearizeError("--fsdp does not support --adapter-only yet; drop one of them")


def load_device(device: str | None, dtype):
    """Where and in which dtype an FSDP rank loads the full model: the CPU, in the dtype its training
    device would default to (bf16 for CUDA ranks, fp32 on the CPU)."""
    return "cpu", resolve_dtype(dtype, device or "cpu")


def load_and_shard(spec: str, device: str | None, dtype, prepare=None, log=None):
    """Load ``spec`` on rank 0 only (CPU), apply ``prepare`` there (e.g. surgery: it must return a
    :class:`LinearizeForCausalLM`), build the same model on the meta device on the other ranks, and shard
    it over all ranks with rank 0's weights. Returns ``(model, tokenizer)`` on every rank. A load error on
    rank 0 is raised on every rank (one line), so no rank waits forever."""
    load_at, load_dtype = load_device(device, dtype)
    return build_and_shard(lambda: load_model(spec, dtype=load_dtype, device=load_at), device, prepare=prepare,
                           log=log)


def build_and_shard(build, device: str | None, prepare=None, log=None):
    """:func:`load_and_shard` for any source: ``build()`` runs on rank 0 only and returns ``(model, extra)`` (the
    model on the CPU, in the dtype of :func:`load_device`; ``extra`` picklable, e.g. the tokenizer), ``prepare``
    turns the model into a :class:`LinearizeForCausalLM` there. Returns ``(sharded model, extra)`` on every rank;
    an error in ``build`` or ``prepare`` ends every rank with its line."""
    # start-up time: the model code imports transformers; a bad spec is one line before it loads
    from ..model.modeling import LinearizeForCausalLM

    model = payload = None
    if dist.is_main():
        try:
            model, extra = build()
            if prepare is not None:
                model = prepare(model)
            payload = ("ok", model.config, extra)
        except Exception as e:  # the other ranks wait in the broadcast below: tell them, then fail here
            dist.broadcast_object(("error", str(e).splitlines()[0] if str(e) else type(e).__name__))
            raise
    payload = dist.broadcast_object(payload)
    if payload[0] == "error":
        raise LinearizeError(payload[1])
    _, config, extra = payload
    if model is None:
        with torch.device("meta"):
            model = LinearizeForCausalLM(config)
        model.eval()
    return shard(model, device, log=log), extra


def _stage1_params(model) -> list[torch.nn.Parameter]:
    params = []
    for m in model.linear_modules():  # a linear layer's feature maps (learnable or not) + what stage 1 trains
        maps = (m.feature_map_q, m.feature_map_k) if hasattr(m, "feature_map_q") else ()  # gated delta: none
        params += [p for fm in maps for p in fm.parameters()]
        params += [p for p in m.learned_parameters() if not any(p is q for q in params)]
    return params


def shard(model, device: str | None, log=None):
    """Shard ``model`` (a :class:`LinearizeForCausalLM`: on the CPU on rank 0, on the CPU or the meta
    device elsewhere) over the torchrun ranks in place, with rank 0's weights and buffers everywhere.

    The stage-1 parameters (feature maps, window logits) stay replicated; every other parameter is sharded
    (dim 0) by ``fully_shard`` per decoder layer and at the root, on ``device``."""
    # torch.distributed's FSDP modules take half a second to import: only under --fsdp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # torch.distributed's FSDP modules take half a second to import: only under --fsdp
    from torch.distributed.device_mesh import init_device_mesh

    # torch.distributed's FSDP modules take half a second to import: only under --fsdp
    from torch.distributed.fsdp import fully_shard

    dev = torch.device(device or "cpu")
    keep = _stage1_params(model)
    on_meta = any(p.is_meta for p in model.parameters())
    # rank 0's full weights (before sharding replaces them), sent to every rank's shards below
    full = model.state_dict() if dist.is_main() else {}
    if dist.is_main() and on_meta:
        raise LinearizeError("fsdp.shard: rank 0 must hold the loaded weights, not a meta model")
    with torch.no_grad():
        for p in keep:  # (meta ones are allocated by to_empty below)
            if not p.is_meta:
                p.data = p.data.to(dev)
    mesh = init_device_mesh(dev.type, (dist.world_size(),))
    ignored = set(keep)
    for p in model.parameters():  # what FSDP shards is frozen for good: only the replicated parameters train.
        # (The root's parameters stay unsharded after a forward without backward, so requires_grad_ on what
        # model.parameters() returns later would not reach FSDP's sharded copies.)
        if p not in ignored:
            p.requires_grad_(False)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    if on_meta:
        model.to_empty(device=dev)  # this rank's shards only; values arrive from rank 0 next
        keep = _stage1_params(model)  # to_empty put new Parameter objects in place of the meta ones
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    with torch.no_grad():  # replicated parameters and every buffer (non-persistent ones are in no state dict)
        for t in [p.data for p in keep] + list(model.buffers()):
            if t.device != dev:
                t.data = t.data.to(dev)
            torch.distributed.broadcast(t, src=0)
    model._linearize_fsdp = True
    if log is not None:
        # torch.distributed's FSDP modules take half a second to import: only under --fsdp
        from torch.distributed.tensor import DTensor

        total = sum(p.numel() for p in model.parameters())
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
        log(f"fsdp: {len(model.model.layers)} decoder layers + root sharded over {dist.world_size()} processes on "
            f"{dev.type}; rank 0 holds {local:,} of {total:,} parameters ({sum(p.numel() for p in keep):,} "
            f"trainable stage-1 parameters replicated)")
    return model


def is_sharded(model) -> bool:
    """True for a model prepared by :func:`shard` (peft wrappers included)."""
    inner = getattr(model, "get_base_model", None)
    model = inner() if callable(inner) else model
    return bool(getattr(model, "_linearize_fsdp", False))


@torch.no_grad()
def merge_lora(peft_model, adapter: str = "default") -> int:
    """Add every LoRA delta into this rank's shard of its (FSDP-sharded) base weight; returns the count.

    Same arithmetic as peft's ``merge`` (``W += get_delta_weight().to(W.dtype)``): the adapters are
    replicated, so each rank computes the full delta and keeps the rows of its own shard."""
    # peft: only when a LoRA model is merged under --fsdp
    from peft.tuners.lora import LoraLayer

    # torch.distributed's FSDP modules take half a second to import: only under --fsdp
    from torch.distributed.tensor import DTensor, distribute_tensor

    n = 0
    for module in peft_model.modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        if adapter in getattr(module, "lora_variant", {}) or module.lora_bias.get(adapter):
            raise LinearizeError("--fsdp: merging DoRA / LoRA-bias adapters is not supported")
        weight = module.get_base_layer().weight
        delta = module.get_delta_weight(adapter).to(weight.dtype)
        if isinstance(weight, DTensor):
            part = distribute_tensor(delta.to(weight.to_local().device), weight.device_mesh, weight.placements,
                                     src_data_rank=None)  # every rank holds the full delta: slice locally
            weight.to_local().add_(part.to_local())
        else:
            weight.add_(delta)
        n += 1
    return n


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on rank 0's CPU, ``{}`` on the other ranks; every rank must call it."""
    # torch.distributed's FSDP modules take half a second to import: only under --fsdp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if dist.is_main() else {}

"""Data-parallel training under ``torchrun``: process-group setup and the few helpers the stages use.

``torchrun --nproc_per_node N -m linearize.cli convert ...`` starts N processes with ``WORLD_SIZE``,
``RANK`` and ``LOCAL_RANK`` set. :func:`init` (called by the pipeline just before the model is loaded)
joins them into one process group -- NCCL with each rank on ``cuda:LOCAL_RANK``, gloo on the CPU --
and the training stages then shard every micro-batch's rows across ranks (:func:`shard`), average
gradients (the LoRA stage with :class:`torch.nn.parallel.DistributedDataParallel`; attention transfer, whose
layers back-propagate during the forward, with one ``all_reduce`` per optimizer step) and log global means
(:func:`all_reduce_mean`). The global batch and the number of steps are those of the single-process
run, so N ranks reach the same losses at about N times the throughput. Rank 0 alone writes files
and prints (:func:`is_main`). Without torchrun every helper is a no-op and nothing changes.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import os

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from .errors import TrainingError

__all__ = ["enabled", "init", "world_size", "rank", "is_main", "barrier", "shard", "average_gradients",
           "all_reduce_max", "all_reduce_mean",
           "broadcast_object", "broadcast_tensors", "check_batch", "wrap", "destroy"]


def enabled() -> bool:
    """True when started by torchrun with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ and "LOCAL_RANK" in os.environ


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1")) if enabled() else 1


def rank() -> int:
    return int(os.environ.get("RANK", "0")) if enabled() else 0


def is_main() -> bool:
    """Rank 0, or the only process: the one that prints and writes."""
    return rank() == 0


def _ready() -> bool:
    return enabled() and torch.distributed.is_available() and torch.distributed.is_initialized()


def init(device: str | None = None) -> str | None:
    """Join the torchrun process group (once) and return this rank's device; without torchrun, ``device``.

    On CUDA (the default when a GPU is visible, or ``--device cuda``) each rank takes ``cuda:LOCAL_RANK``
    and the NCCL backend; on the CPU the gloo backend.
    """
    if not enabled():
        return device
    dist = torch.distributed
    local = int(os.environ["LOCAL_RANK"])
    cuda = (device is None and torch.cuda.is_available()) or (device is not None and device.startswith("cuda"))
    if cuda:
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    else:
        device = device or "cpu"
    if not dist.is_initialized():
        if cuda:
            dist.init_process_group("nccl", device_id=torch.device(device))
        else:
            dist.init_process_group("gloo")
        atexit.register(destroy)
    return device


def destroy() -> None:
    """Leave the process group (registered at exit by :func:`init`).

    Garbage (the trained model is usually only held by reference cycles by now) is collected first: FSDP keeps
    gloo work handles and their tensors; freed during interpreter finalization instead, after the group is gone,
    they aborted a rank ("terminate called without an active exception") in about one run in eight (CPU, gloo)."""
    if _ready():
        gc.collect()
        torch.distributed.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (no-op without torchrun)."""
    if _ready():
        torch.distributed.barrier()


def shard(batch: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous share of a global micro-batch's rows (``[B, T] -> [B / N, T]``)."""
    n = world_size()
    if n == 1:
        return batch
    rows = batch.shape[0] // n  # divisibility is checked by the stages before training
    return batch[rank() * rows: (rank() + 1) * rows]


def broadcast_tensors(tensors: list[torch.Tensor]) -> None:
    """Overwrite ``tensors`` in place with rank 0's values (no-op without torchrun)."""
    if not _ready():
        return
    with torch.no_grad():
        for t in tensors:
            torch.distributed.broadcast(t.data, src=0)


def average_gradients(params: list[torch.Tensor]) -> None:
    """Average the gradients of ``params`` over ranks in one flat ``all_reduce`` per dtype (what DDP computes; used
    where DDP is not: attention transfer, and the replicated parameters under ``--fsdp``)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or not _ready():
        return

    for dtype in {g.dtype for g in grads}:
        group = [g for g in grads if g.dtype == dtype]
        flat = _flatten_dense_tensors(group)
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
        flat /= world_size()
        for g, synced in zip(group, _unflatten_dense_tensors(flat, group)):
            g.copy_(synced)


def all_reduce_max(value: int, device: torch.device | str = "cpu") -> int:
    """The largest ``value`` over ranks; ``value`` itself without torchrun."""
    if not _ready():
        return value
    t = torch.tensor([value], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """The mean of ``t`` over ranks (a new, detached tensor); ``t`` itself without torchrun."""
    if not _ready():
        return t
    out = t.detach().clone()
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM)
    return out / world_size()


def check_batch(stage: str, batch_size: int) -> None:
    """One line when the global micro-batch cannot be split evenly over the ranks."""
    n = world_size()
    if batch_size % n:
        raise TrainingError(f"{stage}.batch_size {batch_size} cannot be split over {n} torchrun processes; use a "
                            f"multiple of {n} (--set {stage}.batch_size=...): every step's global batch is sharded "
                            f"by rows")


def wrap(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module`` in :class:`~torch.nn.parallel.DistributedDataParallel` (gradients averaged over ranks
    after each backward outside ``no_sync``); ``module`` itself without torchrun. Only parameters that
    require grad are reduced; DDP's initial broadcast makes every rank start from rank 0's weights."""
    if not _ready():
        return module

    # the buffers (rotary tables) are the same everywhere: no per-forward broadcast
    params = inspect.signature(DistributedDataParallel).parameters
    quiet = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None, **quiet)


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank (a picklable value, e.g. a layer layout); ``obj`` without torchrun."""
    if not _ready():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]

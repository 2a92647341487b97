"""Fit a training micro-batch to the memory there is, by measurement.

A recipe's ``batch_size`` rows of ``seq_len`` tokens suit an H200; on a laptop CPU the same micro-batch can
need several times the RAM. On Linux the kernel's out-of-memory killer then ends the process with no
exception to catch, so the split has to be decided *before* the first full step. :func:`plan_pieces` runs
the stage's own forward + backward on 1 and then 2 rows of the first micro-batch, reads each run's peak
(CUDA: the caching allocator's ``max_memory_allocated``; CPU: the process's peak resident set, ``VmHWM``,
reset through ``/proc/self/clear_refs``), extrapolates linearly to the whole micro-batch and compares that
with what is free (CUDA: ``mem_get_info`` plus the allocator's cached blocks; CPU: ``MemAvailable``, within
a cgroup's limit). A micro-batch that does not fit runs as ``pieces`` equal forward/backward passes whose
gradients add up: the effective batch, the data order and the number of optimizer steps stay the same.

Without a way to measure (not Linux, no ``/proc``) nothing is split and the stages behave as before.
"""

from __future__ import annotations

import gc
import math
import re
from pathlib import Path
from typing import Callable

import torch

from .. import distributed as dist
from ..errors import ResourceError

#: the share of the free memory a planned step may use (the rest absorbs fragmentation and measurement noise)
HEADROOM = 0.8

__all__ = ["free_bytes", "peak_bytes", "plan_pieces", "HEADROOM"]


# ----------------------------------------------------------------------------------------- host memory


def _proc_bytes(path: str, field: str) -> int | None:
    """A ``FIELD:  N kB`` line of a ``/proc`` file (``/proc/meminfo``, ``/proc/self/status``) in bytes, or None."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+)\s*kB", text, re.M)
    return int(m.group(1)) * 1024 if m else None


def _cgroup_headroom() -> int | None:
    """Bytes left under this process's cgroup memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``),
    or None when there is no limit or it cannot be read."""
    pairs = [("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
             ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")]
    for limit_path, usage_path in pairs:
        try:
            limit, usage = Path(limit_path).read_text().strip(), Path(usage_path).read_text().strip()
        except OSError:
            continue
        if not limit.isdigit() or not usage.isdigit() or int(limit) >= 1 << 60:  # "max" or a huge number: none
            return None
        return max(0, int(limit) - int(usage))
    return None


def _reset_host_peak() -> bool:
    """Reset ``VmHWM`` to the current resident set (Linux >= 4.0); False when that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


# ----------------------------------------------------------------------------------------- both devices


def free_bytes(device: torch.device) -> int | None:
    """Bytes this process could still allocate on ``device``: CUDA's free memory plus the blocks our caching
    allocator holds unused (within ``torch.cuda.set_per_process_memory_fraction``); on the CPU ``MemAvailable``
    (capped by a cgroup limit). None when unknown."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        out = free + torch.cuda.memory_reserved(device) - allocated
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
        return int(min(out, fraction * total - allocated))  # set_per_process_memory_fraction caps this process
    if device.type != "cpu":
        return None
    avail = _proc_bytes("/proc/meminfo", "MemAvailable")
    cap = _cgroup_headroom()
    if avail is None:
        return cap
    return avail if cap is None else min(avail, cap)


def _in_use(device: torch.device) -> int | None:
    """Bytes in use now, on the scale :func:`peak_bytes` reports (allocated on CUDA, resident on the CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return _proc_bytes("/proc/self/status", "VmRSS") if device.type == "cpu" else None


def peak_bytes(device: torch.device, fn: Callable[[], object]) -> int | None:
    """Run ``fn`` and return the peak bytes in use while it ran (absolute, as :func:`_in_use` counts them), or
    None (``fn`` still runs) when the peak cannot be measured on this device."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    if device.type != "cpu" or not _reset_host_peak():
        fn()
        return None
    fn()
    return _proc_bytes("/proc/self/status", "VmHWM")


# ----------------------------------------------------------------------------------------- the plan


def _smallest_divisor_at_least(n: int, k: int) -> int:
    """The smallest divisor of ``n`` that is >= ``k`` (``n`` itself at worst)."""
    for d in range(max(1, k), n + 1):
        if n % d == 0:
            return d
    return n


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _measured_peak(device: torch.device, fn: Callable[[], object]) -> float | None:
    """:func:`peak_bytes` of ``fn`` with the RNG forked (dropout's draws stay as training will see them); ``inf``
    when it ran out of GPU memory (the host's out-of-memory killer cannot be caught: that is why the CPU plan is
    made before the first full pass)."""
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            return peak_bytes(device, fn)
    except torch.OutOfMemoryError:
        gc.collect()
        torch.cuda.empty_cache()
        return math.inf


def plan_pieces(stage: str, rows: int, seq_len: int, device: torch.device, run_rows: Callable[[int], object],
                *, log: Callable[[str], None] = print, headroom: float = HEADROOM,
                lean: tuple[str, Callable[[], None]] | None = None) -> int:
    """How many equal pieces this rank's ``rows``-row micro-batch must run as so that one forward + backward fits.

    ``run_rows(n)`` runs the stage's forward and backward on the first ``n`` rows of a micro-batch (the caller
    discards the gradients afterwards). ``lean = (what, switch_on)``: when one row does not fit, ``switch_on()``
    makes the stage leaner (finetune: activation checkpointing), one line names ``what``, and the measurement
    starts again. Under torchrun every rank measures and all take the largest count, so they run the same number
    of passes. Raises :class:`~linearize.errors.ResourceError` when one row does not fit (after ``lean``).
    Returns 1 when memory cannot be measured here."""
    pieces = 1
    base = _in_use(device)
    p1 = _measured_peak(device, lambda: run_rows(1))
    free = free_bytes(device)
    known = p1 is not None and free is not None and base is not None
    if known:
        now = _in_use(device)  # (on the CPU it includes memory the measured pass freed but kept)
        capacity = now + headroom * free  # absolute bytes a pass may reach
        room = now + free - base  # what a pass could use beyond what was in use before measuring
    if p1 == math.inf or (known and p1 > capacity):
        need = ("more than the free GPU memory" if p1 == math.inf
                else f"~{_gb(p1 - base)} at its peak and only ~{_gb(room)} are available")
        if lean is not None:
            what, switch_on = lean
            if dist.is_main():
                log(f"{stage}: one row of {seq_len:,} tokens needs {need}: turning on {what}")
            switch_on()
            return plan_pieces(stage, rows, seq_len, device, run_rows, log=log, headroom=headroom)
        if p1 == math.inf:
            raise ResourceError(f"{stage}: one row of {seq_len:,} tokens does not fit in GPU memory (~{_gb(free or 0)} "
                                f"free after it failed); lower --set {stage}.seq_len or use a GPU with more memory")
        raise ResourceError(f"{stage}: one row of {seq_len:,} tokens needs {need}; lower --set {stage}.seq_len "
                            f"or use a machine with more memory")
    if known and rows >= 2:
        p2 = _measured_peak(device, lambda: run_rows(2))
        if p2 == math.inf:  # two rows ran out of memory: one row per pass
            pieces, what = rows, "more than two rows' worth"
        else:
            per_row = max(0, p2 - p1)
            need = p1 + (rows - 1) * per_row
            fit = 1 + int((capacity - p1) // per_row) if per_row else rows
            pieces = _smallest_divisor_at_least(rows, math.ceil(rows / max(1, fit))) if need > capacity else 1
            what = f"~{_gb(need - base)}"
        if pieces > 1 and dist.is_main():
            log(f"{stage}: a micro-batch of {rows} rows x {seq_len:,} tokens needs {what} at its peak and "
                f"~{_gb(room)} are available: running it as {pieces} passes of {rows // pieces} "
                f"row{'s' if rows // pieces > 1 else ''} (same effective batch; set {stage}.batch_size / "
                f"grad_accum to choose yourself)")
    return dist.all_reduce_max(pieces, device if device.type == "cuda" else "cpu")


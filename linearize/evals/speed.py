"""Prefill and decode throughput and peak memory, through ``generate()``.

For every context length ``L`` and batch size ``B`` (random token ids, seeded):

* prefill: ``generate(max_new_tokens=1)`` on ``[B, L]``; ``prefill_tok_s = B * L / t``;
* decode: ``generate`` of ``1 + D`` tokens (``min_new_tokens`` forces all of them);
  ``decode_tok_s = B * D / (t_total - t_prefill)`` with ``D = 32`` (``speed:64`` changes it);
* peak memory during the decode run:
  - CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``;
    ``peak_mib`` is the absolute peak (weights included), ``extra_mib`` the rise over the
    memory allocated before the run (activations + cache);
  - CPU: the process' peak resident set size. On Linux the kernel's high-water mark
    (``VmHWM``) is reset before each run by writing ``5`` to ``/proc/self/clear_refs``, so
    ``peak_mib`` is the peak RSS of that run and ``extra_mib`` its rise over the RSS before it.
    Where the reset is not possible, ``ru_maxrss`` (the process' lifetime peak) is reported and
    the row says ``"memory": "lifetime-peak-rss"``. No allocation tracing is used, so the
    numbers include allocator slack and are comparable between models, not exact.

Timing uses wall-clock with ``torch.cuda.synchronize`` on GPU; one warm-up run first;
the median of 3 repeats on GPU, 1 on CPU. A batch that runs out of memory is recorded as
``"oom": true`` and larger batches at that length are skipped.
Headline score: decode tokens/s at the largest length and the first batch size.
"""

from __future__ import annotations

import os
import resource
import statistics
import time

import torch

from .common import EvalConfig, EvalError, ModelHandle, Progress, parse_count

NAME = "speed"
DEFAULT_DECODE_TOKENS = 32


def parse_args(arg: str | None) -> dict:
    if not arg:
        return {"decode_tokens": DEFAULT_DECODE_TOKENS}
    try:
        return {"decode_tokens": parse_count(arg, what="decode token count")}
    except EvalError:
        raise EvalError(f"bad task 'speed:{arg}': expected a decode-token count like speed:32") from None


def count(cfg: EvalConfig, args: dict) -> int:
    return len(cfg.lengths) * len(cfg.batch_sizes)


# ---- memory probes -------------------------------------------------------------------

def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _MemProbe:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.kind = "cuda-max-allocated" if self.cuda else "peak-rss"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = (_status_kib("VmRSS") or 0) * 1024
            if not _reset_rss_peak() or _status_kib("VmHWM") is None:
                self.kind = "lifetime-peak-rss"

    def stop(self) -> tuple[float, float]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self.kind == "peak-rss":
            peak = (_status_kib("VmHWM") or 0) * 1024
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak / 2**20, max(0, peak - self.base) / 2**20


# ---- timing ------------------------------------------------------------------------

def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def _timed_generate(handle: ModelHandle, x: torch.Tensor, new: int) -> float:
    from transformers import GenerationConfig  # noqa: PLC0415

    cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1,
                           pad_token_id=handle.pad_id, eos_token_id=handle.eos_ids or None)
    dev = x.device
    _sync(dev)
    t = time.perf_counter()
    handle.model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=cfg)
    _sync(dev)
    return time.perf_counter() - t


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def run(handle: ModelHandle, cfg: EvalConfig, args: dict, progress: Progress, shared: dict) -> list[dict]:
    dev = handle.device
    d = args["decode_tokens"]
    repeats = 3 if dev.type == "cuda" else 1
    vocab = int(getattr(handle.model.config, "vocab_size", None) or len(handle.tokenizer))
    g = torch.Generator().manual_seed(0)
    handle.model.eval()
    _timed_generate(handle, torch.randint(0, vocab, (1, 16), generator=g).to(dev), 2)  # warm-up
    rows = []
    for L in cfg.lengths:
        oom = False
        for B in cfg.batch_sizes:
            row = {"task": NAME, "length": L, "batch": B, "decode_tokens": d, "device": str(dev),
                   "dtype": str(next(handle.model.parameters()).dtype).replace("torch.", "")}
            if oom:
                rows.append({**row, "oom": True, "skipped": "a smaller batch ran out of memory"})
                progress.advance()
                continue
            x = torch.randint(0, vocab, (B, L), generator=g).to(dev)
            try:
                pre, full = [], []
                probe = _MemProbe(dev)
                for r in range(repeats):
                    pre.append(_timed_generate(handle, x, 1))
                    if r == repeats - 1:
                        probe.start()
                    full.append(_timed_generate(handle, x, 1 + d))
                peak, extra = probe.stop()
                t_pre = statistics.median(pre)
                t_dec = max(statistics.median(full) - t_pre, 1e-9)
                row.update({"prefill_s": round(t_pre, 5), "decode_s": round(t_dec, 5),
                            "prefill_tok_s": round(B * L / t_pre, 2), "decode_tok_s": round(B * d / t_dec, 2),
                            "ms_per_step": round(1000 * t_dec / d, 3),
                            "peak_mib": round(peak, 1), "extra_mib": round(extra, 1), "memory": probe.kind})
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                if not _is_oom(e):
                    raise
                oom = True
                row.update({"oom": True})
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            finally:
                del x
            rows.append(row)
            progress.advance()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def summarize(rows: list[dict], cfg: EvalConfig) -> dict:
    ok = [r for r in rows if not r.get("oom")]
    b0 = cfg.batch_sizes[0]
    first = [r for r in ok if r["batch"] == b0]
    top = max(first, key=lambda r: r["length"]) if first else None
    return {
        "metric": "decode_tok_s", "higher_is_better": True,
        "score": top["decode_tok_s"] if top else None,
        "batch": b0,
        "decode_tokens": rows[0]["decode_tokens"] if rows else None,
        "by_length": {str(r["length"]): r["decode_tok_s"] for r in first},
        "prefill_by_length": {str(r["length"]): r["prefill_tok_s"] for r in first},
        "peak_mib_by_length": {str(r["length"]): r["peak_mib"] for r in first},
        "grid": [{k: r.get(k) for k in ("length", "batch", "prefill_tok_s", "decode_tok_s", "peak_mib", "extra_mib", "oom")}
                 for r in rows],
        "memory": ok[0]["memory"] if ok else None,
    }

"""Prefill and decode throughput and peak memory, through ``generate()``.

For every context length ``L`` and batch size ``B`` (random token ids, seeded), one greedy
``generate`` of ``1 + D`` tokens (``min_new_tokens`` forces all of them; ``D = 32``,
``speed:64`` changes it) with a logits processor that timestamps every step:

* prefill: from the call to the first step's logits; ``prefill_tok_s = B * L / t_prefill``;
* decode: the mean time of the following ``D`` steps; ``decode_tok_s = B / t_step``
  (``ms_per_step`` is reported too);
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

Timing is wall-clock with ``torch.cuda.synchronize`` at every timestamp on GPU; one warm-up
run first; the median of 3 repeats on GPU, 1 on CPU. A batch that runs out of memory is recorded as
``"oom": true`` and larger batches at that length are skipped.
Headline score: decode tokens/s at the largest length and the first batch size.
"""

from __future__ import annotations

import resource
import statistics
import time

import torch

from linearize.units import UnitError, parse_length

from .common import EvalConfig, EvalError, ModelHandle, Progress

NAME = "speed"
DEFAULT_DECODE_TOKENS = 32


def parse_args(arg: str | None) -> dict:
    if not arg:
        return {"decode_tokens": DEFAULT_DECODE_TOKENS}
    try:
        return {"decode_tokens": parse_length(arg, what="decode token count")}
    except UnitError:
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


class _StepClock:
    """A logits processor that only records when each generation step's logits are ready:
    the first call comes right after the prefill forward, each later one after a decode step."""

    def __init__(self, dev: torch.device):
        self.dev = dev
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        _sync(self.dev)
        self.times.append(time.perf_counter())
        return scores


@torch.no_grad()
def timed_generate(handle: ModelHandle, x: torch.Tensor, new: int) -> tuple[float, float]:
    """One greedy ``generate`` of exactly ``new`` tokens; returns (prefill seconds, seconds per
    decode step), both read from the step clock inside that one call."""
    # start-up time: transformers, only when a task generates
    from transformers import GenerationConfig, LogitsProcessorList  # noqa: PLC0415

    cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1,
                           pad_token_id=handle.pad_id, eos_token_id=handle.eos_ids or None)
    clock = _StepClock(x.device)
    _sync(x.device)
    t0 = time.perf_counter()
    handle.model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=cfg,
                          logits_processor=LogitsProcessorList([clock]))
    t = clock.times
    prefill = t[0] - t0
    step = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else float("nan")
    return prefill, step


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def run(handle: ModelHandle, cfg: EvalConfig, args: dict, progress: Progress, shared: dict) -> list[dict]:
    dev = handle.device
    d = args["decode_tokens"]
    repeats = 3 if dev.type == "cuda" else 1
    vocab = int(getattr(handle.model.config, "vocab_size", None) or len(handle.tokenizer))
    g = torch.Generator().manual_seed(0)
    handle.model.eval()
    timed_generate(handle, torch.randint(0, vocab, (1, 16), generator=g).to(dev), 3)  # warm-up
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
                pre, step = [], []
                probe = _MemProbe(dev)
                for r in range(repeats):
                    if r == repeats - 1:
                        probe.start()
                    p, s = timed_generate(handle, x, 1 + d)
                    pre.append(p)
                    step.append(s)
                peak, extra = probe.stop()
                t_pre, t_step = statistics.median(pre), statistics.median(step)
                row.update({"prefill_s": round(t_pre, 5), "prefill_tok_s": round(B * L / t_pre, 2),
                            "ms_per_step": round(1000 * t_step, 3), "decode_tok_s": round(B / t_step, 2),
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

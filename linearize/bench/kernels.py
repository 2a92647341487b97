"""Kernel benchmark: ``linearize bench kernels``.

Times our Triton kernels side by side with fla 0.6.0 (``chunk_linear_attn``, ``fused_recurrent_linear_attn``;
``chunk_simple_gla`` and ``chunk_gla`` for the gated rows; ``chunk_gated_delta_rule`` and
``fused_recurrent_gated_delta_rule`` for the gated delta rule's; optional: their rows are skipped when fla is
absent) and PyTorch SDPA (flash and cuDNN backends), median of ``triton.testing.do_bench``, all in one process on
one GPU.

The rows are data (:data:`ROW_SPECS`, one :class:`RowSpec` per kind of row) and run one at a time: each pass is
compiled on its first call, checked once against the PyTorch path (``--check quick``), timed, printed and saved
before the next one compiles, so the first row comes within seconds of the start. The default set (lengths
2K, 8K, 32K; ours linear and window, SDPA, fla, decode steps) stays within minutes on a fresh GPU; ``--gated``,
``--delta``, ``--hedgehog`` and ``--full`` add the rest. See ``kernels/README.md`` for the tables.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib
import importlib.metadata as md
import importlib.util
import itertools
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from rich.table import Table
from torch.nn.attention import SDPBackend, sdpa_kernel

from linearize.kernels import (empty_window_state, gated_delta_rule, gated_delta_rule_step, linear_attention,
                               linear_attention_hedgehog, linear_attention_step, window_linear_attention,
                               window_linear_attention_hedgehog, window_linear_attention_step,
                               window_state_from_prefill)
from linearize.kernels.testing import GRAD_FLOOR, TOL, TOL_G, check_linear, check_window, linear_inputs, rel_err, \
    window_inputs

from ..atomic import atomic_write
from ..errors import DeviceError, LinearizeError
from ..progress import make_console
from ..units import format_length, parse_length

# fla's Triton path only (it otherwise dispatches to other backends when present)
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")


def _bench(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    # optional: Triton, only where the GPU kernels run
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _versions() -> Dict[str, str]:
    # optional: Triton, only where the GPU kernels run
    import triton

    out = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    try:
        out["fla-core"] = md.version("fla-core")
    except Exception:
        out["fla-core"] = "absent"
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["cuda"] = str(torch.version.cuda)
    return out


# ---------------------------------------------------------------------------
# correctness on the device


def check_kernels(device: str = "cuda", report: Optional[Callable[[dict], None]] = None) -> List[dict]:
    """Our Triton paths vs the float64 reference on the device (outputs, states, gradients).

    Returns one row per check with the measured relative errors, each also given to ``report`` as it completes;
    raises nothing (a failed check is a row with ``ok=False``).
    """
    rows: List[dict] = []

    def add(row: dict) -> None:
        rows.append(row)
        if report is not None:
            report(row)

    def run(name, fn):
        try:
            fn()
            add({"check": name, "ok": True})
        except Exception as e:  # pragma: no cover - device only
            add({"check": name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"})

    for dt in (torch.float32, torch.bfloat16):
        for shape in [(2, 1000, 4, 2, 64, 32), (1, 777, 2, 2, 128, 128), (1, 300, 2, 1, 256, 64)]:
            for norm in (True, False):
                run(f"linear {shape} {dt} norm={norm}",
                    lambda: check_linear("triton", *shape, dt, normalize=norm, state=True, device=device))
        for shape in [(2, 1000, 4, 2, 64, 64, 32, 64), (1, 777, 2, 2, 128, 128, 128, 64),
                      (1, 500, 2, 1, 64, 256, 64, 16), (1, 500, 2, 1, 64, 64, 64, 100)]:
            run(f"window {shape} {dt}", lambda: check_window("triton", *shape, dt, state=True, device=device))

    try:
        for row in _check_accuracy(device):
            add(row)
    except Exception as e:  # pragma: no cover - device only
        add({"check": "accuracy/decode", "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    return rows


def _check_accuracy(device: str) -> List[dict]:
    rows: List[dict] = []
    # accuracy at the benchmark's head size on a long sequence, vs a float64 reference
    B, T, H, D = 1, 4096, 4, 128
    for dt in (torch.float32, torch.bfloat16):
        inp = linear_inputs(B, T, H, H, D, D, dtype=dt, device=device, seed=11)
        for norm in (True, False):
            o, _ = linear_attention(inp["q"], inp["k"], inp["v"], normalize=norm, backend="triton")
            ref, _ = linear_attention(*(inp[n].double() for n in ("q", "k", "v")), normalize=norm,
                                      backend="torch")
            rows.append({"check": f"accuracy linear T={T} D={D} {dt} norm={norm}", "rel_err": rel_err(o, ref),
                         "ok": rel_err(o, ref) <= (1e-4 if dt == torch.float32 else 1e-2)})
        w = window_inputs(B, T, H, H, D, D, D, dtype=dt, device=device, seed=12)
        xs = [w[n] for n in ("q", "k", "fq", "fk", "v")]
        o, _ = window_linear_attention(*xs, w["window_factor"], window=64, backend="triton")
        ref, _ = window_linear_attention(*(x.double() for x in xs), w["window_factor"].double(), window=64,
                                         backend="torch")
        rows.append({"check": f"accuracy window T={T} D={D} {dt}", "rel_err": rel_err(o, ref),
                     "ok": rel_err(o, ref) <= (1e-4 if dt == torch.float32 else 1e-2)})

    # decode: prefill + steps == one forward
    B, T, H, Hk, D = 2, 200, 8, 4, 128
    inp = linear_inputs(B, T, H, Hk, D, D, device=device, seed=3)
    full, _ = linear_attention(inp["q"], inp["k"], inp["v"], backend="reference")
    _, st = linear_attention(inp["q"][:, :150], inp["k"][:, :150], inp["v"][:, :150], output_final_state=True,
                             backend="triton")
    outs = [linear_attention_step(inp["q"][:, t], inp["k"][:, t], inp["v"][:, t], st) for t in range(150, T)]
    e = rel_err(torch.stack(outs, 1), full[:, 150:])
    rows.append({"check": "linear prefill+steps == full", "rel_err": e, "ok": e < 1e-5})
    w = window_inputs(B, T, H, Hk, D, D, D, device=device, seed=4)
    xs = [w[n] for n in ("q", "k", "fq", "fk", "v")]
    full, _ = window_linear_attention(*xs, w["window_factor"], window=64, backend="reference")
    _, st = window_linear_attention(*(x[:, :150] for x in xs), w["window_factor"], window=64,
                                    output_final_state=True, backend="triton")
    ws = window_state_from_prefill(xs[1][:, :150], xs[3][:, :150], xs[4][:, :150], st, 64)
    outs = [window_linear_attention_step(*(x[:, t] for x in xs), w["window_factor"], ws) for t in range(150, T)]
    e = rel_err(torch.stack(outs, 1), full[:, 150:])
    rows.append({"check": "window prefill+steps == full", "rel_err": e, "ok": e < 1e-5})
    return rows


# ---------------------------------------------------------------------------
# launch-configuration sweep (used to pick the defaults in kernels/triton_*.py CONFIG)


#: the most a launch configuration's result may differ from the defaults' (bf16, relative) and still be timed:
#: twice the bf16 accuracy target, as two correct configurations may each be 1e-2 off the float64 reference
TUNE_TOLERANCE = 2e-2


def _context_lost(e: Exception) -> bool:
    """A CUDA error after which the process's context is unusable (an illegal address, a launch failure)."""
    msg = str(e)
    return "illegal memory access" in msg or "unspecified launch failure" in msg or "illegal instruction" in msg


def sweep_configs(config: dict, grid: dict, run: Callable, cases: dict, reference: dict, baseline: dict,
                  timer: Callable[[Callable[[], object]], float], say: Callable[[str], None]) -> list:
    """Time ``run(*cases[key])`` under ``config`` updated by each combination of ``grid`` (and unchanged first);
    ``[(score, combination)]`` fastest first, score = sum over cases of ms / ``baseline[key]`` ms. A combination
    whose results (``run`` returns a tuple of tensors) differ from ``reference[key]`` by more than
    ``TUNE_TOLERANCE``, or that fails to compile, is reported and left out. ``config`` is restored."""
    base = dict(config)
    results = []
    candidates = [{}] + [dict(zip(grid.keys(), vals)) for vals in itertools.product(*grid.values())]
    for cfg in candidates:  # {} = the current configuration, kept unless something beats it
        config.update(cfg)
        try:
            tot, per = 0.0, []
            for key, args in cases.items():
                err = max(rel_err(a, b) for a, b in zip(run(*args), reference[key]))
                if not err <= TUNE_TOLERANCE:  # a launch setting must never change the result
                    raise RuntimeError(f"wrong result at {key[0]}x{key[1]}: relative error {err:.2e}")
                ms = timer(lambda: run(*args))
                tot += ms / baseline[key]
                per.append(f"{key[0]}x{key[1]} {ms:.3f} ms")
            results.append((tot, cfg))
            say(f"{cfg}: {tot:.3f} ({', '.join(per)})")
        except Exception as e:  # a wrong result, or a compile failure (e.g. out of shared memory)
            say(f"{cfg}: failed {str(e)[:100]}")
            if _context_lost(e):  # every later launch in this process would fail too
                raise DeviceError(f"launch configuration {cfg} crashed the GPU context ({str(e)[:80]}); "
                                  "tuning stops here (what earlier sweeps found is saved)") from e
        finally:
            config.clear()
            config.update(base)
    results.sort(key=lambda r: r[0])
    return results


#: kernel families ``tune_kernels`` sweeps, in order: linear / window, forward / fwd+bwd, Hedgehog features fused,
#: decode steps (Hedgehog features in the step, GQA 4:1 at batch 8 and 1)
TUNE_FAMILIES = ("lin_fwd", "lin_fb", "win_fwd", "win_fb", "lin_fused_fwd", "win_fused_fwd", "lin_step", "win_step")


def parse_families(names) -> list[str]:
    """Kernel family names (a comma-separated string or a sequence) checked against :data:`TUNE_FAMILIES`."""
    chosen = [f.strip() for f in (names.split(",") if isinstance(names, str) else names) if f.strip()]
    unknown = sorted(set(chosen) - set(TUNE_FAMILIES))
    if unknown or not chosen:
        raise LinearizeError(f"kernel families {names!r}: unknown {', '.join(unknown) or '(none given)'} "
                             f"(known: {', '.join(TUNE_FAMILIES)})")
    return chosen


def tune_kernels(heads: int = 32, dim: int = 128, progress: Optional[Callable[[str], None]] = None,
                 families: Optional[Sequence[str]] = None, *, device: str = "cuda",
                 timer: Optional[Callable[[Callable[[], object]], float]] = None) -> dict:
    """Time a small grid of launch configurations; set and return the best per kernel family (``families``, a
    subset of :data:`TUNE_FAMILIES`; default all). A configuration whose output or gradients differ from the
    defaults' by more than ``TUNE_TOLERANCE`` is never kept. ``device`` / ``timer`` (ms of a call; default
    ``do_bench``) let tests run the sweeps' plumbing on CPU."""
    # optional: Triton, only where the GPU kernels run
    from linearize.kernels import (empty_window_state, linear_attention, linear_attention_hedgehog,
                                   linear_attention_step_hedgehog, triton_common, tuning, window_linear_attention,
                                   window_linear_attention_hedgehog, window_linear_attention_step_hedgehog)

    # optional: Triton, only where the GPU kernels run
    from linearize.kernels import triton_linear as tlin

    # optional: Triton, only where the GPU kernels run
    from linearize.kernels import triton_step as tstep

    # optional: Triton, only where the GPU kernels run
    from linearize.kernels import triton_window as twin

    chosen = parse_families(families) if families else list(TUNE_FAMILIES)
    say = progress or (lambda s: None)
    if "win_fused_fwd" in chosen and twin.CONFIG["fwd_two_pass"]:  # the default: nothing of its own to time
        say("tune win_fused_fwd: skipped: the two-pass window forward (CONFIG fwd_two_pass) runs the fused linear "
            "forward shifted by W, whose settings lin_fused_fwd sweeps")
        chosen = [f for f in chosen if f != "win_fused_fwd"]
    dev = torch.device(device)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    bf = torch.bfloat16
    # forward / backward cases, made only when a family that uses them is swept
    shapes = [(1, 32768), (4, 8192), (16, 2048)] if any(not f.endswith("_step") for f in chosen) else []
    data = {}
    for B, T in shapes:
        q = torch.rand(B, T, heads, dim, device=dev, dtype=bf, requires_grad=True)
        k = torch.rand(B, T, heads, dim, device=dev, dtype=bf, requires_grad=True)
        v = torch.randn(B, T, heads, dim, device=dev, dtype=bf, requires_grad=True)
        qr = torch.randn(B, T, heads, dim, device=dev, dtype=bf)
        kr = torch.randn(B, T, heads, dim, device=dev, dtype=bf)
        do = torch.randn(B, T, heads, dim, device=dev, dtype=bf)
        data[(B, T)] = (q, k, v, qr, kr, do)
    wf = torch.full((heads,), 0.3, device=dev)
    best = {}
    timer = timer or (lambda fn: _bench(fn, 10, 40))

    def sweep(name, cfg_mod, grid, fn):
        if name not in chosen:
            return []
        results = sweep_configs(cfg_mod.CONFIG, grid, fn, cases[name], reference[name], baseline[name], timer,
                                lambda m: say(f"tune {name} {m}"))
        if results:
            cfg_mod.CONFIG.update(results[0][1])
            best[name] = results[0][1]
        tuning.save(gpu)  # after every sweep: a run cut short keeps what it found
        return results

    # each returns what it computes (output, or gradients), compared against the defaults' before timing
    def lin_fwd(q, k, v, qr, kr, do):
        with torch.no_grad():
            return linear_attention(q, k, v)[:1]

    def lin_fb(q, k, v, qr, kr, do):
        o = linear_attention(q, k, v)[0]
        return torch.autograd.grad(o, (q, k, v), do)

    def win_fwd(q, k, v, qr, kr, do):
        with torch.no_grad():
            return window_linear_attention(qr, kr, q, k, v, wf, window=64)[:1]

    def win_fb(q, k, v, qr, kr, do):
        o = window_linear_attention(qr, kr, q, k, v, wf, window=64)[0]
        return torch.autograd.grad(o, (q, k, v), do)

    # Hedgehog features computed inside the forward (inference; 2f = dim features from raw q, k)
    wq, wk = (0.1 * torch.randn(heads, dim, dim // 2, device=dev, dtype=bf) for _ in range(2))

    def lin_fused_fwd(q, k, v, qr, kr, do):
        with torch.no_grad():
            return linear_attention_hedgehog(qr, kr, v, wq, wk)[:1]

    def win_fused_fwd(q, k, v, qr, kr, do):
        with torch.no_grad():
            return window_linear_attention_hedgehog(qr, kr, v, wf, wq, wk, window=64)[:1]

    # decode steps: one token at batch B from a saved state (copied back first, so every call computes the same
    # step; the copy is in every candidate's time), KV heads = heads / 4, a window of 64 past its fill
    kv = max(1, heads // 4)
    wsq, wsk = (0.1 * torch.randn(h, dim, dim // 2, device=dev, dtype=bf) for h in (heads, kv))
    signed = triton_common.signed_projections(wsq, wsk, bf)
    step_data = {}
    for B in (8, 1) if any(f.endswith("_step") for f in chosen) else ():
        saved = empty_window_state(B, kv, dim, dim, dim, 64, dtype=bf, device=dev)
        for x in saved[:5]:
            x.copy_(torch.rand_like(x) if x.dtype == bf else 0.01 * torch.rand_like(x))
        saved.seen.fill_(1000)
        qkv = (torch.randn(B, heads, dim, device=dev, dtype=bf), torch.randn(B, kv, dim, device=dev, dtype=bf),
               torch.randn(B, kv, dim, device=dev, dtype=bf))
        step_data[(B, 1)] = (saved, type(saved)(*(x.clone() for x in saved)), *qkv)

    def restore(saved, st):
        for x, y in zip(st, saved):
            x.copy_(y)

    def lin_step(saved, st, q, k, v):
        restore(saved, st)
        return linear_attention_step_hedgehog(q, k, v, wsq, wsk, (st.S, st.z), signed=signed), st.S, st.z

    def win_step(saved, st, q, k, v):
        restore(saved, st)
        return window_linear_attention_step_hedgehog(q, k, v, wf, wsq, wsk, st, signed=signed), st.S, st.z

    runners = (("lin_fwd", lin_fwd), ("lin_fb", lin_fb), ("win_fwd", win_fwd), ("win_fb", win_fb),
               ("lin_fused_fwd", lin_fused_fwd), ("win_fused_fwd", win_fused_fwd), ("lin_step", lin_step),
               ("win_step", win_step))
    cases = {name: step_data if name.endswith("_step") else data for name, _ in runners}
    reference, baseline = {}, {}  # per family and case: the defaults' results and milliseconds
    for name, fn in runners:
        if name not in chosen:
            continue
        reference[name] = {key: [x.detach().clone() for x in fn(*args)] for key, args in cases[name].items()}
        baseline[name] = {key: timer(lambda: fn(*args)) for key, args in cases[name].items()}
    sweep("lin_fwd", tlin, {"fwd_norm_mma": [False, True], "fwd_norm_split": [False, True],
                            "fwd_rowsum_lanes": [False, True]}, lin_fwd)
    # a narrower value block doubles the programs per head: at B = 1 fewer sequences need the segment split
    sweep("lin_fwd", tlin, {"fwd_bv": [64, 128], "fwd_warps": [4, 8]}, lin_fwd)
    sweep("lin_fwd", tlin, {"fwd_bt": [32, 64]}, lin_fwd)
    sweep("lin_fwd", tlin, {"split_below_waves": [0.5, 2.0], "fwd_waves": [2.0, 4.0, 8.0, 16.0]}, lin_fwd)
    sweep("lin_fwd", tlin, {"seg_warps": [4, 8]}, lin_fwd)
    # wider segment-sum tiles read k, v fewer times (K / seg_bk, V / seg_bv)
    sweep("lin_fwd", tlin, {"seg_bk": [64, 128], "seg_bv": [64, 128]}, lin_fwd)
    sweep("lin_fb", tlin, {"bwd_bk": [64, 128], "bwd_warps": [4, 8], "bwd_bt": [64, 128]}, lin_fb)
    sweep("lin_fb", tlin, {"scan_split_below_waves": [2.0, 8.0], "scan_waves": [4.0, 8.0, 16.0]}, lin_fb)
    sweep("win_fwd", twin, {"fwd_two_pass": [False, True], "softmax_warps": [4, 8]}, win_fwd)
    sweep("win_fwd", twin, {"split_below_waves": [0.5, 2.0], "fwd_waves": [2.0, 4.0, 8.0, 16.0]}, win_fwd)
    sweep("win_fwd", twin, {"fwd_bv": [64, 128], "fwd_warps": [4, 8], "fwd_stages": [1, 2, 3]}, win_fwd)
    sweep("win_fwd", twin, {"seg_warps": [4, 8]}, win_fwd)
    sweep("win_fwd", twin, {"seg_bk": [64, 128], "seg_bv": [64, 128]}, win_fwd)
    sweep("win_fb", twin, {"bwd_warps": [4, 8]}, win_fb)
    sweep("win_fb", twin, {"scan_split_below_waves": [2.0, 8.0], "scan_waves": [8.0]}, win_fb)
    fused = {"fused_bv": [32, 64, 128], "fused_warps": [4, 8, 16]}
    sweep("lin_fused_fwd", tlin, {"fused_bt": [16, 32, 64], "fused_stages": [1, 2]}, lin_fused_fwd)
    sweep("lin_fused_fwd", tlin, fused, lin_fused_fwd)
    sweep("win_fused_fwd", twin, fused, win_fused_fwd)  # the single-pass window kernel's value block and warps
    waves = [0.0, 0.5, 1.0, 2.0]  # 0: one program per (batch, KV head)
    sweep("lin_step", tstep, {"linear_step_waves": waves, "linear_step_heads": [0, 1, 2]}, lin_step)
    sweep("win_step", tstep, {"step_waves": waves, "step_warps": [4, 8, 16], "step_heads": [0, 1, 2]}, win_step)
    path = tuning.save(gpu)
    say(f"tuned: linear {tlin.CONFIG} window {twin.CONFIG} steps {tstep.CONFIG}; saved to {path} (used by later "
        "runs on this GPU)")
    return {"linear": dict(tlin.CONFIG), "window": dict(twin.CONFIG), "step": dict(tstep.CONFIG), "saved": str(path)}


# ---------------------------------------------------------------------------
# timing: row specs (which kernels, how their inputs are made, what they are checked against) and the runner


#: ``--check`` modes: ``quick`` (default) checks each timed kernel once, at the first shape it is timed at,
#: against the chunked PyTorch path on float32 copies of the same inputs (the output; for fwd+bwd rows the
#: gradients too); ``accuracy`` and ``full`` add, after the rows, the long-sequence accuracy checks
#: (:func:`_check_accuracy`) or the whole sweep (:func:`check_kernels`: every variant, fp32 and bf16, states)
CHECK_MODES = ("quick", "accuracy", "full", "none")
#: lengths timed by default; ``--full`` adds 128K
DEFAULT_LENGTHS = (2048, 8192, 32768)
FULL_LENGTHS = (2048, 8192, 32768, 131072)
#: row groups beyond the core rows (ours linear and window, SDPA, decode steps): ``fla`` (on by default where fla
#: imports), ``gated`` (``--gated``), ``delta`` (``--delta``: the gated delta rule), ``hedgehog`` (``--hedgehog``),
#: ``unnorm`` (our unnormalised forwards; only with ``--full``, which turns every group on)
ROW_GROUPS = ("fla", "gated", "delta", "hedgehog", "unnorm")
DEFAULT_GROUPS = frozenset({"fla"})
#: decode states rotated over per timed call (more than L2 holds), each step captured in one CUDA graph
NROT = 8
#: what progress calls each pass
PASS_NAMES = {"fwd": "forward", "fwd+bwd": "forward+backward", "step": "decode step"}


@dataclass
class BenchContext:
    """The shapes and resources every row spec builds from."""

    heads: int
    dim: int  # head size of q, k (raw) and v
    window: int
    hedgehog_dim: int  # feature size of the Hedgehog rows (2f)
    device: torch.device
    dtype: torch.dtype
    fla: Mapping[str, Callable]  # fla's functions by name (:class:`FlaOps`)
    sdpa_bwd_max_len: int = 32768
    hedgehog_lengths: Optional[Sequence[int]] = None  # None: every length
    copy_gbs: float = float("nan")  # device-to-device copy, the decode rows' ceiling


@dataclass
class Timed:
    """One timed pass of a row spec at one shape: ``warm`` (default: ``fn`` once) is the first call, where Triton
    compiles; ``fn`` is what ``do_bench`` times (``calls`` calls per ``fn``); ``check`` returns ``[(name, relative
    error, tolerance)]`` against the PyTorch path; ``fields(ms)`` adds row fields (decode: GB/s)."""

    fn: Callable[[], object]
    warm: Optional[Callable[[], object]] = None
    check: Optional[Callable[[], List[tuple]]] = None
    fields: Optional[Callable[[float], dict]] = None
    calls: int = 1
    no_grad: bool = False


@dataclass(frozen=True)
class RowSpec:
    """One kind of row. ``build(ctx, B, T)`` makes its inputs on the device and returns ``{passes: Timed}`` (an
    empty dict: nothing to time at this shape). ``bench`` / ``impl`` are the table's columns (formatted with
    ``window`` and ``hedgehog_dim``); ``groups`` must all be on and ``fla`` (function names) importable for the
    row to run; a ``decode`` row runs once, at the decode batch, after every length; ``when(ctx, T)`` can leave a
    length out. ``first_call`` is the progress verb for a pass's first call ("" for kernels that ship compiled)."""

    bench: str
    impl: str
    what: str
    build: Callable[[BenchContext, int, int], Dict[str, Timed]]
    groups: FrozenSet[str] = frozenset()
    fla: Tuple[str, ...] = ()
    decode: bool = False
    when: Optional[Callable[[BenchContext, int], bool]] = None
    first_call: str = "compiling"

    def names(self, ctx: BenchContext) -> Tuple[str, str]:
        """The table's (bench, impl) for this context."""
        fmt = dict(window=ctx.window, hedgehog_dim=ctx.hedgehog_dim)
        return self.bench.format(**fmt), self.impl.format(**fmt)


def _grad_fn(fwd: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor], do: torch.Tensor):
    def f():
        o = fwd()
        torch.autograd.grad(o, inputs, do)

    return f


def _f32(x):
    """A float32 copy of a floating tensor (a leaf requiring grad where ``x`` does); anything else as is."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().float().requires_grad_(x.requires_grad)
    return x


def _differentiable(ctx: BenchContext, fast: Callable, args: Dict[str, torch.Tensor], do: torch.Tensor,
                    ref: Optional[Callable] = None, passes: Sequence[str] = ("fwd", "fwd+bwd")) -> Dict[str, Timed]:
    """The ``fwd`` (no autograd) and ``fwd+bwd`` (gradients of every argument that requires one, cotangent
    ``do``) passes of ``fast(*args)``. With ``ref`` (the same computation on the PyTorch path) the check compares
    the output, and for fwd+bwd the gradients, with ``ref`` on float32 copies of the arguments."""
    xs = tuple(args.values())
    leaves = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
    names = [n for n, x in args.items() if isinstance(x, torch.Tensor) and x.requires_grad]
    tol, tol_g = TOL.get(ctx.dtype, TOL[torch.bfloat16]), TOL_G.get(ctx.dtype, TOL_G[torch.bfloat16])

    def check_fwd():
        with torch.no_grad():
            o, r = fast(*xs), ref(*(_f32(x) for x in xs))
        return [("out", rel_err(o, r), tol)]

    def check_fwd_bwd():
        o = fast(*xs)
        g = torch.autograd.grad(o, leaves, do)
        rx = tuple(_f32(x) for x in xs)
        r = ref(*rx)
        rg = torch.autograd.grad(r, [x for x in rx if isinstance(x, torch.Tensor) and x.requires_grad], do.float())
        return [("out", rel_err(o, r), tol)] + [(f"d{n}", rel_err(a, b, floor=GRAD_FLOOR), tol_g)
                                                for n, a, b in zip(names, g, rg)]

    out = {}
    if "fwd" in passes:
        out["fwd"] = Timed(fn=lambda: fast(*xs), no_grad=True, check=check_fwd if ref is not None else None)
    if "fwd+bwd" in passes and leaves:
        out["fwd+bwd"] = Timed(fn=_grad_fn(lambda: fast(*xs), leaves, do),
                               check=check_fwd_bwd if ref is not None else None)
    return out


def _rand(ctx: BenchContext, B: int, T: int, D: int, *, signed: bool = False, grad: bool = False) -> torch.Tensor:
    """``[B, T, heads, D]`` in the benchmark's dtype: uniform in [0, 1) (feature-mapped q, k) or normal."""
    x = (torch.randn if signed else torch.rand)(B, T, ctx.heads, D, device=ctx.device, dtype=ctx.dtype)
    return x.requires_grad_(grad)


def _linear_args(ctx: BenchContext, B: int, T: int, *, wide: bool = False, gated: bool = False) -> dict:
    """q, k (features, K = dim or the Hedgehog width), v (V = dim), all requiring grad; gated: log decays
    ``[B, T, heads]`` in [-0.1, 0] (float32)."""
    K = ctx.hedgehog_dim if wide else ctx.dim
    args = {"q": _rand(ctx, B, T, K, grad=True), "k": _rand(ctx, B, T, K, grad=True),
            "v": _rand(ctx, B, T, ctx.dim, signed=True, grad=True)}
    if gated:
        args["log_decay"] = (-0.1 * torch.rand(B, T, ctx.heads, device=ctx.device)).requires_grad_()
    return args


def _ours_linear(normalize: bool = True, *, wide: bool = False, gated: bool = False):
    """Our ``linear_attention`` (gated: with ``log_decay``), checked against its PyTorch path."""

    def build(ctx, B, T):
        def run(backend):
            return lambda q, k, v, log_decay=None: linear_attention(q, k, v, normalize=normalize, log_decay=log_decay,
                                                                    backend=backend)[0]

        args = _linear_args(ctx, B, T, wide=wide, gated=gated)
        return _differentiable(ctx, run(None), args, _rand(ctx, B, T, ctx.dim, signed=True), ref=run("torch"))

    return build


def _fla_linear(normalize: bool = True, *, wide: bool = False):
    """fla's ``chunk_linear_attn`` (``scale=1.0``; its normalisation is a PyTorch step after the kernel)."""

    def build(ctx, B, T):
        chunk = ctx.fla["chunk_linear_attn"]
        return _differentiable(ctx, lambda q, k, v: chunk(q, k, v, scale=1.0, normalize=normalize)[0],
                               _linear_args(ctx, B, T, wide=wide), _rand(ctx, B, T, ctx.dim, signed=True))

    return build


def _fla_simple_gla_rows(ctx, B, T):
    """fla's ``chunk_simple_gla``: one log decay per token and head (our ``log_decay``), unnormalised."""
    sgla = ctx.fla["chunk_simple_gla"]
    return _differentiable(ctx, lambda q, k, v, log_decay: sgla(q, k, v, g=log_decay, scale=1.0)[0],
                           _linear_args(ctx, B, T, gated=True), _rand(ctx, B, T, ctx.dim, signed=True))


def _fla_gla_rows(ctx, B, T):
    """fla's ``chunk_gla``: a log decay per token, head and key channel, here our per-head decay repeated over the
    K channels (the same recurrence, in fla's general gated kernel), unnormalised."""
    gla = ctx.fla["chunk_gla"]
    args = _linear_args(ctx, B, T, gated=True)
    ld = args.pop("log_decay").detach()  # [B, T, H]
    args["g"] = ld.unsqueeze(-1).expand(*ld.shape, ctx.dim).contiguous().requires_grad_()  # [B, T, H, K]
    return _differentiable(ctx, lambda q, k, v, g: gla(q, k, v, g=g, scale=1.0)[0], args,
                           _rand(ctx, B, T, ctx.dim, signed=True))


def _ours_window(*, wide: bool = False):
    """Our ``window_linear_attention``: raw q, k of size dim (the window's softmax), features of size dim or the
    Hedgehog width, window factor 0.3; checked against its PyTorch path."""

    def build(ctx, B, T):
        K = ctx.hedgehog_dim if wide else ctx.dim

        def run(backend):
            return lambda q, k, fq, fk, v, wf: window_linear_attention(q, k, fq, fk, v, wf, window=ctx.window,
                                                                       backend=backend)[0]

        args = {"q": _rand(ctx, B, T, ctx.dim, signed=True, grad=True),
                "k": _rand(ctx, B, T, ctx.dim, signed=True, grad=True),
                "fq": _rand(ctx, B, T, K, grad=True), "fk": _rand(ctx, B, T, K, grad=True),
                "v": _rand(ctx, B, T, ctx.dim, signed=True, grad=True),
                "window_factor": torch.full((ctx.heads,), 0.3, device=ctx.device, requires_grad=True)}
        return _differentiable(ctx, run(None), args, _rand(ctx, B, T, ctx.dim, signed=True), ref=run("torch"))

    return build


def _ours_fused_hedgehog(*, window: bool):
    """Our forwards with the Hedgehog features computed inside the kernel (inference: forward only) from raw
    q, k of size dim: linear with 2f = the Hedgehog width, window with 2f = dim; checked against the PyTorch
    path (features first)."""

    def build(ctx, B, T):
        f = (ctx.dim if window else ctx.hedgehog_dim) // 2
        wq, wk = (0.1 * torch.randn(ctx.heads, ctx.dim, f, device=ctx.device, dtype=ctx.dtype) for _ in range(2))
        args = {"q": _rand(ctx, B, T, ctx.dim, signed=True), "k": _rand(ctx, B, T, ctx.dim, signed=True),
                "v": _rand(ctx, B, T, ctx.dim, signed=True), "weight_q": wq, "weight_k": wk}
        if window:
            args["window_factor"] = torch.full((ctx.heads,), 0.3, device=ctx.device)

            def run(backend):
                return lambda q, k, v, wq, wk, wf: window_linear_attention_hedgehog(q, k, v, wf, wq, wk,
                                                                                    window=ctx.window,
                                                                                    backend=backend)[0]
        else:
            def run(backend):
                return lambda q, k, v, wq, wk: linear_attention_hedgehog(q, k, v, wq, wk, backend=backend)[0]
        return _differentiable(ctx, run(None), args, None, ref=run("torch"), passes=("fwd",))

    return build


def _sdpa(backend):
    """PyTorch SDPA (causal) with one backend, ``[B, heads, T, dim]``: fwd, and fwd+bwd up to
    ``sdpa_bwd_max_len``. Their kernels ship compiled; they run on CUDA only."""

    def build(ctx, B, T):
        if ctx.device.type != "cuda":
            return {}
        args = {n: torch.randn(B, ctx.heads, T, ctx.dim, device=ctx.device, dtype=ctx.dtype, requires_grad=True)
                for n in ("q", "k", "v")}

        def fast(q, k, v):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        passes = ("fwd", "fwd+bwd") if T <= ctx.sdpa_bwd_max_len else ("fwd",)
        do = torch.randn(B, ctx.heads, T, ctx.dim, device=ctx.device, dtype=ctx.dtype)
        return _differentiable(ctx, fast, args, do, passes=passes)

    return build


def _decode_timed(ctx: BenchContext, step: Callable[[int], object], nbytes: int,
                  check: Optional[Callable[[], List[tuple]]] = None) -> Timed:
    """A decode-step pass: ``step(i)`` on state ``i`` of :data:`NROT`, all of them captured in one CUDA graph
    (eager where capture fails or off CUDA); its row adds GB/s of state read and written and % of copy."""
    box: dict = {}

    def warm():
        for i in range(NROT):  # compile outside the capture
            step(i)
        box.update(fn=lambda: [step(i) for i in range(NROT)], graph=False)
        if ctx.device.type == "cuda":
            try:
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for i in range(NROT):
                        step(i)
                box.update(fn=g.replay, graph=True, g=g)
            except Exception:  # pragma: no cover - device only: eager steps
                pass

    def fields(ms):
        gbs = nbytes / ms / 1e6
        return {"gbs": gbs, "pct_copy": 100 * gbs / ctx.copy_gbs, "graph": box["graph"]}

    return Timed(fn=lambda: box["fn"](), warm=warm, check=check, fields=fields, calls=NROT)


def _decode_inputs(ctx: BenchContext, B: int):
    """One decode token: q, k (features, [B, heads, dim]) in [0, 1), v normal, an output buffer."""
    H, D = ctx.heads, ctx.dim
    q = torch.rand(B, H, D, device=ctx.device, dtype=ctx.dtype)
    k = torch.rand(B, H, D, device=ctx.device, dtype=ctx.dtype)
    v = torch.randn(B, H, D, device=ctx.device, dtype=ctx.dtype)
    return q, k, v, torch.empty(B, H, D, device=ctx.device, dtype=ctx.dtype)


def _linear_step(*, gated: bool = False, fla: bool = False):
    """A linear-attention decode step at K = V = dim from :data:`NROT` random states: ours (gated: with a log
    decay per head; checked against the PyTorch step), or fla's ``fused_recurrent_linear_attn``."""

    def build(ctx, B, T):
        H, D = ctx.heads, ctx.dim
        states = [(torch.rand(B, H, D, D, device=ctx.device), torch.rand(B, H, D, device=ctx.device) + 1)
                  for _ in range(NROT)]
        q, k, v, out = _decode_inputs(ctx, B)
        ld = -0.1 * torch.rand(B, H, device=ctx.device) if gated else None
        nbytes = 2 * (B * H * D * D * 4 + B * H * D * 4)  # S and z, read and written
        if fla:
            rec = ctx.fla["fused_recurrent_linear_attn"]
            q4, k4, v4 = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
            return {"step": _decode_timed(ctx, lambda i: rec(q4, k4, v4, scale=1.0, initial_state=states[i][0],
                                                             output_final_state=True), nbytes)}

        def check():
            st, rst = ([x.clone() for x in states[0]] for _ in range(2))
            o = linear_attention_step(q, k, v, st, log_decay=ld)
            r = linear_attention_step(q, k, v, rst, log_decay=ld, backend="torch")
            tol = TOL.get(ctx.dtype, TOL[torch.bfloat16])
            return [("out", rel_err(o, r), tol), ("S", rel_err(st[0], rst[0]), tol)]

        return {"step": _decode_timed(ctx, lambda i: linear_attention_step(q, k, v, states[i], out=out, log_decay=ld),
                                      nbytes, check)}

    return build


def _window_step(ctx, B, T):
    """Our window-hybrid decode step (features = dim, a full window of ``window`` tokens) from :data:`NROT`
    random states; checked against the PyTorch step."""
    H, D = ctx.heads, ctx.dim
    states = []
    for _ in range(NROT):
        st = empty_window_state(B, H, D, D, D, ctx.window, dtype=ctx.dtype, device=ctx.device)
        st.S.copy_(torch.rand_like(st.S))
        st.z.copy_(torch.rand_like(st.z) + 1)
        st.k_ring.normal_()
        st.fk_ring.uniform_()
        st.v_ring.normal_()
        st.seen.fill_(1000)
        states.append(st)
    q, k, v, out = _decode_inputs(ctx, B)
    wf = torch.full((H,), 0.3, device=ctx.device)
    nbytes = 2 * (B * H * D * D * 4 + B * H * D * 4) + B * H * ctx.window * 3 * D * ctx.dtype.itemsize

    def check():
        st, rst = (type(states[0])(*(x.clone() for x in states[0])) for _ in range(2))
        o = window_linear_attention_step(q, k, q, k, v, wf, st)
        r = window_linear_attention_step(q, k, q, k, v, wf, rst, backend="torch")
        tol = TOL.get(ctx.dtype, TOL[torch.bfloat16])
        return [("out", rel_err(o, r), tol), ("S", rel_err(st.S, rst.S), tol)]

    return {"step": _decode_timed(ctx, lambda i: window_linear_attention_step(q, k, q, k, v, wf, states[i], out=out),
                                  nbytes, check)}


def _delta_gates(ctx: BenchContext, *shape: int):
    """``beta = sigmoid(randn)`` in the benchmark's dtype and ``log_decay = logsigmoid(randn) / 16`` (float32, a few
    per cent per token), both of ``shape``."""
    beta = torch.sigmoid(torch.randn(*shape, device=ctx.device)).to(ctx.dtype)
    log_decay = F.logsigmoid(torch.randn(*shape, device=ctx.device)) / 16
    return beta, log_decay


def _unit(ctx: BenchContext, *shape: int) -> torch.Tensor:
    """Normal entries, L2-normalised over the last dimension (as the layer gives q and k), in the benchmark's dtype."""
    return F.normalize(torch.randn(*shape, device=ctx.device), dim=-1).to(ctx.dtype)


def _delta_args(ctx: BenchContext, B: int, T: int, kv_heads: Optional[int]) -> dict:
    """The gated delta rule's inputs, all requiring grad: q ``[B, T, heads, dim]``, k ``[B, T, Hk, dim]``
    (L2-normalised per head), v ``[B, T, Hk, dim]`` normal, beta and log_decay ``[B, T, Hk]``."""
    Hk = kv_heads or ctx.heads
    beta, log_decay = _delta_gates(ctx, B, T, Hk)
    args = {"q": _unit(ctx, B, T, ctx.heads, ctx.dim), "k": _unit(ctx, B, T, Hk, ctx.dim),
            "v": torch.randn(B, T, Hk, ctx.dim, device=ctx.device, dtype=ctx.dtype), "beta": beta,
            "log_decay": log_decay}
    return {n: x.requires_grad_() for n, x in args.items()}


def _delta_fn(ctx: BenchContext, backend: Optional[str]) -> Callable:
    """Our ``gated_delta_rule``'s output on ``backend`` (scale dim^-1/2)."""
    return lambda q, k, v, beta, log_decay: gated_delta_rule(q, k, v, beta, log_decay, scale=ctx.dim ** -0.5,
                                                             backend=backend)[0]


def _ours_delta(kv_heads: Optional[int] = None):
    """Our ``gated_delta_rule``, checked against its chunked PyTorch path."""

    def build(ctx, B, T):
        return _differentiable(ctx, _delta_fn(ctx, None), _delta_args(ctx, B, T, kv_heads),
                               _rand(ctx, B, T, ctx.dim, signed=True), ref=_delta_fn(ctx, "torch"))

    return build


def _fla_delta(kv_heads: Optional[int] = None, check: bool = False):
    """fla's ``chunk_gated_delta_rule`` (``g`` = our log_decay, scale dim^-1/2). It has no GQA: with fewer KV heads
    their k, v, beta, log_decay are repeated per query head inside the timed call. ``check``: compared with our
    chunked PyTorch path as ours is (fla's own accuracy)."""

    def build(ctx, B, T):
        chunk = ctx.fla["chunk_gated_delta_rule"]
        G = ctx.heads // (kv_heads or ctx.heads)

        def fast(q, k, v, beta, log_decay):
            if G > 1:
                k, v, beta, log_decay = (x.repeat_interleave(G, 2) for x in (k, v, beta, log_decay))
            return chunk(q, k, v, g=log_decay, beta=beta, scale=ctx.dim ** -0.5)[0]

        return _differentiable(ctx, fast, _delta_args(ctx, B, T, kv_heads), _rand(ctx, B, T, ctx.dim, signed=True),
                               ref=_delta_fn(ctx, "torch") if check else None)

    return build


def _delta_step(*, fla: bool = False, kv_heads: Optional[int] = None):
    """A gated-delta-rule decode step at K = V = dim from :data:`NROT` random fp32 states ``[B, Hk, dim, dim]``:
    ours (in place; checked against the PyTorch step), or fla's ``fused_recurrent_gated_delta_rule`` (one token,
    the state as ``initial_state``; it returns a new one; with fewer KV heads the state and k, v, beta, log_decay
    repeated per query head)."""

    def build(ctx, B, T):
        H, D = ctx.heads, ctx.dim
        Hk = kv_heads or H
        states = [0.1 * torch.randn(B, Hk, D, D, device=ctx.device) for _ in range(NROT)]
        q, k = _unit(ctx, B, H, D), _unit(ctx, B, Hk, D)
        v = torch.randn(B, Hk, D, device=ctx.device, dtype=ctx.dtype)
        beta, ld = _delta_gates(ctx, B, Hk)
        scale = D ** -0.5
        if fla:
            rec, G = ctx.fla["fused_recurrent_gated_delta_rule"], H // Hk
            q4, k4, v4, b4, g4 = (x.unsqueeze(1) for x in (q, k, v, beta, ld))  # [B, 1, ...]
            if G > 1:
                k4, v4, b4, g4 = (x.repeat_interleave(G, 2) for x in (k4, v4, b4, g4))
                states = [s.repeat_interleave(G, 1) for s in states]
            return {"step": _decode_timed(ctx, lambda i: rec(q4, k4, v4, g=g4, beta=b4, scale=scale,
                                                             initial_state=states[i], output_final_state=True),
                                          2 * states[0].numel() * 4)}
        out = torch.empty(B, H, D, device=ctx.device, dtype=ctx.dtype)

        def check():
            st, rst = states[0].clone(), states[0].clone()
            o = gated_delta_rule_step(q, k, v, beta, ld, st, scale=scale)
            r = gated_delta_rule_step(q, k, v, beta, ld, rst, scale=scale, backend="torch")
            tol = TOL.get(ctx.dtype, TOL[torch.bfloat16])
            return [("out", rel_err(o, r), tol), ("S", rel_err(st, rst), tol)]

        return {"step": _decode_timed(ctx, lambda i: gated_delta_rule_step(q, k, v, beta, ld, states[i], scale=scale,
                                                                           out=out),
                                      2 * states[0].numel() * 4, check)}

    return build


def _hedgehog_length(ctx: BenchContext, T: int) -> bool:
    """The Hedgehog-width rows: a width other than dim, at the lengths asked for (default all)."""
    return ctx.hedgehog_dim != ctx.dim and (ctx.hedgehog_lengths is None or T in ctx.hedgehog_lengths)


_FLA = frozenset({"fla"})
_GATED = frozenset({"gated"})
_DELTA = frozenset({"delta"})
_HEDGEHOG = frozenset({"hedgehog"})


def delta_row_specs(kv_heads: Optional[int] = None, *, check_fla: bool = False) -> List[RowSpec]:
    """The gated delta rule's rows (``--delta``): our ``gated_delta_rule`` and fla's ``chunk_gated_delta_rule``
    (fwd, fwd+bwd), our decode step and fla's ``fused_recurrent_gated_delta_rule``. For ``kernels/bench_delta.py``:
    ``kv_heads`` (GQA; default the query heads) adds ``Hk=N`` to the names; ``check_fla`` checks fla's sequence
    rows too."""
    hk = f" Hk={kv_heads}" if kv_heads else ""
    return [
        RowSpec("gated delta" + hk, "ours", f"gated delta rule{hk} (ours)", _ours_delta(kv_heads), _DELTA),
        RowSpec("gated delta" + hk, "fla", f"fla chunk_gated_delta_rule{hk}", _fla_delta(kv_heads, check_fla),
                _DELTA | _FLA, ("chunk_gated_delta_rule",), first_call="compiling and autotuning"),
        RowSpec("decode", "ours gated delta step" + hk, f"gated delta rule decode step{hk} (ours)",
                _delta_step(kv_heads=kv_heads), _DELTA, decode=True),
        RowSpec("decode", "fla fused_recurrent delta" + hk, f"fla fused_recurrent_gated_delta_rule{hk}",
                _delta_step(fla=True, kv_heads=kv_heads), _DELTA | _FLA, ("fused_recurrent_gated_delta_rule",),
                decode=True),
    ]


#: every row kind, in the order each length runs them (the default's first, fla's autotuned kernels last among
#: them); add a kernel by adding a spec. ``bench kernels`` times those whose groups are on.
ROW_SPECS: List[RowSpec] = [
    RowSpec("linear", "ours", "linear attention (ours)", _ours_linear()),
    RowSpec("window", "ours W={window}", "window hybrid W={window} (ours)", _ours_window()),
    RowSpec("linear", "sdpa-flash", "SDPA flash", _sdpa(SDPBackend.FLASH_ATTENTION), first_call=""),
    RowSpec("linear", "sdpa-cudnn", "SDPA cuDNN", _sdpa(SDPBackend.CUDNN_ATTENTION), first_call=""),
    RowSpec("linear", "fla", "fla chunk_linear_attn", _fla_linear(), _FLA, ("chunk_linear_attn",),
            first_call="compiling and autotuning"),
    RowSpec("linear", "fla-unnorm", "fla chunk_linear_attn unnormalised", _fla_linear(False), _FLA,
            ("chunk_linear_attn",), first_call="compiling and autotuning"),
    RowSpec("linear", "ours-unnorm", "linear attention unnormalised (ours)", _ours_linear(False),
            frozenset({"unnorm"})),
    RowSpec("linear gated", "ours", "gated linear attention (ours)", _ours_linear(gated=True), _GATED),
    RowSpec("linear gated", "ours-unnorm", "gated linear attention unnormalised (ours)",
            _ours_linear(False, gated=True), _GATED),
    RowSpec("linear gated", "fla simple_gla", "fla chunk_simple_gla", _fla_simple_gla_rows, _GATED | _FLA,
            ("chunk_simple_gla",), first_call="compiling and autotuning"),
    RowSpec("linear gated", "fla gla", "fla chunk_gla", _fla_gla_rows, _GATED | _FLA, ("chunk_gla",),
            first_call="compiling and autotuning"),
    RowSpec("linear K={hedgehog_dim}", "ours", "linear attention K={hedgehog_dim} (ours)", _ours_linear(wide=True),
            _HEDGEHOG, when=_hedgehog_length),
    RowSpec("linear K={hedgehog_dim}", "ours-unnorm", "linear attention K={hedgehog_dim} unnormalised (ours)",
            _ours_linear(False, wide=True), _HEDGEHOG | {"unnorm"}, when=_hedgehog_length),
    RowSpec("linear K={hedgehog_dim}", "fla", "fla chunk_linear_attn K={hedgehog_dim}", _fla_linear(wide=True),
            _HEDGEHOG | _FLA, ("chunk_linear_attn",), when=_hedgehog_length, first_call="compiling and autotuning"),
    RowSpec("linear K={hedgehog_dim}", "fla-unnorm", "fla chunk_linear_attn K={hedgehog_dim} unnormalised",
            _fla_linear(False, wide=True), _HEDGEHOG | _FLA | {"unnorm"}, ("chunk_linear_attn",),
            when=_hedgehog_length, first_call="compiling and autotuning"),
    RowSpec("linear K={hedgehog_dim}", "ours fused hedgehog", "linear attention, Hedgehog features in the kernel",
            _ours_fused_hedgehog(window=False), _HEDGEHOG,
            when=lambda ctx, T: _hedgehog_length(ctx, T) and ctx.hedgehog_dim % 2 == 0),
    RowSpec("window K={hedgehog_dim}", "ours W={window}", "window hybrid W={window} K={hedgehog_dim} (ours)",
            _ours_window(wide=True), _HEDGEHOG, when=_hedgehog_length),
    RowSpec("window", "ours W={window} fused hedgehog", "window hybrid, Hedgehog features in the kernel",
            _ours_fused_hedgehog(window=True), _HEDGEHOG, when=lambda ctx, T: ctx.dim % 2 == 0),
    RowSpec("decode", "ours linear step", "linear decode step (ours)", _linear_step(), decode=True),
    RowSpec("decode", "ours gated linear step", "gated linear decode step (ours)", _linear_step(gated=True),
            _GATED, decode=True),
    RowSpec("decode", "fla fused_recurrent", "fla fused_recurrent_linear_attn", _linear_step(fla=True), _FLA,
            ("fused_recurrent_linear_attn",), decode=True),
    RowSpec("decode", "ours window step W={window}", "window decode step W={window} (ours)", _window_step,
            decode=True),
    *delta_row_specs(),  # the gated delta rule's (--delta): each length's last rows, and the last decode rows
]


def row_groups(*, gated: bool = False, hedgehog: bool = False, delta: bool = False, full: bool = False,
               fla: bool = True) -> frozenset:
    """The row groups a run times: the default's (fla), ``gated``, ``hedgehog``, ``delta``, or with ``full`` all of
    them; ``fla=False`` leaves fla's rows out."""
    on = {"gated": gated, "hedgehog": hedgehog, "delta": delta}
    groups = set(ROW_GROUPS) if full else set(DEFAULT_GROUPS) | {g for g, flag in on.items() if flag}
    if not fla:
        groups.discard("fla")
    return frozenset(groups)


def select_rows(specs: Sequence[RowSpec], groups, fla_ops) -> List[RowSpec]:
    """The specs whose groups are all in ``groups`` and whose fla functions are all in ``fla_ops``."""
    return [s for s in specs if set(s.groups) <= set(groups) and all(f in fla_ops for f in s.fla)]


def parse_lengths(value) -> List[int]:
    """``--lengths``: ``"2K,8K"`` -> ``[2048, 8192]`` (sorted, duplicates removed); one line naming the forms
    otherwise."""
    items = [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if str(v).strip()]
    if not items:
        raise LinearizeError(f"bad lengths {value!r}: give at least one, e.g. 2K,8K,32K")
    return sorted({parse_length(v) for v in items})


#: the fla functions rows may time, by the module that holds them
_FLA_MODULES = {"chunk_linear_attn": "fla.ops.linear_attn", "fused_recurrent_linear_attn": "fla.ops.linear_attn",
                "chunk_simple_gla": "fla.ops.simple_gla", "chunk_gla": "fla.ops.gla",
                "chunk_gated_delta_rule": "fla.ops.gated_delta_rule",
                "fused_recurrent_gated_delta_rule": "fla.ops.gated_delta_rule"}


class FlaOps:
    """fla's functions by name (``ops["chunk_gla"]``), imported when a row first needs one: importing fla takes
    seconds, which must not delay the first row. ``name in ops`` when fla is installed (fla is optional: its
    rows are skipped without it)."""

    def __init__(self, installed: Optional[bool] = None):
        self.installed = importlib.util.find_spec("fla") is not None if installed is None else installed

    def __contains__(self, name: str) -> bool:
        return self.installed and name in _FLA_MODULES

    def __getitem__(self, name: str) -> Callable:
        return getattr(importlib.import_module(_FLA_MODULES[name]), name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_row(ctx: BenchContext, timer) -> dict:
    """The device-to-device copy ceiling (1 GiB on CUDA, 4 MiB elsewhere), the decode rows' reference."""
    n = (1 << 28) if ctx.device.type == "cuda" else (1 << 20)
    x = torch.empty(n, dtype=torch.float32, device=ctx.device)
    y = torch.empty_like(x)
    x.normal_()
    ms = timer(lambda: y.copy_(x))
    ctx.copy_gbs = 2 * x.numel() * 4 / ms / 1e6
    return dict(bench="copy", impl="torch copy_", T=0, B=0, passes="-", ms=ms, gbs=ctx.copy_gbs)


def format_row(row: dict) -> str:
    """One result row as a line (what the run prints as each row is measured)."""
    T = format_length(row["T"]) if row["T"] >= 1024 else str(row["T"])
    line = f"{row['bench']:<14} {row['impl']:<28} T={T:<5} B={row['B']:<3} {row['passes']:<8} {row['ms']:9.4f} ms"
    if "gbs" in row:
        line += f"  {row['gbs']:.0f} GB/s"
    if "pct_copy" in row:
        line += f" ({row['pct_copy']:.0f}% of copy)"
    return line


def _row(rows, **kw):
    rows.append(kw)
    return kw


def bench_kernels(
    out_json: Optional[Path] = None,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    tokens: int = 32768,
    heads: int = 32,
    dim: int = 128,
    *,
    window: int = 64,
    hedgehog_dim: int = 256,
    decode_batch: int = 8,
    hedgehog_lengths: Optional[Sequence[int]] = None,
    sdpa_bwd_max_len: int = 32768,
    decode: bool = True,
    warmup: int = 25,
    rep: int = 100,
    check: str = "quick",
    groups=None,
    specs: Optional[Sequence[RowSpec]] = None,
    fla_ops: Optional[Mapping[str, Callable]] = None,
    progress: Optional[Callable[[str], None]] = None,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    timer: Optional[Callable[[Callable[[], object]], float]] = None,
) -> List[dict]:
    """Time our kernels against fla and SDPA, one row at a time.

    For each ``T`` in ``lengths`` (batch ``max(1, tokens // T)``) every selected row spec (:data:`ROW_SPECS`
    whose ``groups`` are on: default :data:`DEFAULT_GROUPS`; see :func:`row_groups`) runs each pass in turn:
    its first call (Triton compiles here: progress says so first), the ``check`` of that kernel if it has not
    been checked yet (:data:`CHECK_MODES`), the timing (median of ``do_bench``), then the row is printed through
    ``progress`` and ``out_json`` rewritten (``"complete": false`` until the end, so a run cut short keeps every
    row it finished). Decode-step rows run after the lengths, at ``decode_batch``. Nothing is compiled ahead of
    the row that needs it. ``specs`` / ``fla_ops`` / ``device`` / ``timer`` (ms of a call) let tests run the
    plumbing on CPU.
    Returns ``[{"meta"}] + checks + rows``.
    """
    if check not in CHECK_MODES:
        raise LinearizeError(f"--check {check!r}: expected one of {', '.join(CHECK_MODES)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError("bench kernels needs a CUDA GPU (none is visible)")
    say = progress or (lambda s: None)
    timer = timer or (lambda fn: _bench(fn, warmup, rep))
    groups = DEFAULT_GROUPS if groups is None else frozenset(groups)
    fla_ops = FlaOps() if fla_ops is None else fla_ops
    chosen = select_rows(ROW_SPECS if specs is None else specs, groups, fla_ops)
    ctx = BenchContext(heads=heads, dim=dim, window=window, hedgehog_dim=hedgehog_dim, device=dev, dtype=dtype,
                       fla=fla_ops, sdpa_bwd_max_len=sdpa_bwd_max_len,
                       hedgehog_lengths=tuple(hedgehog_lengths) if hedgehog_lengths is not None else None)
    # optional: Triton, only where the GPU kernels run
    from linearize.kernels import triton_linear, triton_window, tuning

    tuning.ensure_applied(dev)  # the shipped launch configuration, or this GPU's saved tuning: nothing is swept
    meta = {"date": _dt.datetime.now().isoformat(timespec="seconds"), **_versions(),
            "heads": heads, "dim": dim, "tokens": tokens, "window": window,
            "lengths": list(lengths), "check": check, "groups": sorted(groups),
            # the launch configuration timed: the shipped defaults or this GPU's saved tuning
            "config": {"linear": dict(triton_linear.CONFIG), "window": dict(triton_window.CONFIG),
                       "source": tuning.applied_from() or "defaults"}}
    if "delta" in groups:
        # optional: Triton, only where the GPU kernels run
        from linearize.kernels import triton_delta, triton_delta_step

        meta["config"].update(delta=dict(triton_delta.CONFIG), delta_step=dict(triton_delta_step.CONFIG))
    checks: List[dict] = []
    rows: List[dict] = []

    def save(complete: bool = False) -> None:  # after every row: a run cut short keeps what it measured
        if out_json is not None:
            write_rows(out_json, meta, checks, rows, complete=complete)

    prefill = [s for s in chosen if not s.decode]
    decoding = [s for s in chosen if s.decode] if decode else []
    off = [g for g in ROW_GROUPS if g not in groups]
    say(f"bench kernels: T={','.join(format_length(T) for T in lengths)} (B*T={tokens}), {len(prefill)} kinds of "
        f"rows per length, {len(decoding)} decode rows, check {check}"
        + (f"; off: {', '.join(off)} (--gated, --delta, --hedgehog, --full)" if off else "")
        + ("" if "fla" not in groups or "chunk_linear_attn" in fla_ops else
           "; fla is not installed: its rows are skipped"))
    say("each kernel compiles on its first call (seconds each on a fresh machine; Triton caches them for later runs)")

    copy = _row(rows, **_copy_row(ctx, timer))
    say(format_row(copy))
    save()
    checked = set()

    def run_spec(spec: RowSpec, B: int, T: int) -> None:
        bench, impl = spec.names(ctx)
        where = f"T={format_length(T) if T >= 1024 else T}, B={B}"
        try:
            passes = spec.build(ctx, B, T)
        except Exception as e:  # pragma: no cover - device only (out of memory, a missing backend)
            _failed(bench, impl, T, B, "-", e)
            return
        for name, timed in passes.items():
            if spec.first_call:
                say(f"{spec.first_call} {spec.what.format(window=window, hedgehog_dim=hedgehog_dim)}: "
                    f"{PASS_NAMES.get(name, name)} ({where}) ...")
            try:
                with torch.no_grad() if timed.no_grad else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    (timed.warm or timed.fn)()
                    _sync(dev)
                    first_s = time.perf_counter() - t0
                note = ""
                if check != "none" and timed.check is not None and (bench, impl, name) not in checked:
                    checked.add((bench, impl, name))
                    entry = _run_check(f"quick {bench} {impl} {name} {where}", timed.check)
                    checks.append(entry)
                    note = ", check " + (f"ok {entry['rel_err']:.1e}" if entry["ok"] else
                                         f"FAILED {entry.get('error', '')}")
                with torch.no_grad() if timed.no_grad else contextlib.nullcontext():
                    ms = timer(timed.fn) / timed.calls
                row = _row(rows, bench=bench, impl=impl, T=T, B=B, passes=name, ms=ms,
                           first_call_s=round(first_s, 3), **(timed.fields(ms) if timed.fields else {}))
                save()
                say(f"{format_row(row)}  (first call {first_s:.1f} s{note})")
            except (KeyboardInterrupt, DeviceError):
                raise
            except Exception as e:  # pragma: no cover - device only
                _failed(bench, impl, T, B, name, e)
        del passes

    def _failed(bench, impl, T, B, name, e) -> None:
        if _context_lost(e):  # every later launch in this process would fail too
            raise DeviceError(f"{bench} {impl} at T={T} crashed the GPU context ({str(e)[:80]}); the rows measured "
                              "before it are kept") from e
        _row(rows, bench="error", impl=f"{bench} {impl}", T=T, B=B, passes=name, ms=float("nan"), note=str(e)[:300])
        save()
        say(f"ERROR {bench} {impl} {name} T={T}: {type(e).__name__}: {str(e)[:300]}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    for T in lengths:
        for spec in prefill:
            if spec.when is None or spec.when(ctx, T):
                run_spec(spec, max(1, tokens // T), T)
    for spec in decoding:
        run_spec(spec, decode_batch, 1)

    if check in ("accuracy", "full"):
        say(f"check {check}: " + ("the long-sequence accuracy and decode checks" if check == "accuracy" else
                                  "every variant, fp32 and bf16, then the long-sequence checks") + " ...")

        def report(c: dict) -> None:
            checks.append(c)
            save()
            say(f"check {c['check']}: {'ok' if c['ok'] else 'FAIL'} {c.get('rel_err', '')} {c.get('error', '')}")

        if check == "full":
            check_kernels(device, report=report)
        else:
            try:
                for c in _check_accuracy(device):
                    report(c)
            except Exception as e:  # pragma: no cover - device only
                report({"check": "accuracy", "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    save(complete=True)
    return [dict(meta=meta)] + checks + rows


def _run_check(name: str, fn: Callable[[], List[tuple]]) -> dict:
    """A quick check's entry: ``rel_err`` the largest relative error, ``ok`` if each is within its tolerance;
    ``error`` names what failed (or the exception)."""
    try:
        results = fn()
    except Exception as e:  # pragma: no cover - device only
        return {"check": name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    worst = max(results, key=lambda r: r[1] / r[2] if r[1] == r[1] else float("inf"))
    ok = all(err <= tol for _, err, tol in results)
    entry = {"check": name, "ok": ok, "rel_err": max(err for _, err, _ in results)}
    if not ok:
        entry["error"] = f"{worst[0]} relative error {worst[1]:.2e} > {worst[2]:.0e}"
    return entry


def write_rows(out_json, meta: dict, checks: list, rows: list, *, complete: bool) -> Path:
    """Write ``{"meta", "checks", "rows", "complete"}`` to ``out_json`` atomically (``complete`` false while the
    benchmark is still running: after each block of rows, so an interrupted run keeps what it measured)."""
    out_json = Path(out_json)
    with atomic_write(out_json) as tmp:
        tmp.write_text(json.dumps({"meta": meta, "checks": checks, "rows": rows, "complete": complete}, indent=1))
    return out_json


def summarize(rows: List[dict]) -> List[dict]:
    """Ratios the issue's targets are stated in (per T): speed-ups = their ms / our ms."""
    by = {}
    for r in rows:
        if "bench" in r:
            by[(r["bench"], r["impl"], r["T"], r["passes"])] = r["ms"]
    out = []
    Ts = sorted({r["T"] for r in rows if r.get("bench") in ("linear", "gated delta")})
    for T in Ts:
        g = lambda b, i, p: by.get((b, i, T, p))  # noqa: E731
        ours_f, ours_fb = g("linear", "ours", "fwd"), g("linear", "ours", "fwd+bwd")
        row = {"T": T, "ours fwd ms": ours_f, "ours fwd+bwd ms": ours_fb}
        def ratio(key, their, ours):
            if their is not None and ours:
                row[key] = their / ours

        ratio("fwd vs fla norm", g("linear", "fla", "fwd"), ours_f)
        ratio("fwd vs fla unnorm", g("linear", "fla-unnorm", "fwd"), ours_f)
        ratio("fwd+bwd vs fla norm", g("linear", "fla", "fwd+bwd"), ours_fb)
        ratio("gated unnorm fwd vs fla simple_gla", g("linear gated", "fla simple_gla", "fwd"),
              g("linear gated", "ours-unnorm", "fwd"))
        ratio("gated unnorm fwd+bwd vs fla simple_gla", g("linear gated", "fla simple_gla", "fwd+bwd"),
              g("linear gated", "ours-unnorm", "fwd+bwd"))
        ratio("gated unnorm fwd vs fla gla", g("linear gated", "fla gla", "fwd"),
              g("linear gated", "ours-unnorm", "fwd"))
        ratio("gated unnorm fwd+bwd vs fla gla", g("linear gated", "fla gla", "fwd+bwd"),
              g("linear gated", "ours-unnorm", "fwd+bwd"))
        ratio("delta fwd vs fla", g("gated delta", "fla", "fwd"), g("gated delta", "ours", "fwd"))
        ratio("delta fwd+bwd vs fla", g("gated delta", "fla", "fwd+bwd"), g("gated delta", "ours", "fwd+bwd"))
        sd = [x for x in (g("linear", "sdpa-flash", "fwd"), g("linear", "sdpa-cudnn", "fwd")) if x and x == x]
        if sd:
            ratio("fwd vs best sdpa", min(sd), ours_f)
        for key, fused in (("window fwd / ours fwd", False), ("window fused-hedgehog fwd / ours fwd", True)):
            wins = [r["ms"] for r in rows if r.get("bench") == "window" and r["T"] == T and r["passes"] == "fwd"
                    and r["impl"].endswith(" fused hedgehog") == fused]
            if wins and ours_f:
                row[key] = wins[0] / ours_f
        out.append(row)
    return out


def print_table(rows: List[dict]) -> None:
    """Print the benchmark rows and the target summary with rich."""
    con = make_console()
    meta = next((r["meta"] for r in rows if "meta" in r), {})
    if meta:
        con.print(", ".join(f"{k}={v}" for k, v in meta.items()))
    checks = [r for r in rows if "check" in r]
    if checks:
        bad = [c for c in checks if not c["ok"]]
        con.print(f"device checks: {len(checks) - len(bad)}/{len(checks)} ok")
        for c in checks:
            if "rel_err" in c or not c["ok"]:
                con.print(f"  {c['check']}: {'ok' if c['ok'] else 'FAIL'} {c.get('rel_err', '')} {c.get('error', '')}")
    data = [r for r in rows if "bench" in r]
    t = Table(title="kernel timings (median ms, do_bench)")
    for col in ("bench", "impl", "T", "B", "passes", "ms", "GB/s", "% copy"):
        t.add_column(col)
    for r in data:
        t.add_row(r["bench"], r["impl"], str(r["T"]), str(r["B"]), r["passes"], f"{r['ms']:.4f}",
                  f"{r['gbs']:.0f}" if "gbs" in r else "", f"{r['pct_copy']:.0f}%" if "pct_copy" in r else "")
    con.print(t)
    summ = summarize(data)
    if summ:
        s = Table(title="speed-ups (their time / ours)")
        cols = list(dict.fromkeys(k for r in summ for k in r))
        for c in cols:
            s.add_column(c)
        for r in summ:
            s.add_row(*[(f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c, ""))) for c in cols])
        con.print(s)
    dec = {r["impl"]: r for r in data if r["bench"] == "decode"}
    for what, ours, theirs in (("decode", "ours linear step", "fla fused_recurrent"),
                               ("gated delta decode", "ours gated delta step", "fla fused_recurrent delta")):
        if ours in dec and theirs in dec:
            con.print(f"{what}: ours {dec[ours]['ms'] * 1e3:.1f} us vs fla {dec[theirs]['ms'] * 1e3:.1f} us = "
                      f"{dec[theirs]['ms'] / dec[ours]['ms']:.2f}x")


if __name__ == "__main__":  # python -m linearize.bench.kernels [out.json] [--tune] [--full]
    import sys

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--tune" in sys.argv:
        tuned = tune_kernels(progress=lambda s: print(s, flush=True))
        print("TUNED", json.dumps(tuned), flush=True)
    full = "--full" in sys.argv
    res = bench_kernels(Path(args[0]) if args else None, lengths=FULL_LENGTHS if full else DEFAULT_LENGTHS,
                        groups=row_groups(full=full), progress=lambda s: print(s, flush=True))
    print_table(res)

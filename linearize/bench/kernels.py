"""Kernel benchmark: ``linearize bench kernels``.

Times our Triton kernels side by side with fla 0.6.0 (``chunk_linear_attn``,
``fused_recurrent_linear_attn``, ``chunk_simple_gla`` for the gated rows; optional: rows are skipped when fla is
absent) and
PyTorch SDPA (flash and cuDNN backends), median of ``triton.testing.do_bench``, all
in one process on one GPU. A correctness check against the float64 reference runs
first (fresh random inputs per check). See ``kernels/README.md`` for the table.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as md
import itertools
import json
import os
import platform
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
from rich.table import Table
from torch.nn.attention import SDPBackend, sdpa_kernel

from linearize.kernels import (empty_window_state, linear_attention, linear_attention_hedgehog, linear_attention_step,
                               window_linear_attention, window_linear_attention_hedgehog, window_linear_attention_step,
                               window_state_from_prefill)
from linearize.kernels.testing import check_linear, check_window, linear_inputs, rel_err, window_inputs

from ..atomic import atomic_write
from ..errors import DeviceError, LinearizeError
from ..progress import make_console

# fla's Triton path only (it otherwise dispatches to other backends when present)
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")


def _bench(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    # optional: Triton, only where the GPU kernels run
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _fla():
    try:
        # optional dependency: fla (its rows are skipped without it)
        from fla.ops.linear_attn import chunk_linear_attn, fused_recurrent_linear_attn

        return chunk_linear_attn, fused_recurrent_linear_attn
    except Exception:  # pragma: no cover - optional dependency
        return None


def _fla_simple_gla():
    """fla's ``chunk_simple_gla`` (per-token, per-head log decay, unnormalised), or None without fla."""
    try:
        # optional dependency: fla (its rows are skipped without it)
        from fla.ops.simple_gla import chunk_simple_gla

        return chunk_simple_gla
    except Exception:  # pragma: no cover - optional dependency
        return None


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


def check_kernels(device: str = "cuda") -> List[dict]:
    """Our Triton paths vs the float64 reference on the device (outputs, states, gradients).

    Returns one row per check with the measured relative errors; raises nothing (a failed
    check is a row with ``ok=False``).
    """
    rows: List[dict] = []

    def run(name, fn):
        try:
            fn()
            rows.append({"check": name, "ok": True})
        except Exception as e:  # pragma: no cover - device only
            rows.append({"check": name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"})

    for dt in (torch.float32, torch.bfloat16):
        for shape in [(2, 1000, 4, 2, 64, 32), (1, 777, 2, 2, 128, 128), (1, 300, 2, 1, 256, 64)]:
            for norm in (True, False):
                run(f"linear {shape} {dt} norm={norm}",
                    lambda: check_linear("triton", *shape, dt, normalize=norm, state=True, device=device))
        for shape in [(2, 1000, 4, 2, 64, 64, 32, 64), (1, 777, 2, 2, 128, 128, 128, 64),
                      (1, 500, 2, 1, 64, 256, 64, 16), (1, 500, 2, 1, 64, 64, 64, 100)]:
            run(f"window {shape} {dt}", lambda: check_window("triton", *shape, dt, state=True, device=device))

    try:
        rows.extend(_check_accuracy(device))
    except Exception as e:  # pragma: no cover - device only
        rows.append({"check": "accuracy/decode", "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"})
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
# timing


def _grad_fn(fwd: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor], do: torch.Tensor):
    def f():
        o = fwd()
        torch.autograd.grad(o, inputs, do)

    return f


_ECHO: Optional[Callable[[str], None]] = None


def _row(rows, **kw):
    rows.append(kw)
    if _ECHO is not None:
        _ECHO("ROW " + json.dumps(kw))
    return kw


def bench_kernels(
    out_json: Optional[Path] = None,
    lengths: Sequence[int] = (2048, 8192, 32768, 131072),
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
    check: str = "full",
    progress: Optional[Callable[[str], None]] = None,
) -> List[dict]:
    """Benchmark our kernels vs fla and SDPA on the current CUDA device.

    For each ``T`` in ``lengths`` the batch is ``max(1, tokens // T)``; bf16, ``heads``
    heads of size ``dim`` (K = V = dim), plus the window hybrid (``window``) and the
    Hedgehog feature size ``hedgehog_dim``; decode steps at ``decode_batch``. Returns
    rows (dicts) and writes them with the environment to ``out_json`` if given.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("bench_kernels needs a CUDA GPU")

    global _ECHO
    say = progress or (lambda s: None)
    _ECHO = progress
    dev = torch.device("cuda")
    bf = torch.bfloat16
    fla = _fla()
    fla_gla = _fla_simple_gla()
    rows: List[dict] = []
    # optional: Triton, only where the GPU kernels run
    from linearize.kernels import triton_linear, triton_window, tuning

    tuning.ensure_applied(dev)
    meta = {"date": _dt.datetime.now().isoformat(timespec="seconds"), **_versions(),
            "heads": heads, "dim": dim, "tokens": tokens, "window": window,
            # the launch configuration timed: the shipped defaults or this GPU's saved tuning
            "config": {"linear": dict(triton_linear.CONFIG), "window": dict(triton_window.CONFIG),
                       "source": tuning.applied_from() or "defaults"}}
    if check == "full":
        checks = check_kernels("cuda")
    elif check == "accuracy":
        try:
            checks = _check_accuracy("cuda")
        except Exception as e:  # pragma: no cover - device only
            checks = [{"check": "accuracy", "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}]
    else:
        checks = []
    for c in checks:
        say(f"check {c['check']}: {'ok' if c['ok'] else 'FAIL'} {c.get('rel_err', '')} {c.get('error', '')}")

    def block_done(message: str) -> None:  # a run cut short (a time limit) keeps the blocks it finished
        say(message)
        if out_json is not None:
            write_rows(out_json, meta, checks, rows, complete=False)

    # device ceilings: device-to-device copy
    x = torch.empty(1 << 28, dtype=torch.float32, device=dev)  # 1 GiB
    y = torch.empty_like(x)
    x.normal_()
    t = _bench(lambda: y.copy_(x), warmup, rep)
    copy_gbs = 2 * x.numel() * 4 / t / 1e6
    _row(rows, bench="copy", impl="torch copy_", T=0, B=0, passes="-", ms=t, gbs=copy_gbs)
    del x, y
    say(f"copy {copy_gbs:.0f} GB/s")

    def lin_inputs(B, T, K, V, dt=bf):
        q = torch.rand(B, T, heads, K, device=dev, dtype=dt)
        k = torch.rand(B, T, heads, K, device=dev, dtype=dt)
        v = torch.randn(B, T, heads, V, device=dev, dtype=dt)
        return q, k, v

    for T in lengths:
        B = max(1, tokens // T)
        for K in (dim, hedgehog_dim):
            if K != dim and hedgehog_lengths is not None and T not in hedgehog_lengths:
                continue
            try:
                tag = "" if K == dim else f" K={K}"
                q, k, v = lin_inputs(B, T, K, dim)
                do = torch.randn(B, T, heads, dim, device=dev, dtype=bf)
                ins = (q, k, v)
                for p in ins:
                    p.requires_grad_(True)
                for norm in (True, False):
                    name = "ours" if norm else "ours-unnorm"
                    f = lambda: linear_attention(q, k, v, normalize=norm)[0]  # noqa: E731
                    with torch.no_grad():
                        ms = _bench(f, warmup, rep)
                    _row(rows, bench="linear" + tag, impl=name, T=T, B=B, passes="fwd", ms=ms)
                    ms = _bench(_grad_fn(f, ins, do), warmup, rep)
                    _row(rows, bench="linear" + tag, impl=name, T=T, B=B, passes="fwd+bwd", ms=ms)
                    if fla is not None:
                        chunk = fla[0]
                        g = lambda: chunk(q, k, v, scale=1.0, normalize=norm)[0]  # noqa: E731
                        fname = "fla" if norm else "fla-unnorm"
                        with torch.no_grad():
                            ms = _bench(g, warmup, rep)
                        _row(rows, bench="linear" + tag, impl=fname, T=T, B=B, passes="fwd", ms=ms)
                        ms = _bench(_grad_fn(g, ins, do), warmup, rep)
                        _row(rows, bench="linear" + tag, impl=fname, T=T, B=B, passes="fwd+bwd", ms=ms)
                if K == dim:  # gated (log_decay), the same shapes; fla's chunk_simple_gla is unnormalised
                    ld = (-0.1 * torch.rand(B, T, heads, device=dev)).requires_grad_()
                    for norm in (True, False):
                        name = "ours" if norm else "ours-unnorm"
                        f = lambda: linear_attention(q, k, v, normalize=norm, log_decay=ld)[0]  # noqa: E731
                        with torch.no_grad():
                            ms = _bench(f, warmup, rep)
                        _row(rows, bench="linear gated", impl=name, T=T, B=B, passes="fwd", ms=ms)
                        ms = _bench(_grad_fn(f, ins + (ld,), do), warmup, rep)
                        _row(rows, bench="linear gated", impl=name, T=T, B=B, passes="fwd+bwd", ms=ms)
                    if fla_gla is not None:
                        g = lambda: fla_gla(q, k, v, g=ld, scale=1.0)[0]  # noqa: E731
                        with torch.no_grad():
                            ms = _bench(g, warmup, rep)
                        _row(rows, bench="linear gated", impl="fla simple_gla", T=T, B=B, passes="fwd", ms=ms)
                        ms = _bench(_grad_fn(g, ins + (ld,), do), warmup, rep)
                        _row(rows, bench="linear gated", impl="fla simple_gla", T=T, B=B, passes="fwd+bwd", ms=ms)
                    del ld
                if K != dim and K % 2 == 0:  # Hedgehog: K = 2f features of raw dim-wide q, k, made in the kernel
                    qr = torch.randn(B, T, heads, dim, device=dev, dtype=bf)
                    kr = torch.randn(B, T, heads, dim, device=dev, dtype=bf)
                    wq = 0.1 * torch.randn(heads, dim, K // 2, device=dev, dtype=bf)
                    wk = 0.1 * torch.randn(heads, dim, K // 2, device=dev, dtype=bf)
                    with torch.no_grad():
                        ms = _bench(lambda: linear_attention_hedgehog(qr, kr, v, wq, wk)[0], warmup, rep)
                    _row(rows, bench="linear" + tag, impl="ours fused hedgehog", T=T, B=B, passes="fwd", ms=ms)
                    del qr, kr
                block_done(f"linear{tag} T={T} done")
                # window hybrid: raw q/k of size dim, features of size K
                qr = torch.randn(B, T, heads, dim, device=dev, dtype=bf)
                kr = torch.randn(B, T, heads, dim, device=dev, dtype=bf)
                wf = torch.full((heads,), 0.3, device=dev, requires_grad=True)
                wins = (qr, kr, q, k, v)
                for p in (qr, kr):
                    p.requires_grad_(True)
                f = lambda: window_linear_attention(qr, kr, q, k, v, wf, window=window)[0]  # noqa: E731
                with torch.no_grad():
                    ms = _bench(f, warmup, rep)
                _row(rows, bench="window" + tag, impl=f"ours W={window}", T=T, B=B, passes="fwd", ms=ms)
                ms = _bench(_grad_fn(f, wins + (wf,), do), warmup, rep)
                _row(rows, bench="window" + tag, impl=f"ours W={window}", T=T, B=B, passes="fwd+bwd", ms=ms)
                if K == dim and dim % 2 == 0:  # Hedgehog maps (2f = dim features) computed inside the kernel
                    wq = 0.1 * torch.randn(heads, dim, dim // 2, device=dev, dtype=bf)
                    wk = 0.1 * torch.randn(heads, dim, dim // 2, device=dev, dtype=bf)
                    with torch.no_grad():
                        ms = _bench(lambda: window_linear_attention_hedgehog(qr, kr, v, wf, wq, wk, window=window)[0],
                                    warmup, rep)
                    _row(rows, bench="window" + tag, impl=f"ours W={window} fused hedgehog", T=T, B=B, passes="fwd",
                         ms=ms)
                del qr, kr, q, k, v, do
                block_done(f"window{tag} T={T} done")
            except Exception as e:  # pragma: no cover - device only
                _row(rows, bench="error", impl=f"K={K}", T=T, B=B, passes="-", ms=float("nan"), note=str(e)[:300])
                say(f"ERROR K={K} T={T}: {type(e).__name__}: {str(e)[:300]}")
                torch.cuda.empty_cache()
        # softmax baselines
        qs = torch.randn(B, heads, T, dim, device=dev, dtype=bf, requires_grad=True)
        ks = torch.randn(B, heads, T, dim, device=dev, dtype=bf, requires_grad=True)
        vs = torch.randn(B, heads, T, dim, device=dev, dtype=bf, requires_grad=True)
        dos = torch.randn(B, heads, T, dim, device=dev, dtype=bf)
        for be, nm in ((SDPBackend.FLASH_ATTENTION, "sdpa-flash"), (SDPBackend.CUDNN_ATTENTION, "sdpa-cudnn")):
            def s():
                with sdpa_kernel(be):
                    return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

            try:
                with torch.no_grad():
                    ms = _bench(s, warmup, rep)
                _row(rows, bench="linear", impl=nm, T=T, B=B, passes="fwd", ms=ms)
                if T <= sdpa_bwd_max_len:
                    ms = _bench(_grad_fn(s, (qs, ks, vs), dos), warmup, rep)
                    _row(rows, bench="linear", impl=nm, T=T, B=B, passes="fwd+bwd", ms=ms)
            except Exception as e:  # pragma: no cover - backend availability
                _row(rows, bench="linear", impl=nm, T=T, B=B, passes="fwd", ms=float("nan"), note=str(e)[:120])
        del qs, ks, vs, dos
        block_done(f"sdpa T={T} done")

    if decode:
        _bench_decode(rows, heads, dim, window, decode_batch, copy_gbs, fla, warmup, rep, say)

    if out_json is not None:
        write_rows(out_json, meta, checks, rows, complete=True)
    return [dict(meta=meta)] + checks + rows


def write_rows(out_json, meta: dict, checks: list, rows: list, *, complete: bool) -> Path:
    """Write ``{"meta", "checks", "rows", "complete"}`` to ``out_json`` atomically (``complete`` false while the
    benchmark is still running: after each block of rows, so an interrupted run keeps what it measured)."""
    out_json = Path(out_json)
    with atomic_write(out_json) as tmp:
        tmp.write_text(json.dumps({"meta": meta, "checks": checks, "rows": rows, "complete": complete}, indent=1))
    return out_json


def _bench_decode(rows, heads, dim, window, decode_batch, copy_gbs, fla, warmup, rep, say):
    """Decode-step rows: ours vs fla fused_recurrent, GB/s of state read+write and % of copy."""
    dev = torch.device("cuda")
    bf = torch.bfloat16
    # decode steps, state rotated over 8 copies (more than L2), captured in a CUDA graph
    Bd, K, V = decode_batch, dim, dim
    nrot = 8
    states = [(torch.rand(Bd, heads, K, V, device=dev), torch.rand(Bd, heads, K, device=dev) + 1)
              for _ in range(nrot)]
    qd = torch.rand(Bd, heads, K, device=dev, dtype=bf)
    kd = torch.rand(Bd, heads, K, device=dev, dtype=bf)
    vd = torch.randn(Bd, heads, V, device=dev, dtype=bf)
    out = torch.empty(Bd, heads, V, device=dev, dtype=bf)
    state_bytes = 2 * (Bd * heads * K * V * 4 + Bd * heads * K * 4)

    def graphed(step_fn):
        for i in range(nrot):  # warm up / compile outside capture
            step_fn(i)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(nrot):
                step_fn(i)
        return lambda: g.replay()

    def add_decode(impl, step_fn, nbytes):
        try:
            _add_decode(impl, step_fn, nbytes)
        except Exception as e:  # pragma: no cover - device only
            say(f"ERROR decode {impl}: {type(e).__name__}: {str(e)[:300]}")

    def _add_decode(impl, step_fn, nbytes):
        try:
            ms = _bench(graphed(step_fn), warmup, rep) / nrot
            graph = True
        except Exception:  # pragma: no cover
            ms = _bench(lambda: [step_fn(i) for i in range(nrot)], warmup, rep) / nrot
            graph = False
        gbs = nbytes / ms / 1e6
        _row(rows, bench="decode", impl=impl, T=1, B=Bd, passes="step", ms=ms, gbs=gbs,
             pct_copy=100 * gbs / copy_gbs, graph=graph)

    add_decode("ours linear step", lambda i: linear_attention_step(qd, kd, vd, states[i], out=out), state_bytes)
    ldd = -0.1 * torch.rand(Bd, heads, device=dev)
    add_decode("ours gated linear step", lambda i: linear_attention_step(qd, kd, vd, states[i], out=out, log_decay=ldd),
               state_bytes)
    if fla is not None:
        rec = fla[1]
        q4, k4, v4 = qd.unsqueeze(1), kd.unsqueeze(1), vd.unsqueeze(1)
        add_decode("fla fused_recurrent", lambda i: rec(q4, k4, v4, scale=1.0, initial_state=states[i][0],
                                                        output_final_state=True), state_bytes)
    wstates = []
    for _ in range(nrot):
        st = empty_window_state(Bd, heads, dim, K, V, window, dtype=bf, device=dev)
        st.S.copy_(torch.rand_like(st.S))
        st.z.copy_(torch.rand_like(st.z) + 1)
        st.k_ring.normal_()
        st.fk_ring.uniform_()
        st.v_ring.normal_()
        st.seen.fill_(1000)
        wstates.append(st)
    wfd = torch.full((heads,), 0.3, device=dev)
    ring_bytes = Bd * heads * window * (dim + K + V) * 2
    add_decode(f"ours window step W={window}",
               lambda i: window_linear_attention_step(qd, kd, qd, kd, vd, wfd, wstates[i], out=out),
               state_bytes + ring_bytes)
    say("decode done")


def summarize(rows: List[dict]) -> List[dict]:
    """Ratios the issue's targets are stated in (per T): speed-ups = their ms / our ms."""
    by = {}
    for r in rows:
        if "bench" in r:
            by[(r["bench"], r["impl"], r["T"], r["passes"])] = r["ms"]
    out = []
    Ts = sorted({r["T"] for r in rows if r.get("bench") == "linear"})
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
    if "ours linear step" in dec and "fla fused_recurrent" in dec:
        con.print(f"decode: ours {dec['ours linear step']['ms'] * 1e3:.1f} us vs fla "
                  f"{dec['fla fused_recurrent']['ms'] * 1e3:.1f} us = "
                  f"{dec['fla fused_recurrent']['ms'] / dec['ours linear step']['ms']:.2f}x")


if __name__ == "__main__":  # python -m linearize.bench [out.json] [--tune]
    import sys

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--tune" in sys.argv:
        tuned = tune_kernels(progress=lambda s: print(s, flush=True))
        print("TUNED", json.dumps(tuned), flush=True)
    quick = "--quick" in sys.argv
    res = bench_kernels(Path(args[0]) if args else None, progress=lambda s: print(s, flush=True),
                        check="accuracy" if quick else "full", hedgehog_lengths=(32768,) if quick else None,
                        warmup=10 if quick else 25, rep=50 if quick else 100)
    print_table(res)

"""The gated delta rule's rows of ``linearize bench kernels --delta`` alone (their specs are
``linearize.bench.kernels.delta_row_specs``: ours vs fla's ``chunk_gated_delta_rule``, forward and forward +
backward, bf16, H = 32, K = V = 128, B*T = 32768; the decode step at batch 8 as a share of copy bandwidth vs
``fused_recurrent_gated_delta_rule``), plus what the command lacks: launch-configuration overrides and variants
timed in the same process, GQA, and fla's error (fla's rows checked against our chunked PyTorch path in fp32 as
ours are). Needs a GPU:

    LINEARIZE_KERNEL_TUNING=0 python kernels/bench_delta.py [OUT.json]

``LENGTHS=2K,8K,32K`` (the default), ``DECODE_BATCH=8``. ``CONFIG="walk_warps=8 bwd_bv=32"`` overrides
``triton_delta.CONFIG`` entries (ints; booleans as 0 / 1); ``VARIANTS="fwd_states_fp32=1;walk_bv=128"`` adds a row of
ours per ``;``-separated set of overrides (on top of the shipped, saved or ``CONFIG`` configuration), in the same
process. ``PHASES=1`` adds the forward's time per launch (UT transform, state walk, output) at 2K x 16 and
32K x 1, as the forward launches them, shipped and under each variant, and, per kernel (``torch.profiler``),
fla's forward and ours and fla's forward + backward at the same shapes. ``HK=8``
runs GQA (fla's rows then repeat the KV heads, as its kernel has no GQA). Ends with fla's time / ours per length
and variant.
"""
import dataclasses
import os
import sys
from pathlib import Path

import torch

from linearize.bench import kernels as bk
from linearize.kernels import triton_delta as TD
from linearize.kernels import tuning


#: (batch, length) of the phase lines: many short sequences, one long one
PHASE_SHAPES = ((16, 2048), (1, 32768))


def overrides(spec: str) -> dict:
    """``"key=val key=val"`` -> CONFIG entries of the shipped entries' types."""
    out = {}
    for item in spec.split():
        key, val = item.split("=")
        out[key] = bool(int(val)) if isinstance(TD.CONFIG[key], bool) else type(TD.CONFIG[key])(float(val))
    return out


def under(over: dict, fn):
    """``fn`` run with ``over`` applied to ``triton_delta.CONFIG`` (restored after each call)."""
    def run():
        base = dict(TD.CONFIG)
        TD.CONFIG.update(over)
        try:
            return fn()
        finally:
            TD.CONFIG.update(base)
    return run


def variant(spec: bk.RowSpec, label: str) -> bk.RowSpec:
    """``spec`` (ours) with every call (first call, timing, check) under the overrides ``label`` names."""
    over = overrides(label)

    def build(ctx, B, T):
        return {name: dataclasses.replace(t, fn=under(over, t.fn), warm=t.warm and under(over, t.warm),
                                          check=t.check and under(over, t.check))
                for name, t in spec.build(ctx, B, T).items()}

    return dataclasses.replace(spec, impl=f"ours {label}", what=f"{spec.what} {label}", build=build)


def phase_inputs(B: int, T: int):
    """``q, k, v, beta`` (bf16) and the log decays (fp32) of the phase lines: H = 32, K = V = 128."""
    from linearize.kernels.delta_testing import NAMES, delta_inputs
    inp = delta_inputs(B, T, 32, 32, 128, 128, dtype=torch.bfloat16, device="cuda", seed=1, state=False)
    q, k, v, beta, lg = (inp[n] for n in NAMES)
    return q, k, v, beta, lg.float()


def forward_phases(labels: list[str]) -> None:
    """Each forward launch timed alone (bf16, H = 32, K = V = 128), as the forward launches it under the shipped
    ``CONFIG`` and under each variant: where the forward's time goes."""
    from triton.testing import do_bench

    for B, T in PHASE_SHAPES:
        q, k, v, beta, lg = phase_inputs(B, T)
        for label in ["", *labels]:
            def phases():
                w, u = TD._fwd_prep(k, v, beta, lg)
                prep = do_bench(lambda: TD._fwd_prep(k, v, beta, lg))
                walk = do_bench(lambda: TD._fwd_walk(k, w, u, lg, None, False))
                whole = do_bench(lambda: TD._fwd(q, k, v, beta, lg, None, 128 ** -0.5, False))
                # the split prep's first launch alone (its transforms in the keys' dtype, as the forward passes them)
                ut = do_bench(lambda: TD._transforms(k, beta, lg, dtype=k.dtype)) if TD.CONFIG["prep_split"] else None
                return prep, ut, walk, whole
            prep, ut, walk, whole = under(overrides(label), phases)()
            split = f" (transforms {ut:.3f} ms, w and u {prep - ut:.3f} ms)" if ut is not None else ""
            print(f"forward at T={bk.format_length(T)} x {B} {label or '(shipped)'}: prep {prep:.3f} ms{split}, "
                  f"walk {walk:.3f} ms, output {whole - prep - walk:.3f} ms, whole {whole:.3f} ms", flush=True)


def kernel_times(call, calls: int = 10) -> tuple[dict, float]:
    """``call``'s CUDA kernels under ``torch.profiler``: name -> ms a call (first-launch order; a warm-up first),
    and their sum."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    order = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            order[ev.name] = order.get(ev.name, 0.0) + ev.time_range.elapsed_us() / calls / 1000
    return order, sum(order.values())


def kernel_phases() -> None:
    """Per kernel (``torch.profiler``'s CUDA times, mean over 10 calls) at the phase shapes: fla's forward, and
    ours and fla's forward + backward (one backward from a fixed output gradient): which launches ours lose to.
    fla's lines need fla (and, for its backward on Hopper, Triton >= 3.7.1)."""
    from linearize.kernels.delta import gated_delta_rule
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        chunk_gated_delta_rule = None
        print("fla is not installed: no fla phase lines")

    def show(what, call):
        try:
            order, total = kernel_times(call)
        except Exception as e:  # fla refuses its backward on some Triton versions: say so, go on
            print(f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            return
        cells = ", ".join(f"{name.split('(')[0][:40]} {ms:.3f}" for name, ms in order.items())
        print(f"{what}: {cells}; all kernels {total:.3f} ms", flush=True)

    for B, T in PHASE_SHAPES:
        q, k, v, beta, lg = (x.requires_grad_() for x in phase_inputs(B, T))
        do = torch.randn_like(v)
        scale = 128 ** -0.5

        impls = {"ours": lambda: gated_delta_rule(q, k, v, beta, lg, scale=scale, backend="triton")[0]}
        if chunk_gated_delta_rule is not None:
            impls["fla"] = lambda: chunk_gated_delta_rule(q, k, v, g=lg, beta=beta, scale=scale)[0]
        at = f"T={bk.format_length(T)} x {B}"
        if "fla" in impls:
            with torch.no_grad():
                show(f"fla forward at {at}", impls["fla"])
        for name, fwd in impls.items():
            show(f"{name} forward+backward at {at}", lambda fwd=fwd: fwd().backward(do))


def main() -> None:
    tuning.ensure_applied(torch.device("cuda"))  # a saved tuning first, so that CONFIG's overrides stay on top
    TD.CONFIG.update(overrides(os.environ.get("CONFIG", "")))
    hk = int(os.environ["HK"]) if os.environ.get("HK") else None
    ours, fla, step, fla_step = bk.delta_row_specs(hk, check_fla=True)
    labels = [v.strip() for v in os.environ.get("VARIANTS", "").split(";") if v.strip()]
    specs = [ours, *(variant(ours, label) for label in labels), fla, step, fla_step]
    res = bk.bench_kernels(Path(sys.argv[1]) if len(sys.argv) > 1 else None,
                           lengths=bk.parse_lengths(os.environ.get("LENGTHS", "2K,8K,32K")),
                           decode_batch=int(os.environ.get("DECODE_BATCH", 8)), groups=bk.row_groups(delta=True),
                           specs=specs, progress=lambda m: print(m, flush=True))
    bk.print_table(res)
    rows = [r for r in res if r.get("bench") == ours.bench]
    ms = {(r["impl"], r["T"], r["passes"]): r["ms"] for r in rows}
    print(f"\nfla / ours ({ours.bench}; > 1: ours faster)")
    for T in sorted({r["T"] for r in rows}):
        for impl in ["ours"] + [f"ours {label}" for label in labels]:
            cells = []
            for p in ("fwd", "fwd+bwd"):
                a, b = ms.get((impl, T, p)), ms.get(("fla", T, p))
                cells.append(f"{p} {a:.3f} ms" + (f" = {b / a:.2f}x" if a and b else "") if a else f"{p} -")
            print(f"  T={bk.format_length(T):<5} {impl:<32} " + ", ".join(cells))
    if os.environ.get("PHASES") == "1":
        forward_phases(labels)
        kernel_phases()


if __name__ == "__main__":
    main()

"""The window hybrid's decode step on the Llama-3-8B shape (B = 8, H = 32, Hk = 8, D = 128, Hedgehog f = 64 so
K = 128, V = 128, W = 64, bf16 rings, fp32 state), features computed in the kernel as GPU inference does: the
value columns of each (batch, KV head) in one program (``step_bv=128``, 64 programs) against the split over value
blocks (the default: ``step_waves`` programs per SM) and a few warp counts, one process, CUDA-graph replays
(``triton.testing.do_bench_cudagraph``), and the KV group's query heads spread over several programs
(``step_heads``), and the rings held whole or read a block of rows at a time (``step_ring_block``, for ``W``
over 32) or split over programs that each read their rows once for a whole KV group (``step_ring_split``, for
``W`` over 64, with the parts' products on 16-bit or fp32 operands and 8 or 4 warps; ``B=1 W=4096`` is the
batch-1 decode of a 4096-token window); outputs checked against the PyTorch
step. Then the plain linear step
(``linear_attention_step_hedgehog``, the same shape without rings) split over value blocks for a few
``linear_step_waves`` (with the features computed in the kernel its blocks are at most
``FUSED_LINEAR_STEP_MAX_BV`` = 64 wide, so one program per pair is no longer an option here), and with its query
heads spread over programs (``linear_step_heads``), with the features computed in the kernel and precomputed (as
an elu layer's). Each part starts with the defaults' row. Needs a GPU:

    python kernels/window_step_blocks.py

(``DEV=cpu TRITON_INTERPRET=1 B=1 H=2 HK=1 D=16 F=8 V=32 W=8``: a dry run of the script under the interpreter.)
``ROWS="default;ring split"`` keeps the window step's rows whose names start with one of the ``;``-separated
prefixes and skips the plain linear step (a wide ring compiles slowly: ``B=1 W=4096 ROWS="default;ring split"``).
"""
import os
import time

import torch
from triton.testing import do_bench_cudagraph

from linearize.kernels import empty_window_state, hedgehog_features, linear_attention_step, triton_common, triton_step
from linearize.kernels import linear_attention_step_hedgehog as linear_step
from linearize.kernels import window_linear_attention_step_hedgehog as step

B, H, HK, D, F, V, W = (int(os.environ.get(n, d)) for n, d in
                        (("B", 8), ("H", 32), ("HK", 8), ("D", 128), ("F", 64), ("V", 128), ("W", 64)))
dev, bf = torch.device(os.environ.get("DEV", "cuda")), torch.bfloat16
torch.manual_seed(0)
q, k = torch.randn(B, H, D, device=dev, dtype=bf), torch.randn(B, HK, D, device=dev, dtype=bf)
v = torch.randn(B, HK, V, device=dev, dtype=bf)
wf = torch.full((H,), 0.3, device=dev)
wq, wk = 0.1 * torch.randn(H, D, F, device=dev, dtype=bf), 0.1 * torch.randn(HK, D, F, device=dev, dtype=bf)
signed = triton_common.signed_projections(wq, wk, bf)


def fresh_state():
    """A state past the window (folds every step), random contents."""
    st = empty_window_state(B, HK, D, 2 * F, V, W, dtype=bf, device=dev)
    for x in st[:5]:
        x.copy_(torch.rand_like(x) if x.dtype == bf or x is st.z else 0.01 * torch.rand_like(x))
    st.seen.fill_(5 * W + 3)
    return st


def check(fn) -> float:
    """Relative error of one step against the PyTorch step from the same state."""
    a, b = fresh_state(), None
    b = type(a)(*(x.clone() for x in a))
    out = fn(a)
    ref = step(q, k, v, wf, wq, wk, b, backend="torch")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def time_us(fn) -> float:
    st = fresh_state()
    out = torch.empty(B, H, V, device=dev, dtype=bf)
    if dev.type != "cuda":
        t0 = time.perf_counter()
        fn(st, out)
        return 1e6 * (time.perf_counter() - t0)
    return 1e3 * do_bench_cudagraph(lambda: fn(st, out), rep=200)


def ours(st, out=None):
    return step(q, k, v, wf, wq, wk, st, out=out, backend="triton", signed=signed)


state_mb = B * HK * (2 * F * V * 4 * 2 + W * (D + 2 * F + V) * 2 + 2 * F * 4) / 1e6  # S r+w, rings, z
NO_SMALL_GRID = {"small_grid_heads_per_sm": 0}  # the heads a row asks for, at batch 1 too
WHOLE = {"step_heads": 0, **NO_SMALL_GRID}  # each program answers its whole KV group
rows = [("default", {}), ("one program per (batch, KV head)", {"step_bv": 128, **WHOLE})] + [
    (f"whole groups, value blocks {bv or 'auto'}, warps {w or 'auto'}", {"step_bv": bv, "step_warps": w, **WHOLE})
    for bv in (0, 64, 32, 16) for w in (0, 8, 4)] + [
    (f"value blocks {bv or 'auto'}, {n} query heads per program", {"step_heads": n, "step_bv": bv, **NO_SMALL_GRID})
    for n in (4, 2, 1) if n < H // HK for bv in (0, 64, 128)] + [
    (f"the whole ring, warps {w or 'auto'}", {"step_ring_block_from": 0, "step_warps": w}) for w in (0, 8)] + [
    (f"rings in blocks of {rb}, warps {w or 'auto'}", {"step_ring_block": rb, "step_ring_block_from": 2, "step_warps": w})
    for rb in (32, 64, 128) for w in (0, 8) if rb < W] + [
    (f"ring split in parts of {rs} rows", {"step_ring_split": rs, "step_ring_split_from": 2})
    for rs in (64, 128, 256, 512, 1024) if rs < W] + [
    (f"ring split in parts of {rs} rows, {name}", {"step_ring_split": rs, "step_ring_split_from": 2, **cfg})
    for rs in (128, 256) if rs < W
    for name, cfg in (("fp32 products", {"step_ring_part_16bit": 0}), ("4 warps", {"step_ring_part_warps": 4}))]
if os.environ.get("ROWS"):
    rows = [r for r in rows if r[0].startswith(tuple(os.environ["ROWS"].split(";")))]
base = dict(triton_step.CONFIG)


def main(extra=()):
    print(f"window step B={B} H={H} Hk={HK} D={D} K={2 * F} V={V} W={W}: ~{state_mb:.1f} MB of state and rings")
    for name, fn in extra:
        print(f"  {name:40s} {time_us(fn):7.2f} us  err {check(lambda s: fn(s, None)):.1e}", flush=True)
    for name, cfg in rows:
        triton_step.CONFIG.update(base, **cfg)
        gh, bv = triton_step.window_step_tiles(B * HK, H // HK, V, dev)
        us = time_us(ours)
        print(f"  {name:40s} {us:7.2f} us  ({gh} heads, BV {bv}; {state_mb / us * 1e3:6.0f} GB/s)  "
              f"err {check(ours):.1e}", flush=True)
    triton_step.CONFIG.update(base)
    if os.environ.get("ROWS"):
        return
    linear_mb = B * HK * (2 * F * V * 4 * 2 + 2 * F * 4 * 2) / 1e6
    print(f"linear step, same shape: ~{linear_mb:.1f} MB of state")
    for fuse in (True, False):
        print("  features in the kernel (Hedgehog)" if fuse else "  features precomputed (as elu's)")
        for name, cfg in linear_rows:
            triton_step.CONFIG.update(base, **cfg)
            gh, bv = triton_step.linear_step_tiles(B * HK, H // HK, V, dev, fuse=fuse)
            us = time_us(linear_ours if fuse else linear_unfused)
            err = check_linear(fuse)
            print(f"  {name:40s} {us:7.2f} us  ({gh} heads, BV {bv}; {linear_mb / us * 1e3:6.0f} GB/s)  "
                  f"err {err:.1e}", flush=True)
    triton_step.CONFIG.update(base)


def linear_ours(st, out=None):
    return linear_step(q, k, v, wq, wk, (st.S, st.z), out=out, backend="triton", signed=signed)


fq, fk = (hedgehog_features(x[:, None], w)[:, 0] for x, w in ((q, wq), (k, wk)))  # precomputed, as elu's are


def linear_unfused(st, out=None):
    return linear_attention_step(fq, fk, v, (st.S, st.z), out=out, backend="triton")


def check_linear(fuse=True) -> float:
    a = fresh_state()
    b = (a.S.clone(), a.z.clone())
    if fuse:
        out, ref = linear_ours(a), linear_step(q, k, v, wq, wk, b, backend="torch")
    else:
        out, ref = linear_unfused(a), linear_attention_step(fq, fk, v, b, backend="torch")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


linear_rows = [("default", {})] + [
    (f"whole groups, value blocks for {w} waves", {"linear_step_waves": w, "linear_step_heads": 0, **NO_SMALL_GRID})
    for w in (0.5, 1.0, 2.0)] + [
    (f"{n} query heads per program", {"linear_step_heads": n, **NO_SMALL_GRID}) for n in (4, 2, 1) if n < H // HK]


if __name__ == "__main__":
    main()

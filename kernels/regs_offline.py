"""Registers, spills and shared memory of the forward kernels as the H200 machine compiles them, without a GPU.

Compiles ``_la_fwd_kernel`` and ``_win_fwd_kernel`` (and the wide window kernels at W = 256 / 512, the window decode
step at W = 64 / 256 / 512) for sm_90a at the benchmark shape (bf16, K = V = D = 128,
BT = 64, the CONFIG's launch shape, pointers and T/H/HK 16-divisible, one segment) and runs the ``ptxas`` that
ships with the Triton wheel with ``-v``. With triton 3.6.0 (the GPU machine's) this reproduces what the device
reported on 2026-12-01 (linear: 228 registers unnormalised, 255 normalised; window: 255 with ~450 bytes spilled;
the same shared-memory sizes), so kernel changes can be checked for register pressure on CPU first:

    pip download --no-deps triton==3.6.0 -d /tmp/t36w && python -m zipfile -e /tmp/t36w/triton-3.6.0-*.whl /tmp/t36
    chmod +x /tmp/t36/triton/backends/nvidia/bin/*
    PYTHONPATH=/tmp/t36 python kernels/regs_offline.py
"""
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from linearize.kernels import triton_linear as TL
from linearize.kernels import triton_window as TW

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
DIV16 = {"T", "H", "HK", "SEG_CHUNKS"}  # as the device specialises them at the benchmark shapes


def compile_stats(fn, pointers: dict, ints: set, floats: set, consts: dict, warps: int, stages: int, *,
                  ptxas: str = PTXAS, div16: set = DIV16):
    """(registers, spill store bytes, spill load bytes, shared bytes) of ``fn`` compiled for sm_90a: ``div16``
    names the integer arguments the device specialises as multiples of 16, ``ptxas`` the assembler."""
    if "NSEG" in fn.arg_names:
        consts = dict(consts, NSEG=1)  # one segment: the device specialises an argument equal to 1
    sig = {}
    for name in fn.arg_names:
        sig[name] = ("constexpr" if name in consts else pointers.get(name) or
                     ("i32" if name in ints else "fp32" if name in floats else None))
        if sig[name] is None:
            raise KeyError(name)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n in div16}
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True)
    log = out.stderr + out.stdout
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None:
        raise RuntimeError(log[-800:])
    return int(regs.group(1)), int(spill.group(1)), int(spill.group(2)), kernel.metadata.shared


def linear(normalize: bool):
    cfg = TL.CONFIG
    f32 = {"DEN", "SEG_S", "SEG_Z", "FIN_S", "FIN_Z"}
    ptrs = {n: "*fp32" if n in f32 else "*bf16" for n in ("Q", "Kp", "Vp", "O", *f32, "WQX", "WKX")}
    consts = dict(K=128, V=128, BK=128, BV=cfg["fwd_bv"], BT=64, NORMALIZE=normalize, HAS_SEG=False,
                  STORE_FINAL=False, SHIFTED=False, STORE_DEN=False, NORM_MMA=TL.norm_mma(cfg, cfg["fwd_warps"]),
                  SPLIT=cfg["fwd_norm_split"], ROWSUM_LANES=cfg["fwd_rowsum_lanes"], PREC="tf32", D=128, BD=128, FUSE_Q=False, FUSE_K=False)
    return compile_stats(TL._la_fwd_kernel, ptrs, {"T", "H", "HK", "SEG_CHUNKS", "SHIFT"}, {"eps", "feps"}, consts,
                         cfg["fwd_warps"], cfg["fwd_stages"])


def window():
    cfg = TW.CONFIG
    f32 = {"WF", "MS", "DEN", "SEG_S", "SEG_Z"}
    ptrs = {n: "*fp32" if n in f32 else "*bf16" for n in ("Q", "Kr", "FQ", "FK", "Vp", "O", *f32, "WQX", "WKX")}
    ptrs["LG"] = "*fp32"
    consts = dict(D=128, K=128, V=128, BD=128, BK=128, BV=cfg["fwd_bv"], BT=64, HAS_LIN_CUR=False, HAS_SEG=False,
                  STORE_STATS=False, PREC="tf32", FUSE_Q=False, FUSE_K=False, GATED=False)
    return compile_stats(TW._win_fwd_kernel, ptrs, {"T", "H", "HK", "SEG_CHUNKS", "W"}, {"scale", "eps", "feps"},
                         consts, cfg["fwd_warps"], cfg["fwd_stages"])


def _wide_pointers(names, f32):
    return {n: ("*fp32" if n in f32 else "*i8" if n == "KEEP" else "*bf16") for n in names}


def wide_window(W: int):
    """The wide window kernels at window ``W`` (64-token key blocks): the forward's window kernel, the query-side
    and the key-side backward, as ``_fwd_two_pass`` and ``_bwd`` launch them at K = V = D = 128, bf16."""
    cfg, NB = TW.CONFIG, -(-W // 64)
    fwd = compile_stats(
        TW._win_softmax_wide_kernel,
        _wide_pointers(("Q", "Kr", "Vp", "WF", "OL", "DL", "O", "MS", "DEN", "KEEP"), {"WF", "DL", "MS", "DEN"}),
        {"T", "H", "HK"}, {"scale", "eps"},
        dict(W=W, NB=NB, D=128, V=128, BD=128, BV=128, BT=64, STORE_STATS=True, PREC="tf32", HAS_KEEP=False),
        cfg["softmax_warps"], 1)
    f32 = {"WF", "MS", "INVD", "DDEN", "ST_S", "ST_Z", "DW", "RS", "RZ", "LG", "DBQ", "DBK"}
    bq = compile_stats(
        TW._win_bwd_q_wide_kernel,
        _wide_pointers(("Q", "Kr", "FQ", "FK", "Vp", "WF", "DO", "MS", "INVD", "DDEN", "ST_S", "ST_Z", "DQ", "DFQ",
                        "DW"), f32),
        {"T", "H", "HK"}, {"scale"},
        dict(W=W, NB=NB, D=128, K=128, V=128, BD=128, BK=128, BV=64, BT=64, NV_BLK=2, PREC="tf32"),
        cfg["wide_bwd_warps"], 1)
    bkv = compile_stats(
        TW._win_bwd_kv_kernel,
        _wide_pointers(("Q", "Kr", "FQ", "FK", "Vp", "WF", "DO", "MS", "INVD", "DDEN", "RS", "RZ", "DK", "DFK", "DV",
                        "LG", "DBK"), f32),
        {"T", "H", "HK", "W"}, {"scale"},
        dict(D=128, K=128, V=128, BD=128, BK=128, BV=64, BT=64, NV_BLK=2, G=4, PREC="tf32", GATED=False, NB=NB),
        cfg["wide_bwd_warps"], 1)
    return fwd, bq, bkv


def window_step(W: int, RB: int | None = None, warps: int | None = None):
    """The window decode step at window ``W`` (the ring tile is pow2(W) rows), the Llama-3-8B shape (G = 4), bf16,
    with the launch shape ``window_step_triton`` picks for 8 x 8 KV heads; ``RB`` rows of the rings at a time
    (None: as ``step_ring_block`` says for that ring, 0: the whole ring), ``warps`` (None: the launch's)."""
    import torch

    from linearize.kernels import triton_step as TS
    GH, BV = TS.window_step_tiles(64, 4, 128, torch.device("cpu"))
    BW = 1 << (W - 1).bit_length()
    RB = TS.ring_block(BW) if RB is None else RB
    warps = warps or TS.window_step_warps(128, 128, BV, RB or BW, False)
    ptrs = {n: "*bf16" for n in ("Q", "FQ", "Kr", "Vp", "KR", "FKR", "VR", "O", "WQX", "SK", "SV")}
    ptrs.update(WF="*fp32", S="*fp32", Z="*fp32", SEEN="*i64", KEEP="*i8", SPOS="*i64", SVALID="*i8")
    consts = dict(D=128, K=128, V=128, BD=128, BK=128, BV=BV, BW=BW, G=4, FUSE=False, GH=GH, OWN=True, SINKS=False,
                  BN=1, RB=RB)
    return compile_stats(TS._window_step_kernel, ptrs, {"H", "HK", "W", "NS"}, {"scale", "eps", "feps"}, consts,
                         warps, 1), warps


if __name__ == "__main__":
    print(f"triton {triton.__version__}; registers, spill stores / loads (bytes), shared memory (bytes)")
    rows = [("linear fwd, unnormalised", linear(False)), ("linear fwd, normalised", linear(True)),
            ("window fwd (W=64)", window())]
    for W in (256, 512):
        fwd, bq, bkv = wide_window(W)
        rows += [(f"wide window fwd (W={W})", fwd), (f"wide window bwd q (W={W})", bq),
                 (f"wide window bwd kv (W={W})", bkv)]
    for W in (64, 256, 512):
        stats, warps = window_step(W)
        rows.append((f"window step (W={W}, {warps} warps)", stats))
    for RB, warps in ((0, None), (64, 8), (32, None), (128, 8)):  # the 512-row ring whole or walked in blocks
        stats, w = window_step(512, RB, warps)
        rows.append((f"window step (W=512, RB={RB}, {w} warps)", stats))
    for name, stats in rows:
        print(f"{name:32s} {stats[0]:4d} regs  spills {stats[1]:5d} / {stats[2]:5d}  shared {stats[3]:7d}")

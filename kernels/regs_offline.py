"""Registers, spills and shared memory of the forward kernels as the H200 machine compiles them, without a GPU.

Compiles ``_la_fwd_kernel`` and ``_win_fwd_kernel`` for sm_90a at the benchmark shape (bf16, K = V = D = 128,
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
    consts = dict(D=128, K=128, V=128, BD=128, BK=128, BV=cfg["fwd_bv"], BT=64, HAS_LIN_CUR=False, HAS_SEG=False,
                  STORE_STATS=False, PREC="tf32", FUSE_Q=False, FUSE_K=False)
    return compile_stats(TW._win_fwd_kernel, ptrs, {"T", "H", "HK", "SEG_CHUNKS", "W"}, {"scale", "eps", "feps"},
                         consts, cfg["fwd_warps"], cfg["fwd_stages"])


if __name__ == "__main__":
    print(f"triton {triton.__version__}; registers, spill stores / loads (bytes), shared memory (bytes)")
    for name, stats in (("linear fwd, unnormalised", linear(False)), ("linear fwd, normalised", linear(True)),
                        ("window fwd (W=64)", window())):
        print(f"{name:26s} {stats[0]:4d} regs  spills {stats[1]:5d} / {stats[2]:5d}  shared {stats[3]:7d}")

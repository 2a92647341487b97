"""(CPU) Registers, spills and shared memory of the gated-delta-rule kernels compiled for sm_90a, without a GPU.

Compiles every kernel of ``triton_delta.py`` and ``triton_delta_step.py`` at the benchmark shape (bf16,
K = V = 128, 64-token chunks, no GQA; the step with groups of 4; the forward's prep, walk and output kernels as the
forward launches them) with the launch configuration of ``CONFIG``, and runs ``ptxas -v`` on the PTX, as
``kernels/regs_offline.py`` does for the linear and window forwards. Triton 3.9 emits PTX 9.x, which its bundled
``ptxas`` (CUDA 12.9) refuses; ``ptxas-blackwell`` (CUDA 13) takes it:

    python kernels/regs_delta_offline.py                      # the shipped CONFIG
    python kernels/regs_delta_offline.py walk_warps=4 bwd_bv=64   # overrides (ints)
    KV=256 python kernels/regs_delta_offline.py                  # K = V = 256
    PTXAS=/path/to/ptxas python kernels/regs_delta_offline.py

The device's own Triton (3.6 on the H200 machine) may allocate differently; this is for comparing variants.
"""
import os
import sys

import triton

import regs_offline
from linearize.kernels import triton_delta as TD
from linearize.kernels import triton_delta_step as TS

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTXAS = os.environ.get("PTXAS") or next(p for p in (os.path.join(BIN, "ptxas-blackwell"), os.path.join(BIN, "ptxas"))
                                         if os.path.exists(p))
DIV16 = {"T", "H", "HK"}  # as the device specialises them at the benchmark shapes


def compile_stats(fn, pointers: dict, ints: set, floats: set, consts: dict, warps: int, stages: int):
    """(registers, spill store bytes, spill load bytes, shared bytes) of ``fn`` compiled for sm_90a."""
    return regs_offline.compile_stats(fn, pointers, ints, floats, consts, warps, stages, ptxas=PTXAS, div16=DIV16)


def kernels(cfg: dict):
    """(name, kernel, pointer types, int args, float args, constexprs, warps, stages) at the benchmark shape."""
    bf, f32 = "*bf16", "*fp32"
    K = V = int(os.environ.get("KV", 128))
    BT = cfg["bt"]
    base = dict(K=K, V=V, BK=K, BT=BT, PREC="tf32")
    wbv = cfg["walk_bv"]
    wwarps = cfg["walk_warps"] if K * wbv >= 128 * 64 else cfg["walk_warps_narrow"]
    wu = bf if cfg["fwd_inter_16bit"] else f32  # the forward's w, u, U
    bs = bf if cfg["bwd_states_16bit"] else f32  # the backward's chunk states and state gradients
    bi = bf if cfg["bwd_inter_16bit"] else f32  # the backward's w, U and dU
    diag = 2 if cfg["prep_diag_doubling"] else int(bool(cfg["prep_diag_rows"]))  # bf16 keys: _inverse_settings
    return [
        ("prep", TD._prep_kernel, dict(Kp=bf, Vp=bf, BETA=bf, LG=f32, W=wu, U=wu, TM=f32), {"T", "HK"}, set(),
         dict(base, BV=64, NV_BLK=V // 64, STORE_T=False, DIAG=diag,
              LOW16=bool(cfg["prep_16bit"]), BLOCKS=bool(cfg["prep_blocks"])), cfg["prep_warps"], 1),
        # prep_split's two launches (the forward's: the transforms passed on in bf16 under prep_16bit)
        ("ut", TD._ut_kernel, dict(Kp=bf, BETA=bf, LG=f32, TM=bf if cfg["prep_16bit"] else f32), {"T", "HK"}, set(),
         dict(K=K, BK=K, BT=BT, PREC="tf32", DIAG=diag, BLOCKS=bool(cfg["prep_blocks"])),
         cfg["ut_warps"], 1),
        ("wu", TD._wu_kernel, dict(Kp=bf, Vp=bf, BETA=bf, LG=f32, TM=bf if cfg["prep_16bit"] else f32, W=wu, U=wu),
         {"T", "HK"}, set(), dict(base, BV=64, LOW16=bool(cfg["prep_16bit"])), cfg["wu_warps"], 1),
        ("walk", TD._walk_kernel, dict(Kp=bf, W=wu, U=wu, LG=f32, INIT=f32, HS=bf, FIN=f32), {"T", "HK"}, set(),
         dict(base, BV=wbv, HAS_INIT=True, STORE_FINAL=True, LOW16=bool(cfg["walk_16bit"])), wwarps,
         cfg["walk_stages"]),
        ("out", TD._out_kernel, dict(Q=bf, Kp=bf, U=wu, HS=bf, LG=f32, O=bf), {"T", "H", "HK"}, {"scale"},
         dict(base, BV=cfg["out_bv"], S32=cfg["fwd_states_fp32"], LOW16=bool(cfg["out_16bit"])), cfg["out_warps"], 2),
        # the backward: its prep (transforms stored, fp32 products) and walk (fp32 products) recomputed, then its own
        ("prep bwd", TD._prep_kernel, dict(Kp=bf, Vp=bf, BETA=bf, LG=f32, W=bi, U=bi, TM=f32), {"T", "HK"}, set(),
         dict(base, BV=64, NV_BLK=V // 64, STORE_T=True, DIAG=diag, LOW16=False, BLOCKS=bool(cfg["prep_blocks"])),
         cfg["prep_warps"], 1),
        ("walk bwd", TD._walk_kernel, dict(Kp=bf, W=bi, U=bi, LG=f32, INIT=f32, HS=bs, FIN=f32), {"T", "HK"}, set(),
         dict(base, BV=wbv, HAS_INIT=True, STORE_FINAL=False, LOW16=False), wwarps, cfg["walk_stages"]),
        ("dvl", TD._dvl_kernel, dict(Q=bf, Kp=bf, DO=bf, LG=f32, DVL=bi), {"T", "H", "HK"}, {"scale"},
         dict(base, BV=cfg["out_bv"], G=1), cfg["out_warps"], 2),
        ("bwd walk", TD._bwd_walk_kernel, dict(Q=bf, Kp=bf, W=bi, DO=bf, LG=f32, DU=bi, DSF=f32, DH=bs, DS0=f32),
         {"T", "H", "HK"}, {"scale"}, dict(base, BV=wbv, G=1, HAS_DSF=True, STORE_DS0=True), wwarps,
         cfg["walk_stages"]),
        ("dqk", TD._dqk_kernel, dict(Q=bf, Kp=bf, DO=bf, HS=bs, U=bi, LG=f32, DQ=bf, DKA=f32, DGA=f32),
         {"T", "H", "HK"}, {"scale"}, dict(base, BV=cfg["bwd_bv"], G=1, NV_BLK=V // cfg["bwd_bv"]),
         cfg["bwd_warps"], 1),
        ("wy", TD._wy_kernel, dict(Kp=bf, Vp=bf, BETA=bf, LG=f32, TM=f32, HS=bs, DH=bs, U=bi, DU=bi, DKA=f32,
                                   DGA=f32, DK=bf, DV=bf, DBETA=bf, DLG=f32),
         {"T", "HK"}, set(), dict(base, BV=cfg["bwd_bv"], NV_BLK=V // cfg["bwd_bv"]), cfg["bwd_warps"], 1),
        ("step", TS._delta_step_kernel, dict(Q=bf, Kp=bf, Vp=bf, BETA=bf, LD=f32, S=f32, O=bf), {"H", "HK"},
         {"scale"}, dict(K=K, V=V, BK=K, BV=64, G=4, DECAY=True), TS.CONFIG["step_warps"], 1),
    ]


if __name__ == "__main__":
    cfg = dict(TD.CONFIG, **{k: int(v) for k, v in (a.split("=") for a in sys.argv[1:])})
    print(f"triton {triton.__version__}, {os.path.basename(PTXAS)}; {cfg}")
    print("registers, spill stores / loads (bytes), shared memory (bytes)")
    for name, fn, ptrs, ints, floats, consts, warps, stages in kernels(cfg):
        regs, st, ld, smem = compile_stats(fn, ptrs, ints, floats, consts, warps, stages)
        print(f"  {name:9s} {warps:2d} warps, {stages} stages: {regs:3d} registers, spills {st} / {ld}, "
              f"shared {smem:,}", flush=True)

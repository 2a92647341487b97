"""Forward chunk size (``fwd_bt`` / ``fused_bt``) for the plain forward and the forwards that compute the Hedgehog
features in the kernel, in one process: the plain linear forward on precomputed features (64- vs 32-token
chunks, several value blocks and warps); features first (``hedgehog_feature_map`` for q and k, then the forward:
prefill's default) against the fused forwards (``linear_attention_hedgehog``, and
``window_linear_attention_hedgehog`` whose two-pass forward runs the fused linear forward shifted by W = 64) at
64-, 32- and 16-token chunks. bf16, H = Hk = 32, D = 128, f = 64 (K = 2f = 128), V = 128, B * T = 32768 (2K x 16,
8K x 4, 32K x 1: segmented); relative errors against an fp32 PyTorch forward on the same features. Needs a GPU:

    LINEARIZE_KERNEL_TUNING=0 python kernels/forward_chunk_sizes.py
"""
import os

import torch
from triton.testing import do_bench

from linearize.kernels import (hedgehog_feature_map, linear_attention, linear_attention_hedgehog,
                               window_linear_attention, window_linear_attention_hedgehog)
from linearize.kernels import triton_linear as TL

torch.manual_seed(0)
dev, bf, H, D, f = "cuda", torch.bfloat16, 32, 128, 64
base = dict(TL.CONFIG)
SHAPES = [tuple(map(int, s.split("x"))) for s in os.environ.get("SHAPES", "16x2048,4x8192,1x32768").split(",")]
BLOCKS = [(128, 8, 3), (128, 8, 2), (64, 8, 2), (64, 4, 2)]  # value block, warps, stages
FUSED = [(bt, bv, w, st) for bt in (64, 32, 16) for bv, w, st in ((128, 8, 1), (128, 8, 2), (64, 8, 2), (64, 4, 2))
         if not (bt == 64 and st > 1)]  # 64-token fused chunks need > 227 KB of shared memory with 2 stages


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def ms(fn):
    return do_bench(fn, warmup=25, rep=150)


for B, T in SHAPES:
    q, k, v = (torch.randn(B, T, H, D, device=dev, dtype=bf) for _ in range(3))
    wq, wk = (0.1 * torch.randn(H, D, f, device=dev, dtype=bf) for _ in range(2))
    wf = torch.full((H,), 0.3, device=dev)
    with torch.no_grad():
        fq, fk = hedgehog_feature_map(q, wq), hedgehog_feature_map(k, wk)
        ref = linear_attention(fq.float(), fk.float(), v.float(), backend="torch")[0]
        wref = window_linear_attention(q.float(), k.float(), fq.float(), fk.float(), v.float(), wf, window=64,
                                       backend="torch")[0]
        print(f"== {B} x {T}", flush=True)
        plain = {}
        for bt in (64, 32):
            for bv, w, st in BLOCKS:
                TL.CONFIG.update(base, fwd_bt=bt, fwd_bv=bv, fwd_warps=w, fwd_stages=st)
                fn = lambda: linear_attention(fq, fk, v)[0]  # noqa: E731
                t = ms(fn)
                plain[(bt, bv, w, st)] = t
                t_num = ms(lambda: linear_attention(fq, fk, v, normalize=False)[0])
                print(f"  plain fwd  bt {bt:3d} bv {bv:3d} warps {w} stages {st}: {t:.3f} ms (unnormalised "
                      f"{t_num:.3f}), err {rel(fn(), ref):.1e}", flush=True)
        TL.CONFIG.update(base)
        t_maps = ms(lambda: (hedgehog_feature_map(q, wq), hedgehog_feature_map(k, wk)))
        t_first = ms(lambda: linear_attention(hedgehog_feature_map(q, wq), hedgehog_feature_map(k, wk), v)[0])
        t_wfirst = ms(lambda: window_linear_attention(q, k, hedgehog_feature_map(q, wq), hedgehog_feature_map(k, wk),
                                                      v, wf, window=64)[0])
        t_wplain = ms(lambda: window_linear_attention(q, k, fq, fk, v, wf, window=64)[0])
        print(f"  feature maps (q and k) {t_maps:.3f} ms; features first: linear {t_first:.3f} ms, window "
              f"{t_wfirst:.3f} ms (window on given features {t_wplain:.3f} ms)", flush=True)
        for bt, bv, w, st in FUSED:
            TL.CONFIG.update(base, fused_bt=bt, fused_bv=bv, fused_warps=w, fused_stages=st)
            fl = lambda: linear_attention_hedgehog(q, k, v, wq, wk)[0]  # noqa: E731
            fw = lambda: window_linear_attention_hedgehog(q, k, v, wf, wq, wk, window=64)[0]  # noqa: E731
            tl_, tw = ms(fl), ms(fw)
            print(f"  fused bt {bt:3d} bv {bv:3d} warps {w} stages {st}: linear {tl_:.3f} ms "
                  f"({t_first / tl_:.2f}x features first), err {rel(fl(), ref):.1e}; window {tw:.3f} ms "
                  f"({t_wfirst / tw:.2f}x), err {rel(fw(), wref):.1e}", flush=True)
        TL.CONFIG.update(base)
    del q, k, v, fq, fk, ref, wref

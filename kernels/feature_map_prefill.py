"""Hedgehog features for prefill: the PyTorch map (``HedgehogFeatureMap``) vs the standalone Triton kernel
(``linearize.kernels.hedgehog_feature_map``), on the Llama-3-8B shape's queries [B, T, 32, 128] and keys
[B, T, 8, 128] (f = 64, bf16), then a whole hybrid prefill (3:1 lolcats, random weights, ``bench model``'s own
prefill) with the kernel option ``fused_feature_maps="decode"`` (PyTorch maps for prefill) vs ``"maps"`` (the
kernel), both in one process. Needs a GPU:

    T=32768 B=8 python kernels/feature_map_prefill.py
"""
import os
import time

import torch
from triton.testing import do_bench

from linearize.bench import model as bm
from linearize import recipe as recipes
from linearize.model.feature_maps import HedgehogFeatureMap
from linearize.kernels import hedgehog_feature_map
from linearize.convert.selection import select_layout

dev = torch.device(os.environ.get("DEV", "cuda"))  # DEV=cpu: a dry run of the script (PyTorch maps only)


def bench(fn):
    if dev.type == "cuda":
        return do_bench(fn, warmup=25, rep=100)
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


T, B = int(os.environ.get("T", 32768)), int(os.environ.get("B", 8))
with torch.no_grad():
    for heads in (32, 8):
        fmap = HedgehogFeatureMap(heads, 128).to(dev, torch.bfloat16)
        x = torch.randn(B, T, heads, 128, device=dev, dtype=torch.bfloat16)
        ref = fmap(x)
        out = hedgehog_feature_map(x, fmap.weight, eps=fmap.eps)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        t_torch = bench(lambda: fmap(x))
        t_kernel = bench(lambda: hedgehog_feature_map(x, fmap.weight, eps=fmap.eps))
        gb = x.numel() * 2 * 2 / 1e9  # bytes the kernel must move: x in, features (2f = D) out
        print(f"heads {heads}: PyTorch map {t_torch:.3f} ms, kernel {t_kernel:.3f} ms ({t_torch / t_kernel:.2f}x; "
              f"kernel at {gb / t_kernel * 1e3:.0f} GB/s), rel err {err:.1e}", flush=True)
        del x, ref, out

    cfg, _ = bm.load_config(os.environ.get("CFG", "llama-3-8b"))
    model = bm.random_model(cfg, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, device=dev)
    model = bm._surgery(model, select_layout(cfg.num_hidden_layers, ratio="3:1"), recipes.load("lolcats")["attention"])
    ids = torch.randint(0, cfg.vocab_size, (B, T), device=dev)
    for rep in range(2):
        for mode in ("decode", "maps"):
            model.set_kernel_options(fused_feature_maps=mode)
            sync()
            t0 = time.perf_counter()
            cache = bm.prefill(model, ids)
            sync()
            s = time.perf_counter() - t0
            del cache
            print(f"rep {rep} {mode}: prefill {B} x {T} in {s:.3f} s = {B * T / s:,.0f} tokens/s", flush=True)

"""A hybrid decode step with the Hedgehog features computed in the step kernels (``FUSED_FEATURE_MAPS =
"decode"``, the default) vs computed first (``"none"``): Llama-3-8B shape (``CFG``), 3:1 lolcats layers, random
weights, bf16, one prefill of ``B`` x ``T`` tokens, then CUDA-graph decode steps timed by ``bench model``'s own
``_time_steps``, alternating the two settings twice over the same cache. Needs a GPU (~60 GB at 32K x 8):

    T=32768 B=8 python benchmarks/fused_decode_steps.py
"""
import os

import torch

from linearize import attention
from linearize import benchmodel as bm
from linearize import recipe as recipes
from linearize.select import select_layout

dev = torch.device(os.environ.get("DEV", "cuda"))
cfg, _ = bm.load_config(os.environ.get("CFG", "llama-3-8b"))
model = bm.random_model(cfg, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, device=dev)
model = bm._surgery(model, select_layout(cfg.num_hidden_layers, ratio="3:1"), recipes.load("lolcats")["attention"])
T, B = int(os.environ.get("T", 32768)), int(os.environ.get("B", 8))
ids = torch.randint(0, cfg.vocab_size, (B, T), device=dev)
with torch.no_grad():
    dcache = bm.decode_cache(bm.prefill(model, ids), T)
    kw = dict(input_ids=ids[:, -1:], position_ids=torch.full((B, 1), T - 1, device=dev), use_cache=True,
              logits_to_keep=1, **bm._cache_kwargs(model, dcache))

    def step():
        return model(**kw).logits

    for rep in range(2):
        for mode in ("none", "decode"):
            attention.FUSED_FEATURE_MAPS = mode
            with bm._maskless_sdpa(model):
                s, how, note, _ = bm._time_steps(step, 32, dev, bm.Timing())
            print(f"rep {rep} fused={mode}: {1e3 * s:.3f} ms/step = {B / s:.0f} tokens/s ({how}; {note})", flush=True)

"""A hybrid decode step under settings of the layers that change no result beyond rounding, alternated twice over
the same cache: ``VARIANT=features`` (the default) the Hedgehog features computed in the step kernels
(kernel option ``fused_feature_maps="decode"``) vs computed first (``"none"``); ``VARIANT=rotary`` the one-kernel
Triton rotary embedding (``rotary_backend=None``) vs PyTorch's (``"torch"``); ``VARIANT=norms`` every RMS norm
of the model on one Triton kernel (``norm_backend=None``) vs the family's modules (``"torch"``, the default). Llama-3-8B shape (``CFG``), 3:1
lolcats layers, random weights, bf16, one prefill of ``B`` x ``T`` tokens, then CUDA-graph decode steps timed by
``bench model``'s own ``_time_steps``. Needs a GPU (~60 GB at 32K x 8):

    T=32768 B=8 VARIANT=rotary python kernels/fused_decode_steps.py
"""
import os

import torch

from linearize.bench import model as bm
from linearize import recipe as recipes
from linearize.convert.selection import select_layout

VARIANTS = {  # name -> (kernel option of the hybrid, [(label, value), ...]); the last value is the default
    "features": ("fused_feature_maps", [("features first", "none"), ("features in the step", "decode")]),
    "rotary": ("rotary_backend", [("PyTorch rotary", "torch"), ("Triton rotary", None)]),
    "norms": ("norm_backend", [("Triton norms", None), ("the family's norms", "torch")]),
}
option, settings = VARIANTS[os.environ.get("VARIANT", "features")]
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
        for label, value in settings:
            model.set_kernel_options(**{option: value})
            with bm._maskless_sdpa(model):
                s, how, note, _ = bm._time_steps(step, 32, dev, bm.Timing())
            print(f"rep {rep} {label}: {1e3 * s:.3f} ms/step = {B / s:.0f} tokens/s ({how}; {note})", flush=True)

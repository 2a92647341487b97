"""Where a prefill's memory goes, decoder layer by decoder layer (GPU): memory allocated at each layer's entry,
the running peak, what stays allocated after the prefill against the cache's own tensors, for the original and
its 3:1 hybrid (random weights, surgery only). A hybrid whose allocation grows from one linear layer to the
next is keeping tensors alive (2026-12-02: Triton's ``OutOfResources`` reference cycle held ~0.5 GiB per linear
layer of the Gemma-3-1B shape until the garbage collector ran).

    LINEARIZE_KERNEL_TUNING=0 python kernels/prefill_memory_by_layer.py gemma-3-1b --length 32768
"""
import argparse

import torch

from linearize.bench import model as bm
from linearize import recipe as R
from linearize.convert.selection import select_layout

ap = argparse.ArgumentParser()
ap.add_argument("spec", help="a model config shipped in linearize/model_configs (random weights)")
ap.add_argument("--length", type=int, default=32768)
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--ratio", default="3:1")
ap.add_argument("--recipe", default="lolcats")
ap.add_argument("--sdpa", default="cudnn", help="SDPA backend of the softmax layers (flash, cudnn, ...)")
args = ap.parse_args()

dev, G = torch.device("cuda"), 2**30
cfg, _ = bm.load_config(args.spec)
model = bm.random_model(cfg, dtype=torch.bfloat16, device=dev)
entries = []
for i, layer in enumerate(model.model.layers):
    layer.register_forward_pre_hook(lambda m, *a, i=i: entries.append(
        (i, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())))


def measure(m, kind: str) -> None:
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.length), device=dev)
    with bm._sdpa(args.sdpa):
        bm.prefill(m, ids)  # compile and warm up
        bm._free(dev)
        entries.clear()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        cache = bm.prefill(m, ids)
        torch.cuda.synchronize()
    peak, held = torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated() - before
    print(f"{kind}: prefill {args.length} x {args.batch} peaks {peak / G:.2f} GiB above what was allocated before; "
          f"{held / G:.3f} GiB stays allocated (the cache's tensors: {bm.cache_nbytes(cache) / G:.3f} GiB)")
    print("  allocated at each layer's entry (GiB): " + " ".join(f"{i}:{(a - before) / G:.2f}" for i, a, _ in entries))
    print("  running peak at each layer's entry:    " + " ".join(f"{i}:{(p - before) / G:.2f}" for i, _, p in entries))
    del cache
    bm._free(dev)


measure(model, "original")
hybrid = bm._surgery(model, select_layout(cfg.num_hidden_layers, ratio=args.ratio), R.load(args.recipe)["attention"])
measure(hybrid, f"hybrid {args.ratio} {args.recipe}")

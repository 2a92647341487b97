"""The decode consistency check on any model: logits of a prefill of ``P`` tokens followed by ``D`` single-token decode
steps against one full forward over the same ``P + D`` tokens (held-out wiki text of the embedded corpus), as max
abs difference, beside the largest logit. A checkpoint directory is checked as it is; a spec with ``--ratio`` /
``--recipe`` is converted first (surgery only, untrained). ``--backend torch`` runs the linear layers on the
chunked PyTorch path even on a GPU (where the default is Triton); TF32 is off so fp32 means fp32.

    python kernels/decode_consistency.py smollm2-135m --ratio 3:1 --recipe elu
    python kernels/decode_consistency.py OUT --device cuda --backend torch
"""
import argparse

import torch

from linearize import kernels
from linearize import recipe as R
from linearize.bench.model import _cache_kwargs
from linearize.data.specs import iter_texts
from linearize.convert.selection import select_layout
from linearize.io.sources import load_model
from linearize.convert.surgery import linearize_model

ap = argparse.ArgumentParser()
ap.add_argument("spec")
ap.add_argument("--ratio", help="convert first (surgery only) with this layout")
ap.add_argument("--recipe", default="lolcats")
ap.add_argument("--prefill", type=int, default=100)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--dtype", default="float32")
ap.add_argument("--device", default="cpu")
ap.add_argument("--backend", choices=("default", "torch"), default="default")
args = ap.parse_args()

torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
if args.backend == "torch":  # every kernel call without an explicit backend takes the chunked PyTorch path
    resolve = kernels._resolve_backend
    kernels._resolve_backend = lambda backend, x: resolve("torch" if backend is None else backend, x)

model, tok = load_model(args.spec, dtype=args.dtype, device=args.device)
if args.ratio:
    model = linearize_model(model, select_layout(model.config.num_hidden_layers, ratio=args.ratio),
                            R.load(args.recipe))
n = args.prefill + args.steps
text = " ".join(t for _, t in zip(range(20), iter_texts("wiki", "heldout")))
ids = tok(text, return_tensors="pt").input_ids[:, :n].to(args.device)
with torch.no_grad():
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :args.prefill], use_cache=True)
    cache, logits = getattr(out, "cache", None) or out.past_key_values, [out.logits]
    for t in range(args.prefill, n):  # the cache advances in place
        logits.append(model(ids[:, t:t + 1], use_cache=True, **_cache_kwargs(model, cache)).logits)
got = torch.cat(logits, 1).double()
diff = (got - full.double()).abs()
print(f"{args.spec} {args.ratio or ''} {args.recipe if args.ratio else ''} {args.dtype} {args.device} "
      f"backend={args.backend}: prefill {args.prefill} + {args.steps} steps vs full forward: max abs diff "
      f"{diff.max().item():.3g} (prefilled positions {diff[:, :args.prefill].max().item():.3g}, steps "
      f"{diff[:, args.prefill:].max().item():.3g}); largest logit {full.abs().max().item():.3g}")

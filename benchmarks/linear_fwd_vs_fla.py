"""Our linear forward (normalised and not) against fla's ``chunk_linear_attn`` (normalize True / False), forward
only, at the four benchmark shapes (``LENGTHS=32768,131072`` picks some) (bf16, H=32, K=V=128, B*T = 32768), all in one process with the shipped
launch configuration; median of ``do_bench`` (warmup 25 ms, rep 150 ms). The forward rows of
``linearize bench kernels`` without its other rows and checks. Needs a GPU and fla-core 0.6.0:

    LINEARIZE_KERNEL_TUNING=0 FLA_DISABLE_BACKEND_DISPATCH=1 python benchmarks/linear_fwd_vs_fla.py

``CONFIG="fwd_rowsum_lanes=1 seg_warps=8"`` overrides ``triton_linear.CONFIG`` entries (ints; booleans as 0 / 1).
"""
import os

import torch
from fla.ops.linear_attn import chunk_linear_attn
from triton.testing import do_bench

from linearize.kernels import linear_attention
from linearize.kernels import triton_linear as TL

for item in os.environ.get("CONFIG", "").split():
    key, val = item.split("=")
    TL.CONFIG[key] = bool(int(val)) if isinstance(TL.CONFIG[key], bool) else type(TL.CONFIG[key])(float(val))
print("CONFIG overrides:", os.environ.get("CONFIG", "none"))

torch.manual_seed(0)
dev, bf, H, D = "cuda", torch.bfloat16, 32, 128
print(f"{'T':>7} {'B':>3} | {'ours':>7} {'fla':>7} {'x':>5} | {'ours un':>7} {'fla un':>7} {'x':>5} | ours norm vs fla un | err")
for T in [int(t) for t in os.environ.get("LENGTHS", "2048,8192,32768,131072").split(",")]:
    B = max(1, 32768 // T)
    q = torch.rand(B, T, H, D, device=dev, dtype=bf)
    k, v = torch.rand_like(q), torch.randn_like(q)
    with torch.no_grad():
        ref = linear_attention(q.float(), k.float(), v.float(), backend="torch")[0]
        err = ((linear_attention(q, k, v)[0].float() - ref).norm() / ref.norm()).item()
        ms = {name: do_bench(f, warmup=25, rep=150) for name, f in (
            ("ours", lambda: linear_attention(q, k, v)[0]),
            ("ours_un", lambda: linear_attention(q, k, v, normalize=False)[0]),
            ("fla", lambda: chunk_linear_attn(q, k, v, scale=1.0, normalize=True)[0]),
            ("fla_un", lambda: chunk_linear_attn(q, k, v, scale=1.0, normalize=False)[0]))}
    print(f"{T:7d} {B:3d} | {ms['ours']:7.3f} {ms['fla']:7.3f} {ms['fla'] / ms['ours']:5.2f} | "
          f"{ms['ours_un']:7.3f} {ms['fla_un']:7.3f} {ms['fla_un'] / ms['ours_un']:5.2f} | "
          f"{ms['fla_un'] / ms['ours']:5.2f} | {err:.2e}", flush=True)
    del q, k, v, ref

"""Our linear forward (normalised and not) against fla's ``chunk_linear_attn`` (normalize True / False), forward
only, at the four benchmark shapes (``LENGTHS=32768,131072`` picks some) (bf16, H=32, K=V=128, B*T = 32768), all in one process with the shipped
launch configuration; median of ``do_bench`` (warmup 25 ms, rep 150 ms). The forward rows of
``linearize bench kernels`` without its other rows and checks. Needs a GPU and fla-core 0.6.0:

    LINEARIZE_KERNEL_TUNING=0 FLA_DISABLE_BACKEND_DISPATCH=1 python kernels/linear_fwd_vs_fla.py

``CONFIG="fwd_rowsum_lanes=1 seg_warps=8"`` overrides ``triton_linear.CONFIG`` entries (ints; booleans as 0 / 1);
``VARIANTS="fwd_waves=4.13;fwd_rowsum_lanes=1"`` also times ours with each ``;``-separated set of overrides in the
same process, after the shipped (or ``CONFIG``) launch configuration, against the same fla times.
"""
import os

import torch
from fla.ops.linear_attn import chunk_linear_attn
from triton.testing import do_bench

from linearize.kernels import linear_attention
from linearize.kernels import triton_linear as TL



def overrides(spec: str) -> dict:
    """``"key=val key=val"`` -> CONFIG entries of the shipped entries' types."""
    out = {}
    for item in spec.split():
        key, val = item.split("=")
        out[key] = bool(int(val)) if isinstance(TL.CONFIG[key], bool) else type(TL.CONFIG[key])(float(val))
    return out


TL.CONFIG.update(overrides(os.environ.get("CONFIG", "")))
print("CONFIG overrides:", os.environ.get("CONFIG", "none"))
base = dict(TL.CONFIG)
variants = [v.strip() for v in os.environ.get("VARIANTS", "").split(";") if v.strip()]

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
    for spec in variants:
        TL.CONFIG.update(base, **overrides(spec))
        with torch.no_grad():
            err = ((linear_attention(q, k, v)[0].float() - ref).norm() / ref.norm()).item()
            norm = do_bench(lambda: linear_attention(q, k, v)[0], warmup=25, rep=150)
            un = do_bench(lambda: linear_attention(q, k, v, normalize=False)[0], warmup=25, rep=150)
        print(f"  {spec:>24s}: ours {norm:7.3f} ({ms['ours'] / norm:.3f}x the row above), ours un {un:7.3f} "
              f"({ms['ours_un'] / un:.3f}x); ours norm vs fla un {ms['fla_un'] / norm:5.2f} | {err:.2e}", flush=True)
    TL.CONFIG.update(base)
    del q, k, v, ref

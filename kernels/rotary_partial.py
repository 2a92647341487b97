"""Rotary embedding of queries and keys at Phi-4-mini's shape (H = 24, Hk = 8, D = 128, partial rotary: the first
R = 96 dims of each head turn), the one-launch Triton kernel against the PyTorch formula the original attention
runs (``rotary_reference``), bf16, for a decode step (B = 8, T = 1) and prefills (1 x 4K, 1 x 32K); full rotary
(R = D) alongside. Errors against the float64 formula. Needs a GPU:

    python kernels/rotary_partial.py
"""
import torch
from triton.testing import do_bench

from linearize.kernels import rotary_embedding
from linearize.kernels.reference import rotary_reference

dev, bf = "cuda", torch.bfloat16
H, HK, D = 24, 8, 128
torch.manual_seed(0)
for B, T in ((8, 1), (1, 4096), (1, 32768)):
    for R in (96, 128):
        q, k = torch.randn(B, T, H, D, device=dev, dtype=bf), torch.randn(B, T, HK, D, device=dev, dtype=bf)
        pos = torch.randint(0, 100000, (B, T), device=dev).double()
        inv = 10000.0 ** (-torch.arange(0, R, 2, device=dev, dtype=torch.float64) / R)
        ang = torch.cat([pos[..., None] * inv] * 2, -1)
        cos, sin = ang.cos().to(bf), ang.sin().to(bf)
        rq, rk = rotary_reference(q.double(), k.double(), cos.double(), sin.double())
        oq, ok = rotary_embedding(q, k, cos, sin, backend="triton")
        err = max(((o.double() - r).norm() / r.norm()).item() for o, r in ((oq, rq), (ok, rk)))
        t_k = do_bench(lambda: rotary_embedding(q, k, cos, sin, backend="triton"), warmup=25, rep=100)
        t_t = do_bench(lambda: rotary_reference(q, k, cos, sin), warmup=25, rep=100)
        print(f"B {B} T {T:6d} R {R:3d}: Triton {1e3 * t_k:8.1f} us, PyTorch {1e3 * t_t:8.1f} us "
              f"({t_t / t_k:.2f}x), rel err {err:.1e}", flush=True)

"""The window hybrid's forward (W = 64) at Gemma 3's head size: raw q, k and values of 256, 128 Hedgehog features,
4 query heads and 1 KV head, 32K x 1 tokens, bf16. Our Triton kernels vs the chunked PyTorch path (time of the
first call, i.e. compilation; median time; memory beyond the inputs; error against an fp32 PyTorch forward), and
our plain linear forward on the same features. Needs a GPU:

    LINEARIZE_KERNEL_TUNING=0 python kernels/window_wide_heads.py
"""
import time

import torch
import triton.testing as tt

from linearize import kernels

torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # the fp32 reference is fp32
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
B, T, H, Hk, D, F = 1, 32768, 4, 1, 256, 128
q = (torch.randn(B, T, H, D, device=dev, generator=g) * 0.3).bfloat16()
k = (torch.randn(B, T, Hk, D, device=dev, generator=g) * 0.3).bfloat16()
fq = torch.rand(B, T, H, F, device=dev, generator=g).bfloat16()
fk = torch.rand(B, T, Hk, F, device=dev, generator=g).bfloat16()
v = torch.randn(B, T, Hk, D, device=dev, generator=g).bfloat16()
wf = torch.full((H,), 0.3, device=dev)
with torch.no_grad():
    ref, _ = kernels.window_linear_attention(q.float(), k.float(), fq.float(), fk.float(), v.float(), wf, window=64,
                                             backend="torch")
    for be in ("triton", "torch"):
        t0 = time.time()
        o, _ = kernels.window_linear_attention(q, k, fq, fk, v, wf, window=64, backend=be)
        torch.cuda.synchronize()
        first = time.time() - t0
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = tt.do_bench(lambda: kernels.window_linear_attention(q, k, fq, fk, v, wf, window=64, backend=be))
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        err = ((o.float() - ref).norm() / ref.norm()).item()
        print(f"window fwd D=256 bf16 32K x 1, H=4, Hk=1 {be}: first call {first:.1f} s, {ms:.3f} ms, "
              f"extra peak {peak:.2f} GiB, rel err vs fp32 {err:.2e}")
    ms = tt.do_bench(lambda: kernels.linear_attention(fq, fk, v))
    print(f"plain linear fwd same shape (triton): {ms:.3f} ms")

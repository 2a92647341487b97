"""Wide sliding windows (W > 512) on the Triton kernels against the chunked PyTorch path they used to fall back to:
the window hybrid's forward and forward + backward, bf16, H = 32, D = K = V = 128, 8K x 2, W in 512 / 1024 / 2048;
errors of both against an fp32 PyTorch forward. Needs a GPU:

    LINEARIZE_KERNEL_TUNING=0 python kernels/window_wide.py [W ...]
"""
import sys

import torch
from triton.testing import do_bench

from linearize.kernels import window_linear_attention

torch.manual_seed(0)
dev, bf, H, D, B, T = "cuda", torch.bfloat16, 32, 128, 2, 8192
widths = [int(w) for w in sys.argv[1:]] or [512, 1024, 2048]
q, k = (torch.randn(B, T, H, D, device=dev, dtype=bf) for _ in range(2))
fq, fk = torch.rand_like(q), torch.rand_like(q)
v = torch.randn_like(q)
wf = torch.full((H,), 0.3, device=dev)
leaves = [x.clone().requires_grad_() for x in (q, k, fq, fk, v)]
do = torch.randn_like(v)
print(f"{B} x {T}, H = {H}, D = K = V = {D}, bf16; ms (median of do_bench)", flush=True)
for W in widths:
    with torch.no_grad():
        ref = window_linear_attention(q.float(), k.float(), fq.float(), fk.float(), v.float(), wf, window=W,
                                      backend="torch")[0]
        row = [f"W = {W:4d}"]
        for backend in ("triton", "torch"):
            f = lambda: window_linear_attention(q, k, fq, fk, v, wf, window=W, backend=backend)[0]  # noqa: E731
            err = ((f().float() - ref).norm() / ref.norm()).item()
            row.append(f"{backend} fwd {do_bench(f, warmup=10, rep=60):7.3f} (err {err:.1e})")
    for backend in ("triton", "torch"):
        def step():
            o = window_linear_attention(*leaves, wf, window=W, backend=backend)[0]
            torch.autograd.grad(o, leaves, do)
        try:
            row.append(f"{backend} fwd+bwd {do_bench(step, warmup=5, rep=30):7.3f}")
        except torch.OutOfMemoryError:
            row.append(f"{backend} fwd+bwd out of memory")
        torch.cuda.empty_cache()
    print("  ".join(row), flush=True)
    del ref
    torch.cuda.empty_cache()

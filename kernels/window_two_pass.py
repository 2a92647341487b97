"""The window hybrid's forward (W = 64): the single fused pass vs the two-pass forward, now the default
(``fwd_two_pass``: the plain forward on keys and values shifted by W, then the chunk-parallel softmax-window
kernel; ``softmax_warps`` 4 / 8), against our plain linear forward, in one process; each also with the Hedgehog
features computed in the kernels (``window_linear_attention_hedgehog``, f = 64). bf16, H = 32, D = K = V = 128,
B * T = 32768 (2K x 16, 8K x 4, and 32K x 1, which runs in segments); errors against an fp32 PyTorch forward. Needs a GPU:

    LINEARIZE_KERNEL_TUNING=0 python kernels/window_two_pass.py
"""
import torch
from triton.testing import do_bench

from linearize.kernels import linear_attention, window_linear_attention, window_linear_attention_hedgehog
from linearize.kernels import triton_window as TW

torch.manual_seed(0)
dev, bf, H, D = "cuda", torch.bfloat16, 32, 128
base = dict(TW.CONFIG)
for B, T in ((16, 2048), (4, 8192), (1, 32768)):
    qr, kr = torch.randn(B, T, H, D, device=dev, dtype=bf), torch.randn(B, T, H, D, device=dev, dtype=bf)
    fq, fk = torch.rand_like(qr), torch.rand_like(qr)
    v = torch.randn_like(qr)
    wf = torch.full((H,), 0.3, device=dev)
    wq, wk = (0.1 * torch.randn(H, D, D // 2, device=dev, dtype=bf) for _ in range(2))
    with torch.no_grad():
        ref = window_linear_attention(qr.float(), kr.float(), fq.float(), fk.float(), v.float(), wf, window=64,
                                      backend="torch")[0]
        plain = do_bench(lambda: linear_attention(fq, fk, v)[0], warmup=25, rep=150)
        print(f"== {B} x {T}: plain linear fwd {plain:.3f} ms", flush=True)
        for two, warps in ((False, 8), (True, 8), (True, 4)):
            TW.CONFIG.update(base, fwd_two_pass=two, softmax_warps=warps)
            f = lambda: window_linear_attention(qr, kr, fq, fk, v, wf, window=64)[0]  # noqa: E731
            err = ((f().float() - ref).norm() / ref.norm()).item()
            ms = do_bench(f, warmup=25, rep=150)
            name = f"two-pass, {warps} warps" if two else "single pass"
            fused = do_bench(lambda: window_linear_attention_hedgehog(qr, kr, v, wf, wq, wk, window=64)[0],
                             warmup=25, rep=150)
            print(f"  {name:20s} {ms:.3f} ms = {ms / plain:.2f}x plain, err {err:.2e}; Hedgehog features in the "
                  f"kernels (f = 64): {fused:.3f} ms", flush=True)
    del qr, kr, fq, fk, v, ref

"""The linear forward's normaliser variants (``fwd_norm_split`` on / off) x value block (``fwd_bv`` 128 / 64, 8 warps)
at 2K x 16 and 32K x 1 (segment tile 64 x 128), bf16, H=32, K=V=128, with fla's ``chunk_linear_attn`` (normalize
True / False) timed in the same process; errors against an fp32 PyTorch forward. Needs a GPU and fla-core 0.6.0:

    LINEARIZE_KERNEL_TUNING=0 FLA_DISABLE_BACKEND_DISPATCH=1 python kernels/fwd_normaliser_variants.py
"""
import torch
from triton.testing import do_bench
from linearize.kernels import linear_attention
from linearize.kernels import triton_linear as TL
from fla.ops.linear_attn import chunk_linear_attn

torch.manual_seed(0)
dev, bf, H, D = "cuda", torch.bfloat16, 32, 128
base = dict(TL.CONFIG, seg_bv=128)
tb = lambda f: do_bench(f, warmup=25, rep=150)
for B, T in ((16, 2048), (1, 32768)):
    q = torch.rand(B, T, H, D, device=dev, dtype=bf); k = torch.rand_like(q); v = torch.randn_like(q)
    with torch.no_grad():
        ref = linear_attention(q.float(), k.float(), v.float(), backend="torch")[0]
        fu = tb(lambda: chunk_linear_attn(q, k, v, scale=1.0, normalize=False)[0])
        fn = tb(lambda: chunk_linear_attn(q, k, v, scale=1.0, normalize=True)[0])
        print(f"== {B} x {T}: fla norm {fn:.3f}  fla unnorm {fu:.3f} ms")
        for bv in (128, 64):
            for split in (True, False):
                TL.CONFIG.update(base, fwd_bv=bv, fwd_warps=8, fwd_norm_split=split)
                f = lambda: linear_attention(q, k, v)[0]
                o = f(); torch.cuda.synchronize()
                err = ((o.float() - ref).norm() / ref.norm()).item()
                ms = tb(f)
                print(f"bv {bv} split {split!s:5}: {ms:.3f} ms  err {err:.2e}  vs fla unnorm {fu / ms:.2f}x  vs fla norm {fn / ms:.2f}x")
            TL.CONFIG.update(base, fwd_bv=bv, fwd_warps=8)
            ms = tb(lambda: linear_attention(q, k, v, normalize=False)[0])
            print(f"bv {bv} unnormalised: {ms:.3f} ms  vs fla unnorm {fu / ms:.2f}x")

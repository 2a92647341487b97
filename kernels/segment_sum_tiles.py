"""The forwards' segment-sum state tile (``seg_bk`` x ``seg_bv``) at 32K x 1, 128K x 1 and 2K x 16: our normalised
and unnormalised linear forward against fla's ``chunk_linear_attn`` (normalize True / False) in the same process,
and the window forward (W=64); each output compared with the 64 x 64 tile's. Needs a GPU and fla-core 0.6.0:

    LINEARIZE_KERNEL_TUNING=0 FLA_DISABLE_BACKEND_DISPATCH=1 python kernels/segment_sum_tiles.py
"""
import torch
from triton.testing import do_bench
from linearize.kernels import linear_attention, window_linear_attention
from linearize.kernels import triton_linear as TL, triton_window as TW
from fla.ops.linear_attn import chunk_linear_attn

torch.manual_seed(0)
dev, bf, H, D = "cuda", torch.bfloat16, 32, 128
wf = torch.full((H,), 0.3, device=dev)
defaults = {mod: dict(mod.CONFIG) for mod in (TL, TW)}
tb = lambda f: do_bench(f, warmup=25, rep=150)
for B, T in ((1, 32768), (1, 131072), (16, 2048)):
    q = torch.rand(B, T, H, D, device=dev, dtype=bf); k = torch.rand_like(q); v = torch.randn_like(q)
    qr = torch.randn_like(q); kr = torch.randn_like(q)
    with torch.no_grad():
        r = {}
        for norm in (True, False):
            r[f"fla norm={norm}"] = tb(lambda: chunk_linear_attn(q, k, v, scale=1.0, normalize=norm)[0])
        refs = {}
        for bk, bv in ((64, 64), (64, 128), (128, 64), (128, 128)):
            for mod in (TL, TW):
                mod.CONFIG.update(seg_bk=bk, seg_bv=bv)
            for norm in (True, False):
                f = lambda: linear_attention(q, k, v, normalize=norm)[0]
                o = f(); torch.cuda.synchronize()
                key = f"lin{norm}"
                refs.setdefault(key, o)
                err = ((o.float() - refs[key].float()).norm() / refs[key].float().norm()).item()
                r[f"ours norm={norm} seg {bk}x{bv}"] = (tb(f), err)
            g = lambda: window_linear_attention(qr, kr, q, k, v, wf, window=64)[0]
            o = g(); torch.cuda.synchronize(); refs.setdefault("win", o)
            err = ((o.float() - refs["win"].float()).norm() / refs["win"].float().norm()).item()
            r[f"window seg {bk}x{bv}"] = (tb(g), err)
        for mod in (TL, TW):
            mod.CONFIG.update(defaults[mod])
    fn, fu = r["fla norm=True"], r["fla norm=False"]
    print(f"== {B} x {T}: fla norm {fn:.3f} ms, fla unnorm {fu:.3f} ms")
    for key, val in r.items():
        if isinstance(val, tuple):
            ms, err = val
            extra = f"  vs fla norm {fn / ms:.2f}x  vs fla unnorm {fu / ms:.2f}x" if key.startswith("ours") else ""
            print(f"{key:32s} {ms:7.3f} ms  err {err:.1e}{extra}")

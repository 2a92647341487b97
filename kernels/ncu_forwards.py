"""One launch each of the linear forward (normalised and not; 2K x 16 and 32K x 1) and the window forward
(2K x 16), then the registers / spills / shared memory of every compiled variant. Run under Nsight Compute:

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats -k regex:"_la_fwd_kernel|_win_fwd_kernel|_scan_kernel" python kernels/ncu_forwards.py
"""
import torch
from linearize.kernels import linear_attention, window_linear_attention
from linearize.kernels import triton_linear as TL, triton_window as TW, triton_common as TC

torch.manual_seed(0)
dev, bf, H, D = "cuda", torch.bfloat16, 32, 128
wf = torch.full((H,), 0.3, device=dev)
with torch.no_grad():
    for B, T in ((16, 2048), (1, 32768)):
        q = torch.rand(B, T, H, D, device=dev, dtype=bf); k = torch.rand(B, T, H, D, device=dev, dtype=bf)
        v = torch.randn(B, T, H, D, device=dev, dtype=bf)
        qr = torch.randn(B, T, H, D, device=dev, dtype=bf); kr = torch.randn(B, T, H, D, device=dev, dtype=bf)
        linear_attention(q, k, v)
        linear_attention(q, k, v, normalize=False)
        if B == 16:
            window_linear_attention(qr, kr, q, k, v, wf, window=64)
        torch.cuda.synchronize()
for name, fn in (("la_fwd", TL._la_fwd_kernel), ("win_fwd", TW._win_fwd_kernel), ("scan", TC._scan_kernel)):
    for cache in getattr(fn, "device_caches", {}).values():
        for key, kern in cache[0].items():
            md = getattr(kern, "metadata", None)
            print(name, "regs", getattr(kern, "n_regs", "?"), "spills", getattr(kern, "n_spills", "?"),
                  "shared", getattr(md, "shared", "?"), "warps", getattr(md, "num_warps", "?"), str(key)[-200:])

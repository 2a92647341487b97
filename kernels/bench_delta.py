"""Our gated delta rule (``linearize.kernels.delta``) against fla's ``chunk_gated_delta_rule`` (forward and
forward + backward) at the benchmark shapes (bf16, H = 32, K = V = 128, B*T = 32768; ``LENGTHS=2048,8192,32768``
by default), and the decode step as a fraction of copy bandwidth (batch 8, H = 32, fp32 state, CUDA graphs, the
state rotated over 8 copies so that it comes from memory), against fla's ``fused_recurrent_gated_delta_rule``.
All in one process; median of ``do_bench`` (warmup 25 ms, rep 150 ms). fla's rows are skipped when it is not
installed. Errors: relative L2 of the bf16 outputs (ours and fla's) against our chunked PyTorch path in fp32.
Needs a GPU:

    LINEARIZE_KERNEL_TUNING=0 FLA_DISABLE_BACKEND_DISPATCH=1 python kernels/bench_delta.py

``CONFIG="walk_warps=8 bwd_bv=32"`` overrides ``triton_delta.CONFIG`` entries (ints; booleans as 0 / 1);
``VARIANTS="fwd_states_fp32=1;walk_bv=128"`` also times ours with each ``;``-separated set of overrides, after the
shipped (or ``CONFIG``) configuration, in the same process. ``HK=8`` runs GQA (our kernels; fla's rows then run
with the KV heads repeated, as its kernel has no GQA).
"""
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from linearize.kernels import triton_delta as TD
from linearize.kernels.delta import gated_delta_rule, gated_delta_rule_step

try:  # optional: fla's rows are skipped without it
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
except ImportError:
    chunk_gated_delta_rule = fused_recurrent_gated_delta_rule = None


def overrides(spec: str) -> dict:
    """``"key=val key=val"`` -> CONFIG entries of the shipped entries' types."""
    out = {}
    for item in spec.split():
        key, val = item.split("=")
        out[key] = bool(int(val)) if isinstance(TD.CONFIG[key], bool) else type(TD.CONFIG[key])(float(val))
    return out


TD.CONFIG.update(overrides(os.environ.get("CONFIG", "")))
base = dict(TD.CONFIG)
variants = [v.strip() for v in os.environ.get("VARIANTS", "").split(";") if v.strip()]
print("CONFIG:", TD.CONFIG)
print("fla:", "absent" if chunk_gated_delta_rule is None else "chunk_gated_delta_rule, fused_recurrent_gated_delta_rule")

torch.manual_seed(0)
dev, bf, H, D = "cuda", torch.bfloat16, 32, 128
HK = int(os.environ.get("HK", H))
scale = D ** -0.5


def bench(fn):
    return do_bench(fn, warmup=25, rep=150)


def inputs(B, T):
    q = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(bf)
    k = F.normalize(torch.randn(B, T, HK, D, device=dev), dim=-1).to(bf)
    v = torch.randn(B, T, HK, D, device=dev).to(bf)
    beta = torch.sigmoid(torch.randn(B, T, HK, device=dev)).to(bf)
    ld = F.logsigmoid(torch.randn(B, T, HK, device=dev)) / 16  # [B, T, HK] fp32, a few per cent per token
    return q, k, v, beta, ld


def rel(x, ref):
    return ((x.float() - ref).norm() / ref.norm()).item()


def fwd_bwd(call, args, do):
    """``call(*args)``'s output, then the gradients of every input (no accumulation between runs)."""
    def run():
        o = call(*args)
        torch.autograd.grad(o, args, do)
    return run


ours = lambda q, k, v, beta, ld: gated_delta_rule(q, k, v, beta, ld, scale=scale)[0]  # noqa: E731


def fla_call(q, k, v, beta, ld):
    G = H // HK  # fla has no GQA: its keys and values repeated per query head
    k, v, beta, ld = (x.repeat_interleave(G, 2) if G > 1 else x for x in (k, v, beta, ld))
    return chunk_gated_delta_rule(q, k, v, g=ld, beta=beta, scale=scale)[0]


print(f"\n{'T':>6} {'B':>3} | {'ours fwd':>9} {'fla fwd':>9} {'x':>5} | {'ours f+b':>9} {'fla f+b':>9} {'x':>5} | "
      f"{'err ours':>8} {'err fla':>8}  (ms; x = fla / ours)")
for T in [int(t) for t in os.environ.get("LENGTHS", "2048,8192,32768").split(",")]:
    B = max(1, 32768 // T)
    x = inputs(B, T)
    with torch.no_grad():
        ref = gated_delta_rule(*(t.float() for t in x), scale=scale, backend="torch")[0]
        err = rel(ours(*x), ref)
        err_fla = rel(fla_call(*x), ref) if chunk_gated_delta_rule is not None else float("nan")
        t_fwd = bench(lambda: ours(*x))
        f_fwd = bench(lambda: fla_call(*x)) if chunk_gated_delta_rule is not None else float("nan")
    leaves = [t.detach().clone().requires_grad_() for t in x]
    do = torch.randn(B, T, H, D, device=dev, dtype=bf)
    t_fb = bench(fwd_bwd(ours, leaves, do))
    f_fb = bench(fwd_bwd(fla_call, leaves, do)) if chunk_gated_delta_rule is not None else float("nan")
    print(f"{T:6d} {B:3d} | {t_fwd:9.3f} {f_fwd:9.3f} {f_fwd / t_fwd:5.2f} | {t_fb:9.3f} {f_fb:9.3f} "
          f"{f_fb / t_fb:5.2f} | {err:8.1e} {err_fla:8.1e}", flush=True)
    for spec in variants:
        TD.CONFIG.update(base, **overrides(spec))
        with torch.no_grad():
            err = rel(ours(*x), ref)
            t_fwd = bench(lambda: ours(*x))
        t_fb = bench(fwd_bwd(ours, leaves, do))
        print(f"{'':6} {'':3} | {t_fwd:9.3f} {'':9} {f_fwd / t_fwd:5.2f} | {t_fb:9.3f} {'':9} {f_fb / t_fb:5.2f} | "
              f"{err:8.1e} {'':8}  {spec}", flush=True)
        TD.CONFIG.update(base)
    del x, leaves, do, ref
    torch.cuda.empty_cache()

# decode: one token per call, fp32 state [B, HK, K, V] in place, under a CUDA graph
Bd, copies = int(os.environ.get("DECODE_BATCH", 8)), 8
buf = torch.empty(2 ** 30, dtype=torch.uint8, device=dev)
copy_gbs = 2 * buf.numel() / bench(lambda: buf.clone()) / 1e6  # read + write, GB/s
del buf
q, k, v, beta, ld = (t[:, 0].contiguous() for t in inputs(Bd, 1))
states = [torch.randn(Bd, HK, D, D, device=dev) * 0.1 for _ in range(copies)]
out = torch.empty(Bd, H, D, device=dev, dtype=bf)
state_bytes = 2 * states[0].numel() * 4  # read + write of the state
with torch.no_grad():
    ref_out = gated_delta_rule_step(q, k, v, beta, ld, states[0].clone(), scale=scale, backend="torch")
    err = rel(gated_delta_rule_step(q, k, v, beta, ld, states[0].clone(), scale=scale), ref_out.float())
    gated_delta_rule_step(q, k, v, beta, ld, states[0].clone(), scale=scale, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in states:
            gated_delta_rule_step(q, k, v, beta, ld, s, scale=scale, out=out)
    us = bench(graph.replay) / copies * 1e3
print(f"\ndecode step, batch {Bd}, H {H}, HK {HK}, K = V = {D}, fp32 state, CUDA graph: copy bandwidth "
      f"{copy_gbs:,.0f} GB/s")
print(f"  ours {us:7.1f} us = {state_bytes / us / 1e3:,.0f} GB/s of state read+write = "
      f"{state_bytes / us / 1e3 / copy_gbs:.0%} of copy   (err vs the PyTorch step {err:.1e})")
if fused_recurrent_gated_delta_rule is not None:
    G = H // HK
    q4, k4, v4, b4, g4 = (t.unsqueeze(1) for t in (q, k, v, beta, ld))
    if G > 1:
        k4, v4, b4, g4 = (t.repeat_interleave(G, 2) for t in (k4, v4, b4, g4))
    fs = [s.repeat_interleave(G, 1) if G > 1 else s for s in states]
    with torch.no_grad():
        fla_step = lambda i: fused_recurrent_gated_delta_rule(  # noqa: E731
            q4, k4, v4, g=g4, beta=b4, scale=scale, initial_state=fs[i], output_final_state=True)
        fla_step(0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(copies):
                fla_step(i)
        us_fla = bench(graph.replay) / copies * 1e3
    fla_bytes = 2 * fs[0].numel() * 4
    print(f"  fla  {us_fla:7.1f} us = {fla_bytes / us_fla / 1e3:,.0f} GB/s = {fla_bytes / us_fla / 1e3 / copy_gbs:.0%} "
          f"of copy (returns a new state); ours {us_fla / us:.2f}x fla")

"""Triton decode step of the gated delta rule (one token, the state updated in place).

One program per (batch x KV head, value block) reads its columns of the fp32 state ``[K, V]`` once, decays them,
applies the delta update ``S <- S + beta k (v - S^T k)^T`` (a column's update reads only that column, so value
blocks are independent and race-free), writes them back and answers every query head of the KV group from
registers. Nothing is allocated but the output (``out=`` avoids it) and nothing is read back to the host, so a
CUDA graph can replay the call.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_common import num_sms, pow2
from .tuning import ensure_applied, register

CONFIG = {  # untuned defaults (kernels/README.md, "Gated delta rule")
    # value columns are split over programs while the grid has fewer than step_waves programs per SM
    "step_waves": 0.5,
    "step_bv": 0,  # > 0: this value block (tests, sweeps)
    "step_warps": 4,
}


@triton.jit
def _delta_step_kernel(
    Q, Kp, Vp, BETA, LD, S, O,  # q [B,H,K], k [B,HK,K], v [B,HK,V], beta [B,HK], log decay [B,HK], S [B,HK,K,V], o
    H, HK, scale,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, G: tl.constexpr, DECAY: tl.constexpr,
):
    pbh = tl.program_id(0)
    b = pbh // HK
    hk = pbh % HK
    ok = tl.arange(0, BK)
    ov = tl.program_id(1) * BV + tl.arange(0, BV)
    mk = ok < K
    mv = ov < V
    base = pbh.to(tl.int64)
    k = tl.load(Kp + base * K + ok, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(Vp + base * V + ov, mask=mv, other=0.0).to(tl.float32)
    beta = tl.load(BETA + base).to(tl.float32)
    sp = S + base * K * V + ok[:, None] * V + ov[None, :]
    s = tl.load(sp, mask=mk[:, None] & mv[None, :], other=0.0)
    if DECAY:
        s = s * tl.exp(tl.load(LD + base).to(tl.float32))
    pred = tl.sum(k[:, None] * s, 0)  # [BV]: S^T k after the decay
    s += k[:, None] * (beta * (v - pred))[None, :]
    tl.store(sp, s, mask=mk[:, None] & mv[None, :])
    for g in tl.static_range(G):
        qrow = b.to(tl.int64) * H + hk * G + g
        q = tl.load(Q + qrow * K + ok, mask=mk, other=0.0).to(tl.float32)
        tl.store(O + qrow * V + ov, (tl.sum(q[:, None] * s, 0) * scale).to(O.dtype.element_ty), mask=mv)


def step_value_block(programs: int, V: int, device: torch.device) -> int:
    """Value block for ``programs`` (batch x KV head) pairs: halved from the whole ``V`` while the grid has fewer
    than ``CONFIG["step_waves"]`` programs per SM (one block per pair off CUDA); at least 32."""
    BV = pow2(V)
    if CONFIG["step_bv"]:
        return min(pow2(int(CONFIG["step_bv"])), BV)
    if device.type == "cuda":
        target = CONFIG["step_waves"] * num_sms(device)
        while BV > 32 and programs * triton.cdiv(V, BV) < target:
            BV //= 2
    return BV


def gated_delta_rule_step_triton(
    q: torch.Tensor,  # [B, H, K]
    k: torch.Tensor,  # [B, HK, K]
    v: torch.Tensor,  # [B, HK, V]
    beta: torch.Tensor,  # [B, HK]
    log_decay: Optional[torch.Tensor],  # [B, HK]
    state: torch.Tensor,  # [B, HK, K, V] fp32 contiguous, updated in place
    *,
    scale: float,
    out: Optional[torch.Tensor] = None,  # [B, H, V]
) -> torch.Tensor:
    """Triton path of :func:`linearize.kernels.delta.gated_delta_rule_step`."""
    ensure_applied(q.device)  # this GPU's saved launch configuration, once
    B, H, K = q.shape
    HK, V = k.shape[1], v.shape[-1]
    if out is None:
        out = torch.empty((B, H, V), dtype=v.dtype, device=q.device)
    BV = step_value_block(B * HK, V, q.device)
    q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
    ld = log_decay.contiguous() if log_decay is not None else beta
    _delta_step_kernel[(B * HK, triton.cdiv(V, BV))](
        q, k, v, beta, ld, state, out, H, HK, float(scale), K=K, V=V, BK=pow2(K), BV=BV, G=H // HK,
        DECAY=log_decay is not None, num_warps=CONFIG["step_warps"])
    return out


register("delta_step", CONFIG)  # tunable per GPU (tuning.py)

"""Triton kernels for causal (normalised) linear attention, forward and backward.

Forward: one sequential pass per (value block, query head, segment) that carries
the state ``S [K, BV]`` and the normaliser ``z [K]`` in registers across chunks of
``BT`` tokens and writes the *normalised* output directly (the normaliser is
fused: no separate pass, no materialised per-chunk states). When the grid would
not fill the GPU (few heads, long sequences) the sequence is split into
segments: a parallel kernel sums ``k^T v`` per segment, a tiny cumulative sum
gives each segment its starting state, and segments then run independently.

Backward (math in the kernel lab, kernels/README.md): per-chunk states are recomputed by two scans
(forward ``sum k^T v``, reverse ``sum q^T dn``), then two chunk-parallel kernels
produce ``dq`` and ``(dk, dv)``; the GQA sum over a KV group's query heads is
done inside the kernels.

Gated (``log_decay``): separate kernels (``_la_gated_*``) with the same structure, the decays formed from
chunk-local cumulative sums (every factor ``<= 1``); the backward's kernels also give the two sides of
``d log_decay``. The plain kernels are unchanged (the state scans decay in a constexpr branch of the shared scan).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .reference import hedgehog_features_rounded
from .triton_common import (
    chunk_states,
    decay_cumsum,
    decay_pairs,
    fwd_blocks,
    gated_scan_states,
    gated_segment_starts,
    hedgehog_tile,
    launch,
    mm,
    new_empty,
    plan_segments,
    pow2,
    prec,
    row_stats,
    segment_starts,
    segment_sum_launch,
    signed_projections,
)
from .tuning import ensure_applied, register



@triton.jit
def _la_fwd_kernel(
    Q, Kp, Vp, O, DEN,  # q [B,T,H,K], k [B,T,HK,K], v [B,T,HK,V], o [B,T,H,V], den [B,T,H] fp32
    SEG_S, SEG_Z,  # starting state per segment [B,HK,NSEG,K,V], [B,HK,NSEG,K]
    FIN_S, FIN_Z,  # final state [B,HK,K,V], [B,HK,K]
    WQX, WKX,  # fused Hedgehog maps [Wq, -Wq] [H,D,K], [Wk, -Wk] [HK,D,K]: then q (FUSE_Q) / k (FUSE_K) are raw [.., D]
    T, H, HK, NSEG, SEG_CHUNKS, eps, feps, SHIFT,  # SHIFT (SHIFTED): query t sees keys/values j <= t - SHIFT
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    NORMALIZE: tl.constexpr, HAS_SEG: tl.constexpr, STORE_FINAL: tl.constexpr, SHIFTED: tl.constexpr,
    STORE_DEN: tl.constexpr, NORM_MMA: tl.constexpr, SPLIT: tl.constexpr, ROWSUM_LANES: tl.constexpr,
    PREC: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, FUSE_Q: tl.constexpr, FUSE_K: tl.constexpr,
):
    # NORM_MMA: the normaliser's reductions (rowsum(A), q.z, the column sums of k that update z) run as
    # tensor-core products against a [BT, 16] block of ones, with z carried as a [BK, 16] block whose
    # columns are all equal (hi + lo 16-bit split of z for q.z when SPLIT), instead of lane reductions
    pv = tl.program_id(0)
    pbh = tl.program_id(1)
    ps = tl.program_id(2)
    b = pbh // H
    h = pbh % H
    G = H // HK
    hk = h // G
    ok = tl.arange(0, BK)
    ov = pv * BV + tl.arange(0, BV)
    od = tl.arange(0, BD)
    mk = ok < K
    mv = ov < V
    md = od < D
    S = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    sbh = (b * HK + hk).to(tl.int64)
    if HAS_SEG:
        sp = SEG_S + (sbh * NSEG + ps) * K * V
        S += tl.load(sp + ok[:, None] * V + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
        z += tl.load(SEG_Z + (sbh * NSEG + ps) * K + ok, mask=mk, other=0.0)
    N = tl.cdiv(T, BT)
    c0 = ps * SEG_CHUNKS
    c1 = tl.minimum(c0 + SEG_CHUNKS, N)
    ar = tl.arange(0, BT)
    causal = ar[:, None] >= ar[None, :]
    if NORM_MMA:
        Z16 = tl.zeros([BK, 16], dtype=tl.float32) + z[:, None]  # [BK, 16], every column = z
        ones = tl.full([BT, 16], 1.0, dtype=Vp.dtype.element_ty)
    for i in range(c0, c1):
        ot = i * BT + ar
        mt = ot < T
        qrow = (b.to(tl.int64) * T + ot) * H + h
        if SHIFTED:  # row r of the key tiles holds token ot_r - SHIFT (zero before the sequence)
            mkey = mt & (ot >= SHIFT)
            krow = (b.to(tl.int64) * T + ot - SHIFT) * HK + hk
        else:
            mkey = mt
            krow = (b.to(tl.int64) * T + ot) * HK + hk
        if FUSE_Q:  # rows past T get features too; their outputs are never stored
            q = tl.load(Q + qrow[:, None] * D + od[None, :], mask=mt[:, None] & md[None, :], other=0.0)
            q = hedgehog_tile(q, WQX, h, od, ok, md, mk, D, K, K // 2, feps, PREC).to(q.dtype)
        else:
            q = tl.load(Q + qrow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        if FUSE_K:  # keys past T (or before 0, shifted) must add nothing to the state: zero their features
            k = tl.load(Kp + krow[:, None] * D + od[None, :], mask=mkey[:, None] & md[None, :], other=0.0)
            k = tl.where(mkey[:, None], hedgehog_tile(k, WKX, hk, od, ok, md, mk, D, K, K // 2, feps, PREC), 0.0)
            k = k.to(Kp.dtype.element_ty)
        else:
            k = tl.load(Kp + krow[:, None] * K + ok[None, :], mask=mkey[:, None] & mk[None, :], other=0.0)
        v = tl.load(Vp + krow[:, None] * V + ov[None, :], mask=mkey[:, None] & mv[None, :], other=0.0)
        A = mm(q, tl.trans(k), PREC)
        A = tl.where(causal, A, 0.0).to(v.dtype)  # rounded once: numerator and normaliser agree
        o = mm(A, v, PREC)
        o += mm(q, S.to(q.dtype), PREC)
        if NORMALIZE:
            if NORM_MMA:
                Z_hi = Z16.to(q.dtype)
                d16 = mm(q, Z_hi, PREC)  # [BT, 16], every column = q.z
                if SPLIT:
                    d16 += mm(q, (Z16 - Z_hi.to(tl.float32)).to(q.dtype), PREC)
                if ROWSUM_LANES:  # rowsum(A) from the accumulator already in registers: one product fewer
                    d = tl.max(d16, 1) + tl.sum(A.to(tl.float32), 1) + eps
                else:
                    d = tl.max(d16 + mm(A, ones, PREC), 1) + eps
            else:
                d = tl.sum(A.to(tl.float32), 1) + tl.sum(q.to(tl.float32) * z[None, :], 1) + eps
            o = o / d[:, None]
            if STORE_DEN:
                if pv == 0:
                    tl.store(DEN + qrow, d, mask=mt)
        tl.store(O + qrow[:, None] * V + ov[None, :], o.to(O.dtype.element_ty), mask=mt[:, None] & mv[None, :])
        S += mm(tl.trans(k), v, PREC)
        if NORM_MMA:
            Z16 += mm(tl.trans(k), ones.to(k.dtype), PREC)
        else:
            z += tl.sum(k.to(tl.float32), 0)
    if NORM_MMA:
        z = tl.max(Z16, 1)
    if STORE_FINAL:
        if ps == NSEG - 1:
            if h % G == 0:
                tl.store(FIN_S + sbh * K * V + ok[:, None] * V + ov[None, :], S, mask=mk[:, None] & mv[None, :])
                if pv == 0:
                    tl.store(FIN_Z + sbh * K + ok, z, mask=mk)


# ---------------------------------------------------------------------------
# gated (decayed) linear attention: the same forward and backward with a per-token, per-KV-head log decay.
# Inside a chunk only e^{c_i - c_j} (j <= i), e^{c_i} and e^{c_last - c_j} are formed from the chunk-local
# inclusive cumulative sums c of the log decays (all <= 1); the carried state decays by e^{c_last} per chunk.


@triton.jit
def _decay_tile(LG, grow, mt, BT: tl.constexpr):
    """``(e^{c} [BT], e^{c_last - c} [BT], e^{c_last}, M [BT, BT])`` of a chunk (:func:`decay_cumsum`,
    :func:`decay_pairs`): ``c`` its chunk-local inclusive cumulative log decays (0 past T)."""
    hi, lo, last_hi, last_lo = decay_cumsum(tl.load(LG + grow, mask=mt, other=0.0), BT)
    return (tl.exp(hi + lo), tl.exp((last_hi - hi) + (last_lo - lo)), tl.exp(last_hi + last_lo),
            decay_pairs(hi, lo, BT))


@triton.jit
def _la_gated_fwd_kernel(
    Q, Kp, Vp, LG, O, DEN,  # q [B,T,H,K], k [B,T,HK,K], v [B,T,HK,V], log decay [B,T,HK] fp32, o, den [B,T,H]
    SEG_S, SEG_Z,  # state entering each segment [B,HK,NSEG,K,V], [B,HK,NSEG,K]
    FIN_S, FIN_Z,  # final state [B,HK,K,V], [B,HK,K]
    T, H, HK, NSEG, SEG_CHUNKS, eps,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    NORMALIZE: tl.constexpr, HAS_SEG: tl.constexpr, STORE_FINAL: tl.constexpr, STORE_DEN: tl.constexpr,
    NORM_MMA: tl.constexpr, PREC: tl.constexpr,
):
    """:func:`_la_fwd_kernel`'s walk with decays: ``A = tril(q k^T) * M``, ``o = A v + e^{c} q S``, ``D = rowsum(A)
    + e^{c} q.z + eps``; then ``S <- e^{c_last} S + (e^{c_last - c} k)^T v`` (``z`` likewise). ``NORM_MMA``: ``q.z``
    and the update of ``z`` as tensor-core products, ``z`` carried as a ``[BK, 16]`` block of equal columns (as
    :func:`_la_fwd_kernel` does by default; ``rowsum(A)`` stays a lane reduction)."""
    pv = tl.program_id(0)
    pbh = tl.program_id(1)
    ps = tl.program_id(2)
    b = pbh // H
    h = pbh % H
    G = H // HK
    hk = h // G
    ok = tl.arange(0, BK)
    ov = pv * BV + tl.arange(0, BV)
    mk = ok < K
    mv = ov < V
    S = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    sbh = (b * HK + hk).to(tl.int64)
    if HAS_SEG:
        S += tl.load(SEG_S + (sbh * NSEG + ps) * K * V + ok[:, None] * V + ov[None, :], mask=mk[:, None] & mv[None, :],
                     other=0.0)
        z += tl.load(SEG_Z + (sbh * NSEG + ps) * K + ok, mask=mk, other=0.0)
    N = tl.cdiv(T, BT)
    c0 = ps * SEG_CHUNKS
    c1 = tl.minimum(c0 + SEG_CHUNKS, N)
    ar = tl.arange(0, BT)
    if NORM_MMA:
        Z16 = tl.zeros([BK, 16], dtype=tl.float32) + z[:, None]  # [BK, 16], every column = z
        ones = tl.full([BT, 16], 1.0, dtype=Kp.dtype.element_ty)
    for i in range(c0, c1):
        ot = i * BT + ar
        mt = ot < T
        qrow = (b.to(tl.int64) * T + ot) * H + h
        krow = (b.to(tl.int64) * T + ot) * HK + hk
        eq, wk, keep, M = _decay_tile(LG, krow, mt, BT)
        q = tl.load(Q + qrow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        k = tl.load(Kp + krow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        v = tl.load(Vp + krow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        A = (mm(q, tl.trans(k), PREC) * M).to(v.dtype)  # rounded once: numerator and normaliser agree
        o = mm(A, v, PREC) + eq[:, None] * mm(q, S.to(q.dtype), PREC)
        if NORMALIZE:
            if NORM_MMA:
                qz = tl.max(mm(q, Z16.to(q.dtype), PREC), 1)  # every column of the product is q.z
            else:
                qz = tl.sum(q.to(tl.float32) * z[None, :], 1)
            d = tl.sum(A.to(tl.float32), 1) + eq * qz + eps
            o = o / d[:, None]
            if STORE_DEN:
                if pv == 0:
                    tl.store(DEN + qrow, d, mask=mt)
        tl.store(O + qrow[:, None] * V + ov[None, :], o.to(O.dtype.element_ty), mask=mt[:, None] & mv[None, :])
        kd = (k.to(tl.float32) * wk[:, None]).to(k.dtype)  # keys decayed to the chunk's end
        S = S * keep + mm(tl.trans(kd), v, PREC)
        if NORM_MMA:
            Z16 = Z16 * keep + mm(tl.trans(kd), ones, PREC)
        else:
            z = z * keep + tl.sum(kd.to(tl.float32), 0)
    if NORM_MMA:
        z = tl.max(Z16, 1)
    if STORE_FINAL:
        if ps == NSEG - 1:
            if h % G == 0:
                tl.store(FIN_S + sbh * K * V + ok[:, None] * V + ov[None, :], S, mask=mk[:, None] & mv[None, :])
                if pv == 0:
                    tl.store(FIN_Z + sbh * K + ok, z, mask=mk)


@triton.jit
def _la_bwd_dq_kernel(
    Kp, Vp, DO, INVD, DD,  # k, v, do [B,T,H,V], 1/den and dd [B,T,H] fp32
    ST_S, ST_Z,  # exclusive per-chunk states [B,HK,N,K,V], [B,HK,N,K]
    DQ,
    Q, LG, DBQ,  # GATED: q, log decays [B,T,HK] fp32, DBQ [NK_BLK,B,T,H] fp32 (query side of dL/db, this key block)
    T, H, HK,
    NROWS, eps,  # GATED: B*T*H, the forward's eps
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    NV_BLK: tl.constexpr, NORMALIZE: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
    GATED: tl.constexpr, EXACT_DD: tl.constexpr,
):
    """``dq_t = sum_{j<=t} (dn_t.v_j + dd_t) k_j + S dn_t + dd_t z`` per chunk.

    ``GATED``: ``dq_t = sum_{j<=t} M_tj (dn_t.v_j + dd_t) k_j + e^{c_t} (S dn_t + dd_t z)``, and the query side of
    ``dL/db_t``: ``sum_{j<t} P_tj + e^{c_t} q_t.(S dn_t + dd_t z)`` with ``P_tj = M_tj (q_t.k_j)(dn_t.v_j + dd_t)``
    (the diagonal, constant in ``b``, left out: it cancels against the key side). ``EXACT_DD`` (one key block):
    ``1/D_t`` and ``dd_t = -(do_t.n_t)/D_t^2`` from the numerator ``n_t`` and the normaliser ``D_t`` recomputed
    here in fp32 (written to ``INVD``, ``DD`` for the key side) instead of the forward's 16-bit output and its
    normaliser of rounded scores: with strong decay ``o_t ~ v_t``, and ``dn_t.v_t + dd_t`` cancels down to the
    rounding of those."""
    pk = tl.program_id(0)
    i = tl.program_id(1)
    pbh = tl.program_id(2)
    b = pbh // H
    h = pbh % H
    hk = h // (H // HK)
    N = tl.cdiv(T, BT)
    ar = tl.arange(0, BT)
    ot = i * BT + ar
    mt = ot < T
    ok = pk * BK + tl.arange(0, BK)
    mk = ok < K
    qrow = (b.to(tl.int64) * T + ot) * H + h
    krow = (b.to(tl.int64) * T + ot) * HK + hk
    st = ((b * HK + hk).to(tl.int64) * N + i)
    Bm = tl.zeros([BT, BT], dtype=tl.float32)
    dq = tl.zeros([BT, BK], dtype=tl.float32)
    for vb in tl.static_range(NV_BLK):
        ov = vb * BV + tl.arange(0, BV)
        mv = ov < V
        do = tl.load(DO + qrow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        v = tl.load(Vp + krow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        Bm += mm(do, tl.trans(v), PREC)
        S = tl.load(ST_S + st * K * V + ok[:, None] * V + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
        St = tl.trans(S)
        S_hi = St.to(do.dtype)
        dq += mm(do, S_hi, PREC)
        if SPLIT:
            # 16-bit operands: add the rounding residual of the fp32 state (dq cancels strongly)
            dq += mm(do, (St - S_hi.to(tl.float32)).to(do.dtype), PREC)
    if GATED:  # dq holds do S^T so far (the chunks before this one), Bm do v^T
        eq, _, _, M = _decay_tile(LG, krow, mt, BT)
        q = tl.load(Q + qrow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        k = tl.load(Kp + krow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        A = mm(q, tl.trans(k), PREC) * M  # [BT, BT] decayed scores, fp32
    if NORMALIZE:
        if EXACT_DD:
            z = tl.load(ST_Z + st * K + ok, mask=mk, other=0.0)
            invd = tl.where(mt, 1.0 / (tl.sum(A, 1) + eq * tl.sum(q.to(tl.float32) * z[None, :], 1) + eps), 0.0)
            dd = -(tl.sum(A * Bm, 1) + eq * tl.sum(q.to(tl.float32) * dq, 1)) * invd * invd  # -(do_t.n_t) / D_t^2
            tl.store(INVD + qrow, invd, mask=mt)
            tl.store(DD + qrow, dd, mask=mt)
        else:
            invd = tl.load(INVD + qrow, mask=mt, other=0.0)
            dd = tl.load(DD + qrow, mask=mt, other=0.0)
        Bm = Bm * invd[:, None] + dd[:, None]
        if not EXACT_DD:
            z = tl.load(ST_Z + st * K + ok, mask=mk, other=0.0)
        dq = dq * invd[:, None] + dd[:, None] * z[None, :]
    if GATED:
        P = tl.where(ar[:, None] > ar[None, :], A * Bm, 0.0)
        tl.store(DBQ + pk * NROWS + qrow, tl.sum(P, 1) + eq * tl.sum(q.to(tl.float32) * dq, 1), mask=mt)
        dq = dq * eq[:, None] + mm((Bm * M).to(k.dtype), k, PREC)
    else:
        Bm = tl.where(ar[:, None] >= ar[None, :], Bm, 0.0)
        k = tl.load(Kp + krow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        dq += mm(Bm.to(k.dtype), k, PREC)
    tl.store(DQ + qrow[:, None] * K + ok[None, :], dq.to(DQ.dtype.element_ty), mask=mt[:, None] & mk[None, :])


@triton.jit
def _la_bwd_dkv_kernel(
    Q, Kp, Vp, DO, INVD, DD,
    RS, RZ,  # reverse exclusive states [B,HK,N,K,V], [B,HK,N,K] (already summed over the group)
    DK, DV,
    LG, DBK,  # GATED: log decays [B,T,HK] fp32, DBK [NK_BLK,B,T,HK] fp32 (key side of dL/db, this key block)
    T, H, HK,
    NROWS,  # GATED: B*T*HK
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    NK_BLK: tl.constexpr, NV_BLK: tl.constexpr, G: tl.constexpr,
    NORMALIZE: tl.constexpr, PREC: tl.constexpr,
    GATED: tl.constexpr, HAS_RZ: tl.constexpr, SPLIT: tl.constexpr,
):
    """``dk_j = sum_{t>=j} (dn_t.v_j + dd_t) q_t + R v_j + r`` and ``dv_j = sum_{t>=j} (q_t.k_j) dn_t + R^T k_j``
    per chunk, the query heads of the group summed.

    ``GATED``: the intra-chunk pairs weigh ``M_tj``, the later chunks ``e^{c_last - c_j}`` (``R`` split hi + lo for
    16-bit inputs, ``SPLIT``: ``R v + r`` cancels as ``dq`` does; ``r`` read when ``HAS_RZ``); and the key side of
    ``dL/db_j``: ``sum_{t>j} P_tj + e^{c_last - c_j} k_j.(R v_j + r)`` (see :func:`_la_bwd_dq_kernel`)."""
    p0 = tl.program_id(0)
    i = tl.program_id(1)
    pbh = tl.program_id(2)
    b = pbh // HK
    hk = pbh % HK
    N = tl.cdiv(T, BT)
    ar = tl.arange(0, BT)
    ot = i * BT + ar
    mt = ot < T
    krow = (b.to(tl.int64) * T + ot) * HK + hk
    st = (pbh.to(tl.int64) * N + i)
    tri = ar[:, None] >= ar[None, :]  # [t, j]: t >= j
    if GATED:
        _, wk, _, M = _decay_tile(LG, krow, mt, BT)
    if p0 < NK_BLK:
        ok = p0 * BK + tl.arange(0, BK)
        mk = ok < K
        dk = tl.zeros([BT, BK], dtype=tl.float32)
        if GATED:
            db = tl.zeros([BT], dtype=tl.float32)
            k = tl.load(Kp + krow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        for g in tl.static_range(G):
            h = hk * G + g
            qrow = (b.to(tl.int64) * T + ot) * H + h
            Bm = tl.zeros([BT, BT], dtype=tl.float32)
            if NORMALIZE:
                invd = tl.load(INVD + qrow, mask=mt, other=0.0)
                dd = tl.load(DD + qrow, mask=mt, other=0.0)
            for vb in tl.static_range(NV_BLK):
                ov = vb * BV + tl.arange(0, BV)
                mv = ov < V
                do = tl.load(DO + qrow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
                v = tl.load(Vp + krow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
                Bm += mm(do, tl.trans(v), PREC)
            if NORMALIZE:
                Bm = Bm * invd[:, None] + dd[:, None]
            if GATED:
                Bm = Bm * M
            else:
                Bm = tl.where(tri, Bm, 0.0)
            q = tl.load(Q + qrow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
            dk += mm(tl.trans(Bm).to(q.dtype), q, PREC)
            if GATED:  # P over this key block, the diagonal left out
                db += tl.sum(tl.where(ar[:, None] > ar[None, :], mm(q, tl.trans(k), PREC) * Bm, 0.0), 0)
        if GATED:
            later = tl.zeros([BT, BK], dtype=tl.float32)  # R v_j + r: the chunks after this one
            for vb in tl.static_range(NV_BLK):
                ov = vb * BV + tl.arange(0, BV)
                mv = ov < V
                v = tl.load(Vp + krow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
                Rt = tl.trans(tl.load(RS + st * K * V + ok[:, None] * V + ov[None, :],
                                      mask=mk[:, None] & mv[None, :], other=0.0))
                R_hi = Rt.to(v.dtype)
                later += mm(v, R_hi, PREC)
                if SPLIT:
                    later += mm(v, (Rt - R_hi.to(tl.float32)).to(v.dtype), PREC)
            if HAS_RZ:
                later += tl.load(RZ + st * K + ok, mask=mk, other=0.0)[None, :]
            later = wk[:, None] * later
            dk += later
            tl.store(DBK + p0 * NROWS + krow, db + tl.sum(k.to(tl.float32) * later, 1), mask=mt)
        else:
            for vb in tl.static_range(NV_BLK):
                ov = vb * BV + tl.arange(0, BV)
                mv = ov < V
                v = tl.load(Vp + krow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
                R = tl.load(RS + st * K * V + ok[:, None] * V + ov[None, :], mask=mk[:, None] & mv[None, :],
                            other=0.0)
                dk += mm(v, tl.trans(R).to(v.dtype), PREC)
            if NORMALIZE:
                r = tl.load(RZ + st * K + ok, mask=mk, other=0.0)
                dk += r[None, :]
        tl.store(DK + krow[:, None] * K + ok[None, :], dk.to(DK.dtype.element_ty), mask=mt[:, None] & mk[None, :])
    else:
        ov = (p0 - NK_BLK) * BV + tl.arange(0, BV)
        mv = ov < V
        dv = tl.zeros([BT, BV], dtype=tl.float32)
        for g in tl.static_range(G):
            h = hk * G + g
            qrow = (b.to(tl.int64) * T + ot) * H + h
            A = tl.zeros([BT, BT], dtype=tl.float32)
            for kb in tl.static_range(NK_BLK):
                ok = kb * BK + tl.arange(0, BK)
                mk = ok < K
                q = tl.load(Q + qrow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
                k = tl.load(Kp + krow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
                A += mm(q, tl.trans(k), PREC)
            if GATED:
                A = A * M
            else:
                A = tl.where(tri, A, 0.0)
            do = tl.load(DO + qrow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
            if NORMALIZE:
                invd = tl.load(INVD + qrow, mask=mt, other=0.0)
                dn = (do.to(tl.float32) * invd[:, None]).to(do.dtype)
            else:
                dn = do
            dv += mm(tl.trans(A).to(dn.dtype), dn, PREC)
        if GATED:
            later_v = tl.zeros([BT, BV], dtype=tl.float32)  # R^T k_j
        for kb in tl.static_range(NK_BLK):
            ok = kb * BK + tl.arange(0, BK)
            mk = ok < K
            k = tl.load(Kp + krow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
            R = tl.load(RS + st * K * V + ok[:, None] * V + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
            if GATED:
                later_v += mm(k, R.to(k.dtype), PREC)
            else:
                dv += mm(k, R.to(k.dtype), PREC)
        if GATED:
            dv += wk[:, None] * later_v
        tl.store(DV + krow[:, None] * V + ov[None, :], dv.to(DV.dtype.element_ty), mask=mt[:, None] & mv[None, :])


# ---------------------------------------------------------------------------
# launch configuration (tuned on an H200; the measurements behind each default: kernels/README.md)

CONFIG = {  # picked by linearize.bench.tune_kernels on an H200 (triton 3.6)
    "bwd_bt": 128,  # chunk of the backward: half the per-chunk states of 64, and faster fwd+bwd with 8 warps
    "fwd_bt": 64,  # chunk of the forward: 128 was slower and crashed the tensor-core normaliser; 32 was slower
    "fwd_bv": 128,  # value block of the forward kernel (capped so the [K, BV] state fits)
    "fwd_warps": 8,
    "fwd_stages": 3,
    "split_below_waves": 0.5,  # cut sequences into segments only below this many programs per SM ...
    "fwd_waves": 4.0,  # ... and then into enough segments for this many (rounded down: no part-filled last wave)
    "fwd_norm_mma": True,  # normaliser reductions as tensor-core products: faster forwards
    "fwd_norm_split": False,  # hi + lo split of z in the normaliser: slower, no more accurate
    "fwd_rowsum_lanes": True,  # rowsum(A) as a lane reduction of the accumulator: one product and the spills fewer
    "bwd_bk": 128,
    "bwd_bv": 128,
    "bwd_warps": 8,
    "scan_warps": 4,
    # the forward's segment sums (long T, small batch): warps and [seg_bk, seg_bv] state tile per program;
    # 64 x 128 reads v once (faster than 64 x 64)
    "seg_warps": 4,
    "seg_bk": 64,
    "seg_bv": 128,
    # forwards that compute Hedgehog features in the kernel hold more live tiles: their own value block, warps,
    # chunk and pipeline depth (32-token chunks: no spills, and the 2-stage pipeline fits shared memory)
    "fused_bv": 128,
    "fused_warps": 8,
    "fused_bt": 32,
    "fused_stages": 2,
    # backward state scans: cut into segments below this many programs per SM (0 = never: slower on an H200),
    # then aim for scan_waves programs per SM
    "scan_split_below_waves": 0.0,
    "scan_waves": 8.0,
    # gated kernels (log_decay): chunks of the forward and of the backward (whose key-side kernel holds two
    # [BT, BT] fp32 tiles, the scores and their decays); value blocks, warps and segments as the plain ones
    "gated_fwd_bt": 64,
    "gated_bwd_bt": 64,
}


def norm_mma(cfg: dict, warps: int, fused: bool = False) -> bool:
    """Whether the forward's normaliser runs as tensor-core products (``fwd_norm_mma``): only with 8 or more
    warps and features read from memory. triton 3.6 miscompiled it on an H200 (bisected 2026-12-01): with 4
    warps (wrong outputs, or an out-of-range shared address at a value block of 64), and with the Hedgehog
    features computed in the kernel (normalised outputs off by 18-54% at D = 16 / 32, f = 12 / 16, and illegal
    addresses under compute-sanitizer); lane reductions gave the reference's result in both cases."""
    return bool(cfg["fwd_norm_mma"]) and warps >= 8 and not fused


def _fwd(q, k, v, S0, z0, normalize, eps, want_final, store_den, wqx=None, wkx=None, feps=0.0, make_fk=None,
         shift=0):
    """Launch the forward. With ``wqx`` (Hedgehog ``[W, -W]`` per head) ``q`` is raw and its features are
    computed in the kernel; so are ``k``'s unless the launch is segmented, whose segment sums need the key
    features in memory (``make_fk()``; the kernel then reads them instead of raw ``k``). ``shift > 0``: query
    ``t`` sees keys and values ``j <= t - shift`` only (the linear part of the window hybrid's two-pass forward;
    segmented only for a shift of one chunk)."""
    B, T, H, D = q.shape
    HK, V = k.shape[2], v.shape[-1]
    fused = wqx is not None
    K = wqx.shape[-1] if fused else D
    dev = q.device
    BT = CONFIG["fused_bt" if fused else "fwd_bt"]
    BK = pow2(K)
    BV, stages, warps = fwd_blocks(CONFIG, BK, V, q.dtype, fused=fused)
    NVB = triton.cdiv(V, BV)
    N = triton.cdiv(T, BT)
    progs = B * H * NVB
    # a shift of whole chunks lags the segment sums by as many chunks (seg_off); other shifts run one segment
    whole_chunks = shift % BT == 0
    seg_off = shift // BT if whole_chunks else 0
    nseg, seg_chunks = plan_segments(CONFIG, N, progs, dev) if whole_chunks else (1, max(N, 1))
    fuse_k = wkx is not None and nseg == 1
    if wkx is not None and not fuse_k:
        k = make_fk()
    o = new_empty((B, T, H, V), dtype=v.dtype, device=dev)
    den = new_empty((B, T, H), dtype=torch.float32, device=dev) if (store_den and normalize) else None
    f32 = torch.float32
    seg_S, seg_z = segment_starts(k, v, HK, (S0, z0) if S0 is not None else None, nseg, seg_chunks, BT,
                                  **segment_sum_launch(CONFIG), seg_off=seg_off)
    fin_S = new_empty((B, HK, K, V), dtype=f32, device=dev) if want_final else None
    fin_z = new_empty((B, HK, K), dtype=f32, device=dev) if want_final else None
    dummy = o
    grid = (NVB, B * H, nseg)
    launch(
        _la_fwd_kernel, grid,
        q, k, v, o, den if den is not None else dummy,
        seg_S if seg_S is not None else dummy, seg_z if seg_z is not None else dummy,
        fin_S if want_final else dummy, fin_z if want_final else dummy,
        wqx if wqx is not None else dummy, wkx if wkx is not None else dummy,
        T, H, HK, nseg, seg_chunks, eps, feps, shift,
        K=K, V=V, BK=BK, BV=BV, BT=BT, NORMALIZE=normalize, HAS_SEG=seg_S is not None,
        STORE_FINAL=want_final, SHIFTED=shift > 0, STORE_DEN=den is not None, NORM_MMA=norm_mma(CONFIG, warps, fused=fused),
        SPLIT=q.dtype != torch.float32 and CONFIG["fwd_norm_split"], ROWSUM_LANES=CONFIG["fwd_rowsum_lanes"],
        PREC=prec(q.dtype),
        D=D, BD=pow2(D), FUSE_Q=fused, FUSE_K=fuse_k,
        num_warps=warps, num_stages=stages,
    )
    return o, den, fin_S, fin_z


def _bwd(q, k, v, o, den, S0, z0, do, dS_f, dz_f, normalize, need_state_grads):
    B, T, H, K = q.shape
    HK, V = k.shape[2], v.shape[-1]
    G = H // HK
    dev = q.device
    BT = CONFIG["bwd_bt"] if q.dtype != torch.float32 else 64
    f32 = torch.float32
    N = triton.cdiv(T, BT)
    do = do.contiguous()
    invd = dd = None
    if normalize:
        invd, dd = row_stats(do, o, den)
    # forward-direction exclusive states (for dq)
    init_f = None
    if S0 is not None:
        init_f = (S0.to(f32).contiguous(), z0.to(f32).contiguous())
    st, stz, _, _ = chunk_states(k, v, heads=HK, cfg=CONFIG, do_z=normalize, init=init_f, BT=BT)
    # reverse exclusive states sum_{t in later chunks} q_t^T dn_t (+ dS_f), summed over the group
    init_r = None
    if dS_f is not None or (normalize and dz_f is not None):
        Sr = dS_f.to(f32).contiguous() if dS_f is not None else torch.zeros(B, HK, K, V, device=dev, dtype=f32)
        zr = None
        if normalize:
            zr = dz_f.to(f32).contiguous() if dz_f is not None else torch.zeros(B, HK, K, device=dev, dtype=f32)
        init_r = (Sr, zr)
    rs, rz, fin, finz = chunk_states(q, do, heads=HK, cfg=CONFIG, a=invd, u=dd, do_z=normalize, init=init_r,
                                     reverse=True, store_final=need_state_grads, BT=BT)
    BK = min(CONFIG["bwd_bk"], pow2(K))
    BV = min(CONFIG["bwd_bv"], pow2(V))
    if q.dtype == torch.float32:  # fp32 tiles are twice as large
        BK, BV = min(BK, 64), min(BV, 64)
    NKB, NVB = triton.cdiv(K, BK), triton.cdiv(V, BV)
    dq = new_empty(q.shape, dtype=q.dtype, device=dev)
    dk = new_empty(k.shape, dtype=k.dtype, device=dev)
    dv = new_empty(v.shape, dtype=v.dtype, device=dev)
    dummy = dq
    pr = prec(q.dtype)
    launch(
        _la_bwd_dq_kernel, (NKB, N, B * H),
        k, v, do, invd if normalize else dummy, dd if normalize else dummy, st, stz if normalize else dummy, dq,
        dummy, dummy, dummy, T, H, HK, 0, 0.0, K=K, V=V, BK=BK, BV=BV, BT=BT, NV_BLK=NVB, NORMALIZE=normalize,
        SPLIT=q.dtype != torch.float32, PREC=pr, GATED=False, EXACT_DD=False,
        num_warps=CONFIG["bwd_warps"],
    )
    launch(
        _la_bwd_dkv_kernel, (NKB + NVB, N, B * HK),
        q, k, v, do, invd if normalize else dummy, dd if normalize else dummy, rs, rz if normalize else dummy,
        dk, dv, dummy, dummy, T, H, HK, 0, K=K, V=V, BK=BK, BV=BV, BT=BT, NK_BLK=NKB, NV_BLK=NVB, G=G,
        NORMALIZE=normalize, PREC=pr, GATED=False, HAS_RZ=False, SPLIT=False, num_warps=CONFIG["bwd_warps"],
    )
    if not normalize and dz_f is not None:
        dk = (dk.to(f32) + dz_f.to(f32).unsqueeze(1)).to(k.dtype)
    dS0 = dz0 = None
    if need_state_grads:
        dS0 = fin
        if normalize:
            dz0 = finz
        else:
            dz0 = dz_f.to(f32).clone() if dz_f is not None else torch.zeros(B, HK, K, device=dev, dtype=f32)
    return dq, dk, dv, dS0, dz0


class _LinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, S0, z0, normalize, eps, output_final_state):
        needs_grad = any(ctx.needs_input_grad[:5])
        o, den, S_f, z_f = _fwd(q, k, v, S0, z0, normalize, eps, output_final_state, store_den=needs_grad)
        ctx.save_for_backward(q, k, v, o, den, S0, z0)
        ctx.normalize = normalize
        ctx.set_materialize_grads(False)
        if output_final_state:
            return o, S_f, z_f
        return o, None, None

    @staticmethod
    def backward(ctx, do, dS_f, dz_f):
        q, k, v, o, den, S0, z0 = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        need_state = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        dq, dk, dv, dS0, dz0 = _bwd(q, k, v, o, den, S0, z0, do, dS_f, dz_f, ctx.normalize, need_state)
        return dq, dk, dv, dS0, dz0, None, None, None


def _gated_fwd(q, k, v, lg, S0, z0, normalize, eps, want_final, store_den):
    """Launch the gated forward (``lg`` the log decays ``[B,T,HK]`` fp32); segmented like :func:`_fwd` when the
    grid would leave the GPU idle, each segment starting from the decayed sum of the segments before it."""
    B, T, H, K = q.shape
    HK, V = k.shape[2], v.shape[-1]
    dev = q.device
    BT = CONFIG["gated_fwd_bt"]
    BK = pow2(K)
    BV, stages, warps = fwd_blocks(CONFIG, BK, V, q.dtype)
    NVB = triton.cdiv(V, BV)
    N = triton.cdiv(T, BT)
    nseg, seg_chunks = plan_segments(CONFIG, N, B * H * NVB, dev)
    o = new_empty((B, T, H, V), dtype=v.dtype, device=dev)
    den = new_empty((B, T, H), dtype=torch.float32, device=dev) if (store_den and normalize) else None
    f32 = torch.float32
    seg_S, seg_z = gated_segment_starts(k, v, lg, (S0, z0) if S0 is not None else None, nseg, seg_chunks, BT,
                                        **segment_sum_launch(CONFIG))
    fin_S = new_empty((B, HK, K, V), dtype=f32, device=dev) if want_final else None
    fin_z = new_empty((B, HK, K), dtype=f32, device=dev) if want_final else None
    dummy = o
    launch(
        _la_gated_fwd_kernel, (NVB, B * H, nseg),
        q, k, v, lg, o, den if den is not None else dummy,
        seg_S if seg_S is not None else dummy, seg_z if seg_z is not None else dummy,
        fin_S if want_final else dummy, fin_z if want_final else dummy,
        T, H, HK, nseg, seg_chunks, eps,
        K=K, V=V, BK=BK, BV=BV, BT=BT, NORMALIZE=normalize, HAS_SEG=seg_S is not None, STORE_FINAL=want_final,
        STORE_DEN=den is not None, NORM_MMA=normalize and norm_mma(CONFIG, warps), PREC=prec(q.dtype),
        num_warps=warps, num_stages=stages,
    )
    return o, den, fin_S, fin_z


def _gated_bwd(q, k, v, lg, o, den, S0, z0, do, dS_f, dz_f, normalize, eps, need_state_grads):
    """Gradients of the gated forward: ``(dq, dk, dv, d log_decay, dS0, dz0)``. ``d log_decay_s = sum_{t>=s}
    dL/db_t`` (``b`` the cumulative log decay), with ``dL/db_t`` = its query side minus its key side (the kernels'
    ``DBQ``, ``DBK``: the terms where ``t`` is the later, resp. the earlier, position of a decayed weight) plus
    ``<S_f, dS_f> + <z_f, dz_f>`` at the last token."""
    B, T, H, K = q.shape
    HK, V = k.shape[2], v.shape[-1]
    G = H // HK
    dev = q.device
    BT = CONFIG["gated_bwd_bt"]
    f32 = torch.float32
    N = triton.cdiv(T, BT)
    BK = min(CONFIG["bwd_bk"], pow2(K))
    BV = min(CONFIG["bwd_bv"], pow2(V))
    if q.dtype == torch.float32:  # fp32 tiles are twice as large
        BK, BV = min(BK, 64), min(BV, 64)
    NKB, NVB = triton.cdiv(K, BK), triton.cdiv(V, BV)
    # 16-bit outputs are too coarse for dd = -(do.o)/D under strong decay: the dq kernel recomputes 1/D and dd
    # (one key block)
    exact_dd = normalize and q.dtype != torch.float32 and NKB == 1
    do = do.contiguous()
    invd = dd = None
    if exact_dd:
        invd, dd = (new_empty(den.shape, dtype=f32, device=dev) for _ in range(2))
    elif normalize:
        invd, dd = row_stats(do, o, den)
    warps = CONFIG["scan_warps"]
    init_f = (S0, z0) if S0 is not None else None
    # the backward's states from fp32-exact rows (split_rows): the terms of d log_decay that belong to pairs of
    # tokens on both sides of a position cancel between its query and key sides only if both see the same state;
    # the final state of this scan, too, enters it (<S_f, dS_f>)
    st, stz, S_f, z_f = gated_scan_states(k, v, lg, do_z=True, z_of_rows=True, split_rows=True, init=init_f,
                                          store_final=dS_f is not None or dz_f is not None, BT=BT, num_warps=warps)
    dq = new_empty(q.shape, dtype=q.dtype, device=dev)
    dk = new_empty(k.shape, dtype=k.dtype, device=dev)
    dv = new_empty(v.shape, dtype=v.dtype, device=dev)
    dbq = new_empty((NKB, B, T, H), dtype=f32, device=dev)
    dbk = new_empty((NKB, B, T, HK), dtype=f32, device=dev)
    dummy = dq
    pr = prec(q.dtype)
    launch(
        _la_bwd_dq_kernel, (NKB, N, B * H),
        k, v, do, invd if normalize else dummy, dd if normalize else dummy, st, stz if normalize else dummy, dq,
        q, lg, dbq, T, H, HK, B * T * H, eps, K=K, V=V, BK=BK, BV=BV, BT=BT, NV_BLK=NVB, NORMALIZE=normalize,
        SPLIT=q.dtype != torch.float32, PREC=pr, GATED=True, EXACT_DD=exact_dd, num_warps=CONFIG["bwd_warps"],
    )
    has_rz = normalize or dz_f is not None  # the reverse z state: sum dd q (normalised) and the decayed dz_f
    init_r = None
    if dS_f is not None or dz_f is not None:
        Sr = dS_f.to(f32).contiguous() if dS_f is not None else torch.zeros(B, HK, K, V, device=dev, dtype=f32)
        zr = None
        if has_rz:
            zr = dz_f.to(f32).contiguous() if dz_f is not None else torch.zeros(B, HK, K, device=dev, dtype=f32)
        init_r = (Sr, zr)
    # z sums dd q = (dd D) (q/D): the same rows q/D as S (S dn + dd z cancels in dk)
    rs, rz, fin, finz = gated_scan_states(q, do, lg, a=invd, u=dd / invd if normalize else None, do_z=has_rz,
                                          z_rows=normalize, z_of_rows=True, split_rows=True, init=init_r, reverse=True,
                                          store_final=need_state_grads, BT=BT, num_warps=warps)
    launch(
        _la_bwd_dkv_kernel, (NKB + NVB, N, B * HK),
        q, k, v, do, invd if normalize else dummy, dd if normalize else dummy, rs, rz if has_rz else dummy,
        dk, dv, lg, dbk, T, H, HK, B * T * HK, K=K, V=V, BK=BK, BV=BV, BT=BT, NK_BLK=NKB, NV_BLK=NVB, G=G,
        NORMALIZE=normalize, PREC=pr, GATED=True, HAS_RZ=has_rz, SPLIT=q.dtype != torch.float32,
        num_warps=CONFIG["bwd_warps"],
    )
    db = dbq.sum(0).view(B, T, HK, G).sum(-1) - dbk.sum(0)  # [B, T, HK]: dL/db_t
    if T and dS_f is not None:
        db[:, -1] += (S_f[:, :, 0] * dS_f.to(f32)).sum((-2, -1))
    if T and dz_f is not None:
        db[:, -1] += (z_f[:, :, 0] * dz_f.to(f32)).sum(-1)
    dlg = db.flip(1).cumsum(1).flip(1)  # d log_decay_s = sum_{t >= s} dL/db_t
    dS0 = dz0 = None
    if need_state_grads:
        dS0 = fin[:, :, 0]
        dz0 = finz[:, :, 0] if has_rz else torch.zeros(B, HK, K, device=dev, dtype=f32)
    return dq, dk, dv, dlg, dS0, dz0


class _GatedLinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lg, S0, z0, normalize, eps, output_final_state):
        needs_grad = any(ctx.needs_input_grad[:6])
        o, den, S_f, z_f = _gated_fwd(q, k, v, lg, S0, z0, normalize, eps, output_final_state, store_den=needs_grad)
        ctx.save_for_backward(q, k, v, lg, o, den, S0, z0)
        ctx.normalize = normalize
        ctx.eps = eps
        ctx.set_materialize_grads(False)
        if output_final_state:
            return o, S_f, z_f
        return o, None, None

    @staticmethod
    def backward(ctx, do, dS_f, dz_f):
        q, k, v, lg, o, den, S0, z0 = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        need_state = ctx.needs_input_grad[4] or ctx.needs_input_grad[5]
        dq, dk, dv, dlg, dS0, dz0 = _gated_bwd(q, k, v, lg, o, den, S0, z0, do, dS_f, dz_f, ctx.normalize, ctx.eps,
                                               need_state)
        return dq, dk, dv, dlg, dS0, dz0, None, None, None


def linear_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    normalize: bool = True,
    eps: float = 1e-6,
    initial_state: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    output_final_state: bool = False,
    log_decay: Optional[torch.Tensor] = None,  # [B, T, Hk], <= 0: gated (decayed) linear attention
):
    """Triton path of :func:`linearize.kernels.linear_attention`; ``log_decay`` runs the gated kernels (the
    plain ones are untouched without it)."""
    ensure_applied(q.device)  # this GPU's saved launch configuration (bench kernels --tune), once
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    S0 = z0 = None
    if initial_state is not None:
        S0, z0 = initial_state
        S0 = S0.float().contiguous()
        z0 = z0.float().contiguous()
    if log_decay is not None:
        if tuple(log_decay.shape) != tuple(k.shape[:3]):
            raise ValueError(f"log_decay must have shape [B, T, Hk]={tuple(k.shape[:3])}, got {tuple(log_decay.shape)}")
        lg = log_decay.float().contiguous()
        o, S_f, z_f = _GatedLinearAttention.apply(q, k, v, lg, S0, z0, normalize, float(eps), output_final_state)
        return o, ((S_f, z_f) if output_final_state else None)
    o, S_f, z_f = _LinearAttention.apply(q, k, v, S0, z0, normalize, float(eps), output_final_state)
    return o, ((S_f, z_f) if output_final_state else None)


def linear_attention_hedgehog_triton(
    q, k, v, weight_q, weight_k, *, normalize: bool = True, eps: float = 1e-6, feature_eps: float = 1e-12,
    initial_state: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, output_final_state: bool = False,
):
    """Triton path of :func:`linearize.kernels.linear_attention_hedgehog`: forward only (no autograd), the
    Hedgehog features of the raw ``q``, ``k`` computed inside the kernel."""

    ensure_applied(q.device)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    wqx, wkx = signed_projections(weight_q, weight_k, q.dtype)  # [H, D, 2f], [Hk, D, 2f]

    def make_fk():  # a segmented launch: as HedgehogFeatureMap (fp32 features, rounded to the inputs' dtype)
        return hedgehog_features_rounded(k, weight_k, feature_eps).contiguous()

    S0 = z0 = None
    if initial_state is not None:
        S0, z0 = initial_state[0].float().contiguous(), initial_state[1].float().contiguous()
    with torch.no_grad():
        o, _, S_f, z_f = _fwd(q, k, v, S0, z0, normalize, float(eps), output_final_state, False, wqx=wqx, wkx=wkx,
                              feps=float(feature_eps), make_fk=make_fk)
    return o, ((S_f, z_f) if output_final_state else None)


register("linear", CONFIG)  # tunable per GPU (tuning.py)

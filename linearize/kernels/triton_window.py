"""Triton kernels for the LoLCATs sliding-window hybrid, forward and backward.

Chunks of ``BT >= W`` tokens (64, or 128 for 64 < W <= 128 with 16-bit inputs). A query in chunk
``n`` sees its window inside chunks ``n-1`` and ``n``; everything older than the
window in chunk ``n-1`` (and in chunk ``n`` when ``W < BT``) is handled through
masked feature-map scores, and all tokens before chunk ``n-1`` through the
carried linear state ``(S, z)``, which therefore lags one chunk behind. Wider windows
(up to ``MAX_WINDOW``, 64-token chunks, ungated) reach ``NB = cdiv(W, 64)`` chunks back: the
two-pass forward with a window kernel that walks those key blocks (online softmax), and a backward
whose state lags ``NB`` chunks. The
forward is one fused sequential pass (softmax part, linear part and the shared
normaliser together), split into segments when the grid would not fill the
GPU. The backward recomputes scores from the saved row shift ``m`` and
denominator ``D`` (``[B,T,H]`` fp32 each): a query-side kernel gives ``dq``,
``dfq`` and the window-factor gradient, a key-side kernel ``dk``, ``dfk``,
``dv``. With log decays (gated linear attention) the forward is the single pass with decay factors from
cumulative sums over each chunk's span, the backward's chunk states come from the gated scans, and the decay's
gradient from ``fq.dfq - fk.dfk`` per token. Math in the kernel lab, kernels/README.md.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .chunked import window_linear_attention_chunked
from .reference import decayed_sum, drop_keys, hedgehog_features_rounded, needs_grad
from .triton_linear import _fwd as linear_fwd
from .triton_common import (
    chunk_states,
    fwd_blocks,
    gated_scan_states,
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
    to16,
)
from .tuning import ensure_applied, register

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _last(c, ar, BT: tl.constexpr):
    """The last element of a chunk's cumulative sum ``c`` [BT] (its total; ``tl.sum`` would round differently, and
    ``e^{total - c_last}`` must be exactly 1)."""
    return tl.sum(tl.where(ar == BT - 1, c, 0.0), 0)


@triton.jit
def _win_prev_tiles(Kr, FK, Vp, WKX, b, hk, otp, T, HK, od, ok, ov, md, mk, mv,
                    D: tl.constexpr, K: tl.constexpr, V: tl.constexpr, feps, FUSE_K: tl.constexpr,
                    PREC: tl.constexpr):
    """The raw keys, key features and values of the chunk whose rows are ``otp`` (zero before the sequence)."""
    mtp = otp >= 0
    prow = (b.to(tl.int64) * T + otp) * HK + hk
    kp = tl.load(Kr + prow[:, None] * D + od[None, :], mask=mtp[:, None] & md[None, :], other=0.0)
    if FUSE_K:  # keys before the sequence start must not count: zero their features
        fkp = hedgehog_tile(kp, WKX, hk, od, ok, md, mk, D, K, K // 2, feps, PREC)
        fkp = tl.where(mtp[:, None], fkp, 0.0).to(kp.dtype)
    else:
        fkp = tl.load(FK + prow[:, None] * K + ok[None, :], mask=mtp[:, None] & mk[None, :], other=0.0)
    vp = tl.load(Vp + prow[:, None] * V + ov[None, :], mask=mtp[:, None] & mv[None, :], other=0.0)
    return kp, fkp, vp


@triton.jit
def _win_fwd_kernel(
    Q, Kr, FQ, FK, Vp, WF,  # q [B,T,H,D], k [B,T,HK,D], fq [B,T,H,K], fk [B,T,HK,K], v [B,T,HK,V], wf [H] fp32
    O, MS, DEN,  # o [B,T,H,V]; m, den [B,T,H] fp32
    SEG_S, SEG_Z,  # lagged starting state per segment [B,HK,NSEG,K,V], [B,HK,NSEG,K]
    WQX, WKX,  # fused Hedgehog maps: [Wq, -Wq] [H,D,K], [Wk, -Wk] [HK,D,K] (FUSE_Q / FUSE_K: fq / fk not read)
    LG,  # GATED: log decays [B,T,HK] fp32
    T, H, HK, NSEG, SEG_CHUNKS, W, scale, eps, feps,
    D: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    HAS_LIN_CUR: tl.constexpr, HAS_SEG: tl.constexpr, STORE_STATS: tl.constexpr,
    PREC: tl.constexpr, FUSE_Q: tl.constexpr, FUSE_K: tl.constexpr, GATED: tl.constexpr,
):
    pv = tl.program_id(0)
    pbh = tl.program_id(1)
    ps = tl.program_id(2)
    b = pbh // H
    h = pbh % H
    hk = h // (H // HK)
    od = tl.arange(0, BD)
    ok = tl.arange(0, BK)
    ov = pv * BV + tl.arange(0, BV)
    md, mk, mv = od < D, ok < K, ov < V
    w = tl.load(WF + h).to(tl.float32)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    sbh = (b * HK + hk).to(tl.int64)
    if HAS_SEG:
        S += tl.load(SEG_S + (sbh * NSEG + ps) * K * V + ok[:, None] * V + ov[None, :],
                     mask=mk[:, None] & mv[None, :], other=0.0)
        z += tl.load(SEG_Z + (sbh * NSEG + ps) * K + ok, mask=mk, other=0.0)
    N = tl.cdiv(T, BT)
    c0 = ps * SEG_CHUNKS
    c1 = tl.minimum(c0 + SEG_CHUNKS, N)
    ar = tl.arange(0, BT)
    diff_c = ar[:, None] - ar[None, :]  # i - j inside the chunk
    diff_p = diff_c + BT  # i - j against the previous chunk
    for i in range(c0, c1):
        ot = i * BT + ar
        mt = ot < T
        otp = ot - BT
        mtp = otp >= 0
        qrow = (b.to(tl.int64) * T + ot) * H + h
        krow = (b.to(tl.int64) * T + ot) * HK + hk
        q = tl.load(Q + qrow[:, None] * D + od[None, :], mask=mt[:, None] & md[None, :], other=0.0)
        if FUSE_Q:  # rows past T get features too; their outputs are never stored
            fq = hedgehog_tile(q, WQX, h, od, ok, md, mk, D, K, K // 2, feps, PREC).to(q.dtype)
        else:
            fq = tl.load(FQ + qrow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        kc = tl.load(Kr + krow[:, None] * D + od[None, :], mask=mt[:, None] & md[None, :], other=0.0)
        kp, fkp, vp = _win_prev_tiles(Kr, FK, Vp, WKX, b, hk, otp, T, HK, od, ok, ov, md, mk, mv,
                                      D, K, V, feps, FUSE_K, PREC)
        vc = tl.load(Vp + krow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        s_c = mm(q, tl.trans(kc), PREC) * scale
        s_p = mm(q, tl.trans(kp), PREC) * scale
        win_c = (diff_c >= 0) & (diff_c < W)
        win_p = (diff_p < W) & mtp[None, :]
        lin_p = (diff_p >= W) & mtp[None, :]
        m = tl.maximum(tl.max(tl.where(win_c, s_c, NEG_INF), 1), tl.max(tl.where(win_p, s_p, NEG_INF), 1))
        m = tl.maximum(m, 0.0)
        em = tl.exp(-m)
        c = (1.0 - w) * em
        P_c = tl.where(win_c, w * tl.exp(s_c - m[:, None]), 0.0)
        a_p = mm(fq, tl.trans(fkp), PREC)
        if GATED:  # cumulative log decays over the span (previous chunk, this chunk), from its start
            lg_p = tl.load(LG + (b.to(tl.int64) * T + otp) * HK + hk, mask=mtp, other=0.0)
            lg_c = tl.load(LG + (b.to(tl.int64) * T + ot) * HK + hk, mask=mt, other=0.0)
            cp = tl.cumsum(lg_p, 0)
            tot_p = _last(cp, ar, BT)
            cc = tot_p + tl.cumsum(lg_c, 0)
            a_p = a_p * tl.exp(tl.minimum(cc[:, None] - cp[None, :], 0.0))  # e^{b_i - b_j} <= 1
            eq = tl.exp(cc)  # the lagged state sits just before the span
        P_p = tl.where(win_p, w * tl.exp(s_p - m[:, None]), tl.where(lin_p, c[:, None] * a_p, 0.0))
        if HAS_LIN_CUR:
            if FUSE_K:  # rows past T: zero features (they only meet queries past T here)
                fkc = hedgehog_tile(kc, WKX, hk, od, ok, md, mk, D, K, K // 2, feps, PREC)
                fkc = tl.where(mt[:, None], fkc, 0.0).to(kc.dtype)
            else:
                fkc = tl.load(FK + krow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
            a_c = mm(fq, tl.trans(fkc), PREC)
            if GATED:
                a_c = a_c * tl.exp(tl.where(diff_c >= W, cc[:, None] - cc[None, :], NEG_INF))
            P_c += tl.where(diff_c >= W, c[:, None] * a_c, 0.0)
        P_c = P_c.to(vc.dtype)  # rounded once: numerator and normaliser agree
        P_p = P_p.to(vp.dtype)
        num = mm(P_c, vc, PREC) + mm(P_p, vp, PREC)
        cs = c
        if GATED:
            cs = c * eq
        num += cs[:, None] * mm(fq, S.to(fq.dtype), PREC)
        den = (tl.sum(P_c.to(tl.float32), 1) + tl.sum(P_p.to(tl.float32), 1)
               + cs * tl.sum(fq.to(tl.float32) * z[None, :], 1) + eps * em)
        o = num / den[:, None]
        tl.store(O + qrow[:, None] * V + ov[None, :], o.to(O.dtype.element_ty), mask=mt[:, None] & mv[None, :])
        if STORE_STATS:
            if pv == 0:
                tl.store(MS + qrow, m, mask=mt)
                tl.store(DEN + qrow, den, mask=mt)
        # lagged state: add the previous chunk (its tokens are older than every window of chunk i+1)
        if GATED:  # the state moves to the previous chunk's end: S <- e^{total} S + sum_j e^{total - c_j} fk_j v_j^T
            keep = tl.exp(tot_p)
            fkd = (fkp.to(tl.float32) * tl.exp(tot_p - cp)[:, None]).to(fkp.dtype)  # rounded once for S and z
            S = S * keep + mm(tl.trans(fkd), vp, PREC)
            z = z * keep + tl.sum(fkd.to(tl.float32), 0)
        else:
            S += mm(tl.trans(fkp), vp, PREC)
            z += tl.sum(fkp.to(tl.float32), 0)


@triton.jit
def _win_softmax_kernel(
    Q, Kr, Vp, WF,  # q [B,T,H,D], k [B,T,HK,D], v [B,T,HK,V], wf [H] fp32
    OL, DL,  # the linear part from the shifted plain forward: o_lin = num_lin / den_lin [B,T,H,V], den_lin [B,T,H]
    O, MS, DEN,  # o [B,T,H,V]; m, den [B,T,H] fp32 (STORE_STATS)
    KEEP,  # HAS_KEEP: [B,T] bool, False = a padding key (left out of the window)
    T, H, HK, W, scale, eps,
    D: tl.constexpr, V: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    STORE_STATS: tl.constexpr, PREC: tl.constexpr, HAS_KEEP: tl.constexpr,
):
    """Second pass of the two-pass window forward (W <= BT): one program per chunk, head and value block adds the
    exact softmax over the window (keys of this chunk and the previous one) to the linear part and normalises.
    No carried state, so chunks run in parallel."""
    i = tl.program_id(0)
    pbh = tl.program_id(1)
    pv = tl.program_id(2)
    b = pbh // H
    h = pbh % H
    hk = h // (H // HK)
    od = tl.arange(0, BD)
    ov = pv * BV + tl.arange(0, BV)
    md, mv = od < D, ov < V
    w = tl.load(WF + h).to(tl.float32)
    ar = tl.arange(0, BT)
    diff_c = ar[:, None] - ar[None, :]
    ot = i * BT + ar
    mt = ot < T
    mtp = ot >= BT  # the previous chunk's rows exist
    qrow = (b.to(tl.int64) * T + ot) * H + h
    krow = (b.to(tl.int64) * T + ot) * HK + hk
    prow = krow - BT * HK
    q = tl.load(Q + qrow[:, None] * D + od[None, :], mask=mt[:, None] & md[None, :], other=0.0)
    kc = tl.load(Kr + krow[:, None] * D + od[None, :], mask=mt[:, None] & md[None, :], other=0.0)
    kp = tl.load(Kr + prow[:, None] * D + od[None, :], mask=mtp[:, None] & md[None, :], other=0.0)
    vc = tl.load(Vp + krow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
    vp = tl.load(Vp + prow[:, None] * V + ov[None, :], mask=mtp[:, None] & mv[None, :], other=0.0)
    s_c = mm(q, tl.trans(kc), PREC) * scale
    s_p = mm(q, tl.trans(kp), PREC) * scale
    win_c = (diff_c >= 0) & (diff_c < W)
    win_p = (diff_c + BT < W) & mtp[None, :]
    if HAS_KEEP:
        keep_c = tl.load(KEEP + b.to(tl.int64) * T + ot, mask=mt, other=0) != 0
        keep_p = tl.load(KEEP + b.to(tl.int64) * T + ot - BT, mask=mtp, other=0) != 0  # the previous chunk
        win_c = win_c & keep_c[None, :]
        win_p = win_p & keep_p[None, :]
    m = tl.maximum(tl.max(tl.where(win_c, s_c, NEG_INF), 1), tl.max(tl.where(win_p, s_p, NEG_INF), 1))
    m = tl.maximum(m, 0.0)
    em = tl.exp(-m)
    c = (1.0 - w) * em
    P_c = tl.where(win_c, w * tl.exp(s_c - m[:, None]), 0.0).to(vc.dtype)  # rounded once: num and den agree
    P_p = tl.where(win_p, w * tl.exp(s_p - m[:, None]), 0.0).to(vp.dtype)
    dl = tl.load(DL + qrow, mask=mt, other=0.0)
    ol = tl.load(OL + qrow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)
    num = mm(P_c, vc, PREC) + mm(P_p, vp, PREC) + (c * dl)[:, None] * ol
    den = tl.sum(P_c.to(tl.float32), 1) + tl.sum(P_p.to(tl.float32), 1) + c * dl + eps * em
    o = num / den[:, None]
    tl.store(O + qrow[:, None] * V + ov[None, :], o.to(O.dtype.element_ty), mask=mt[:, None] & mv[None, :])
    if STORE_STATS:
        if pv == 0:
            tl.store(MS + qrow, m, mask=mt)
            tl.store(DEN + qrow, den, mask=mt)


@triton.jit
def _win_softmax_wide_kernel(
    Q, Kr, Vp, WF, OL, DL, O, MS, DEN, KEEP,  # as _win_softmax_kernel
    T, H, HK, scale, eps,
    W: tl.constexpr, NB: tl.constexpr,  # window; chunks before the query's own that it reaches (cdiv(W, BT))
    D: tl.constexpr, V: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    STORE_STATS: tl.constexpr, PREC: tl.constexpr, HAS_KEEP: tl.constexpr,
):
    """:func:`_win_softmax_kernel` for windows wider than a chunk (``BT < W <= NB * BT``): the window spans this
    chunk and the ``NB`` before it, walked as key blocks with an online softmax (running row maximum from 0, the
    normaliser's floor, as the narrow kernel's clamp)."""
    i = tl.program_id(0)
    pbh = tl.program_id(1)
    pv = tl.program_id(2)
    b = pbh // H
    h = pbh % H
    hk = h // (H // HK)
    od = tl.arange(0, BD)
    ov = pv * BV + tl.arange(0, BV)
    md, mv = od < D, ov < V
    w = tl.load(WF + h).to(tl.float32)
    ar = tl.arange(0, BT)
    ot = i * BT + ar
    mt = ot < T
    qrow = (b.to(tl.int64) * T + ot) * H + h
    q = tl.load(Q + qrow[:, None] * D + od[None, :], mask=mt[:, None] & md[None, :], other=0.0)
    m = tl.zeros([BT], dtype=tl.float32)
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    lsum = tl.zeros([BT], dtype=tl.float32)
    for jc in range(NB + 1):  # key block i - jc
        oj = ot - jc * BT
        mj = (oj >= 0) & (oj < T)
        krow = (b.to(tl.int64) * T + oj) * HK + hk
        kj = tl.load(Kr + krow[:, None] * D + od[None, :], mask=mj[:, None] & md[None, :], other=0.0)
        vj = tl.load(Vp + krow[:, None] * V + ov[None, :], mask=mj[:, None] & mv[None, :], other=0.0)
        diff = jc * BT + ar[:, None] - ar[None, :]
        win = (diff >= 0) & (diff < W) & mj[None, :]
        if HAS_KEEP:
            win = win & (tl.load(KEEP + b.to(tl.int64) * T + oj, mask=mj, other=0) != 0)[None, :]
        s = mm(q, tl.trans(kj), PREC) * scale
        m_new = tl.maximum(m, tl.max(tl.where(win, s, NEG_INF), 1))
        alpha = tl.exp(m - m_new)
        # rounded once (num and den agree), to nearest under the interpreter too: over a window of thousands of
        # keys the interpreter's truncating casts would bias every row's sums the same way
        P = to16(tl.where(win, w * tl.exp(s - m_new[:, None]), 0.0), Vp.dtype.element_ty)
        acc = acc * alpha[:, None] + mm(P, vj, PREC)
        lsum = lsum * alpha + tl.sum(P.to(tl.float32), 1)
        m = m_new
    em = tl.exp(-m)
    c = (1.0 - w) * em
    dl = tl.load(DL + qrow, mask=mt, other=0.0)
    ol = tl.load(OL + qrow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)
    num = acc + (c * dl)[:, None] * ol
    den = lsum + c * dl + eps * em
    o = num / den[:, None]
    tl.store(O + qrow[:, None] * V + ov[None, :], o.to(O.dtype.element_ty), mask=mt[:, None] & mv[None, :])
    if STORE_STATS:
        if pv == 0:
            tl.store(MS + qrow, m, mask=mt)
            tl.store(DEN + qrow, den, mask=mt)


@triton.jit
def _win_bwd_q_wide_kernel(
    Q, Kr, FQ, FK, Vp, WF, DO, MS, INVD, DDEN,
    ST_S, ST_Z,  # forward exclusive per-chunk states of (fk, v) [B,HK,N,K,V], [B,HK,N,K]
    DQ, DFQ, DW,
    T, H, HK, scale,
    W: tl.constexpr, NB: tl.constexpr,
    D: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, NV_BLK: tl.constexpr,
    PREC: tl.constexpr,
):
    """Query side of the backward for windows wider than a chunk (ungated): :func:`_win_bwd_q_kernel` with the
    key blocks ``i - NB .. i`` walked one by one and the state lagging ``NB`` chunks."""
    i = tl.program_id(0)
    pbh = tl.program_id(1)
    b = pbh // H
    h = pbh % H
    hk = h // (H // HK)
    N = tl.cdiv(T, BT)
    od = tl.arange(0, BD)
    ok = tl.arange(0, BK)
    md, mk = od < D, ok < K
    w = tl.load(WF + h).to(tl.float32)
    ar = tl.arange(0, BT)
    ot = i * BT + ar
    mt = ot < T
    qrow = (b.to(tl.int64) * T + ot) * H + h
    q = tl.load(Q + qrow[:, None] * D + od[None, :], mask=mt[:, None] & md[None, :], other=0.0)
    fq = tl.load(FQ + qrow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
    m = tl.load(MS + qrow, mask=mt, other=0.0)
    invd = tl.load(INVD + qrow, mask=mt, other=0.0)
    dD = tl.load(DDEN + qrow, mask=mt, other=0.0)
    em = tl.exp(-m)
    c = (1.0 - w) * em
    # the state part: u = (dN S^T) + dD z, with the state before chunk i - NB (all of whose tokens are linear)
    st = (b * HK + hk).to(tl.int64) * N + tl.maximum(i - NB, 0)
    u = tl.zeros([BT, BK], dtype=tl.float32)
    for vb in tl.static_range(NV_BLK):
        ov = vb * BV + tl.arange(0, BV)
        mv = ov < V
        do = tl.load(DO + qrow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        S = tl.load(ST_S + st * K * V + ok[:, None] * V + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
        St = tl.trans(S)
        S_hi = St.to(do.dtype)
        u += mm(do, S_hi, PREC)
        if PREC != "ieee":
            u += mm(do, (St - S_hi.to(tl.float32)).to(do.dtype), PREC)
    z = tl.load(ST_Z + st * K + ok, mask=mk, other=0.0)
    u = u * invd[:, None] + dD[:, None] * z[None, :]
    dq = tl.zeros([BT, BD], dtype=tl.float32)
    dw = tl.zeros([BT], dtype=tl.float32)
    for jc in range(NB + 1):  # key block i - jc (a loop, not unrolled: fewer spills)
        oj = ot - jc * BT
        mj = (oj >= 0) & (oj < T)
        krow = (b.to(tl.int64) * T + oj) * HK + hk
        kj = tl.load(Kr + krow[:, None] * D + od[None, :], mask=mj[:, None] & md[None, :], other=0.0)
        diff = jc * BT + ar[:, None] - ar[None, :]
        win = (diff >= 0) & (diff < W) & mj[None, :]
        p = tl.where(win, tl.exp(mm(q, tl.trans(kj), PREC) * scale - m[:, None]), 0.0)
        g = tl.zeros([BT, BT], dtype=tl.float32)  # g[t, j] = dN_t . v_j + dD_t  (dN = do / D)
        for vb in tl.static_range(NV_BLK):
            ov = vb * BV + tl.arange(0, BV)
            mv = ov < V
            do = tl.load(DO + qrow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
            vj = tl.load(Vp + krow[:, None] * V + ov[None, :], mask=mj[:, None] & mv[None, :], other=0.0)
            g += mm(do, tl.trans(vj), PREC)
        g = g * invd[:, None] + dD[:, None]
        dq += mm((w * p * g).to(kj.dtype), kj, PREC)
        dw += tl.sum(p * g, 1)
        if jc * BT + BT - 1 >= W:  # this block holds pairs older than the window (linear)
            fkj = tl.load(FK + krow[:, None] * K + ok[None, :], mask=mj[:, None] & mk[None, :], other=0.0)
            u += mm(tl.where((diff >= W) & mj[None, :], g, 0.0).to(fkj.dtype), fkj, PREC)
    fqu = tl.sum(fq.to(tl.float32) * u, 1)
    dw = dw - em * fqu
    tl.store(DQ + qrow[:, None] * D + od[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=mt[:, None] & md[None, :])
    tl.store(DFQ + qrow[:, None] * K + ok[None, :], (c[:, None] * u).to(DFQ.dtype.element_ty),
             mask=mt[:, None] & mk[None, :])
    tl.store(DW + qrow, dw, mask=mt)


@triton.jit
def _win_bwd_q_kernel(
    Q, Kr, FQ, FK, Vp, WF, DO, MS, INVD, DDEN,
    ST_S, ST_Z,  # forward exclusive per-chunk states of (fk, v) [B,HK,N,K,V], [B,HK,N,K]
    DQ, DFQ, DW,  # DW [B,T,H] fp32 per-row window-factor gradient
    LG, DBQ,  # GATED: log decays [B,T,HK] fp32; per-row fq.dfq [B,T,H] fp32 (the query side of d b_t)
    T, H, HK, W, scale,
    D: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, NV_BLK: tl.constexpr,
    HAS_LIN_CUR: tl.constexpr, PREC: tl.constexpr, GATED: tl.constexpr,
):
    i = tl.program_id(0)
    pbh = tl.program_id(1)
    b = pbh // H
    h = pbh % H
    hk = h // (H // HK)
    N = tl.cdiv(T, BT)
    od = tl.arange(0, BD)
    ok = tl.arange(0, BK)
    md, mk = od < D, ok < K
    w = tl.load(WF + h).to(tl.float32)
    ar = tl.arange(0, BT)
    diff_c = ar[:, None] - ar[None, :]
    diff_p = diff_c + BT
    ot = i * BT + ar
    mt = ot < T
    otp = ot - BT
    mtp = otp >= 0
    qrow = (b.to(tl.int64) * T + ot) * H + h
    krow = (b.to(tl.int64) * T + ot) * HK + hk
    prow = (b.to(tl.int64) * T + otp) * HK + hk
    q = tl.load(Q + qrow[:, None] * D + od[None, :], mask=mt[:, None] & md[None, :], other=0.0)
    fq = tl.load(FQ + qrow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
    kc = tl.load(Kr + krow[:, None] * D + od[None, :], mask=mt[:, None] & md[None, :], other=0.0)
    kp = tl.load(Kr + prow[:, None] * D + od[None, :], mask=mtp[:, None] & md[None, :], other=0.0)
    fkp = tl.load(FK + prow[:, None] * K + ok[None, :], mask=mtp[:, None] & mk[None, :], other=0.0)
    m = tl.load(MS + qrow, mask=mt, other=0.0)
    invd = tl.load(INVD + qrow, mask=mt, other=0.0)
    dD = tl.load(DDEN + qrow, mask=mt, other=0.0)
    em = tl.exp(-m)
    c = (1.0 - w) * em
    win_c = (diff_c >= 0) & (diff_c < W)
    win_p = (diff_p < W) & mtp[None, :]
    lin_p = (diff_p >= W) & mtp[None, :]
    p_c = tl.where(win_c, tl.exp(mm(q, tl.trans(kc), PREC) * scale - m[:, None]), 0.0)
    p_p = tl.where(win_p, tl.exp(mm(q, tl.trans(kp), PREC) * scale - m[:, None]), 0.0)
    if GATED:  # as in the forward: cumulative log decays over (previous chunk, this chunk)
        lg_p = tl.load(LG + (b.to(tl.int64) * T + otp) * HK + hk, mask=mtp, other=0.0)
        lg_c = tl.load(LG + (b.to(tl.int64) * T + ot) * HK + hk, mask=mt, other=0.0)
        cp = tl.cumsum(lg_p, 0)
        cc = _last(cp, ar, BT) + tl.cumsum(lg_c, 0)
        dec_p = tl.exp(tl.minimum(cc[:, None] - cp[None, :], 0.0))  # [t, j]: e^{b_t - b_j}
        dec_c = tl.exp(tl.where(diff_c >= 0, cc[:, None] - cc[None, :], NEG_INF))
    # g[t, j] = dN_t . v_j + dD_t  (dN = do / D)
    g_c = tl.zeros([BT, BT], dtype=tl.float32)
    g_p = tl.zeros([BT, BT], dtype=tl.float32)
    u = tl.zeros([BT, BK], dtype=tl.float32)
    sl = tl.maximum(i - 1, 0)  # lagged state index
    st = (b * HK + hk).to(tl.int64) * N + sl
    for vb in tl.static_range(NV_BLK):
        ov = vb * BV + tl.arange(0, BV)
        mv = ov < V
        do = tl.load(DO + qrow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        vc = tl.load(Vp + krow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        vp = tl.load(Vp + prow[:, None] * V + ov[None, :], mask=mtp[:, None] & mv[None, :], other=0.0)
        g_c += mm(do, tl.trans(vc), PREC)
        g_p += mm(do, tl.trans(vp), PREC)
        S = tl.load(ST_S + st * K * V + ok[:, None] * V + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
        St = tl.trans(S)
        S_hi = St.to(do.dtype)
        u += mm(do, S_hi, PREC)
        if PREC != "ieee":
            u += mm(do, (St - S_hi.to(tl.float32)).to(do.dtype), PREC)
    g_c = g_c * invd[:, None] + dD[:, None]
    g_p = g_p * invd[:, None] + dD[:, None]
    z = tl.load(ST_Z + st * K + ok, mask=mk, other=0.0)
    u = u * invd[:, None] + dD[:, None] * z[None, :]
    ds_c = w * p_c * g_c
    ds_p = w * p_p * g_p
    dq = (mm(ds_c.to(kc.dtype), kc, PREC) + mm(ds_p.to(kp.dtype), kp, PREC)) * scale
    gl_p = tl.where(lin_p, g_p, 0.0)
    gl_c = tl.where(diff_c >= W, g_c, 0.0)
    if GATED:
        u = u * tl.exp(cc)[:, None]  # the lagged state sits just before the span
        gl_p = gl_p * dec_p
        gl_c = gl_c * dec_c
    u += mm(gl_p.to(fkp.dtype), fkp, PREC)
    if HAS_LIN_CUR:
        fkc = tl.load(FK + krow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        u += mm(gl_c.to(fkc.dtype), fkc, PREC)
    dfq = c[:, None] * u
    fqu = tl.sum(fq.to(tl.float32) * u, 1)
    dw = tl.sum(p_c * g_c, 1) + tl.sum(p_p * g_p, 1) - em * fqu
    if GATED:
        tl.store(DBQ + qrow, c * fqu, mask=mt)
    tl.store(DQ + qrow[:, None] * D + od[None, :], dq.to(DQ.dtype.element_ty), mask=mt[:, None] & md[None, :])
    tl.store(DFQ + qrow[:, None] * K + ok[None, :], dfq.to(DFQ.dtype.element_ty), mask=mt[:, None] & mk[None, :])
    tl.store(DW + qrow, dw, mask=mt)


@triton.jit
def _win_kv_pairs(Q, FQ, DO, MS, INVD, DDEN, k, fk, v, c0, c1, dk, dfk, dv, b, h, n, qq, T, H, W, scale, w,
                  od, ok, ovf, md, mk, mvf, ar, D: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, PREC: tl.constexpr, GATED: tl.constexpr):
    """One (query head ``h``, query chunk ``n + qq``) block of :func:`_win_bwd_kv_kernel`: the window and in-reach
    linear pairs' gradients added to the key chunk's ``dk``, ``dfk``, ``dv`` (returned). ``c0`` / ``c1``: the
    gated cumulative log decays (``qq`` 0 or 1 only)."""
    ot = (n + qq) * BT + ar
    mt = ot < T
    qrow = (b.to(tl.int64) * T + ot) * H + h
    q = tl.load(Q + qrow[:, None] * D + od[None, :], mask=mt[:, None] & md[None, :], other=0.0)
    fq = tl.load(FQ + qrow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
    do = tl.load(DO + qrow[:, None] * V + ovf[None, :], mask=mt[:, None] & mvf[None, :], other=0.0)
    m = tl.load(MS + qrow, mask=mt, other=0.0)
    invd = tl.load(INVD + qrow, mask=mt, other=0.0)
    dD = tl.load(DDEN + qrow, mask=mt, other=0.0)
    diff = qq * BT + ar[:, None] - ar[None, :]  # [t, j]
    win = (diff >= 0) & (diff < W) & mt[:, None]
    lin = (diff >= W) & mt[:, None]
    p = tl.where(win, tl.exp(mm(q, tl.trans(k), PREC) * scale - m[:, None]), 0.0)
    a = tl.where(lin, mm(fq, tl.trans(fk), PREC), 0.0)
    gg = mm(do, tl.trans(v), PREC) * invd[:, None] + dD[:, None]
    c = (1.0 - w) * tl.exp(-m)
    ds = w * p * gg
    dk += mm(tl.trans(ds).to(q.dtype), q, PREC)
    if GATED:  # the linear pairs weigh e^{b_t - b_j}
        if qq == 0:
            dec = tl.exp(tl.where(lin, c0[:, None] - c0[None, :], NEG_INF))
        else:
            dec = tl.exp(tl.where(lin, c1[:, None] - c0[None, :], NEG_INF))
        cl = c[:, None] * dec  # [t, j]
        Pm = (w * p + cl * a) * invd[:, None]
        dv += mm(tl.trans(Pm).to(do.dtype), do, PREC)
        dfk += mm(tl.trans(cl * gg).to(fq.dtype), fq, PREC)
    else:
        Pm = (w * p + c[:, None] * a) * invd[:, None]
        dv += mm(tl.trans(Pm).to(do.dtype), do, PREC)
        dfk += mm(tl.trans(tl.where(lin, c[:, None] * gg, 0.0)).to(fq.dtype), fq, PREC)
    return dk, dfk, dv


@triton.jit
def _win_bwd_kv_kernel(
    Q, Kr, FQ, FK, Vp, WF, DO, MS, INVD, DDEN,
    RS, RZ,  # reverse exclusive states of (c/D fq, do) [B,HK,N,K,V], [B,HK,N,K]
    DK, DFK, DV,
    LG, DBK,  # GATED: log decays [B,T,HK] fp32; per-row fk.dfk [B,T,HK] fp32 (the key side of d b_t)
    T, H, HK, W, scale,
    D: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, NV_BLK: tl.constexpr,
    G: tl.constexpr, PREC: tl.constexpr, GATED: tl.constexpr, NB: tl.constexpr = 1,
):
    """Key side of the backward: chunk ``n``'s keys meet the queries of chunks ``n .. n + NB`` directly (``NB``
    = cdiv(W, BT); more than 1 only ungated) and all later ones through the reverse state."""
    n = tl.program_id(0)
    pbh = tl.program_id(1)
    b = pbh // HK
    hk = pbh % HK
    N = tl.cdiv(T, BT)
    od = tl.arange(0, BD)
    ok = tl.arange(0, BK)
    ovf = tl.arange(0, BV * NV_BLK)
    md, mk, mvf = od < D, ok < K, ovf < V
    ar = tl.arange(0, BT)
    oj = n * BT + ar
    mj = oj < T
    krow = (b.to(tl.int64) * T + oj) * HK + hk
    k = tl.load(Kr + krow[:, None] * D + od[None, :], mask=mj[:, None] & md[None, :], other=0.0)
    fk = tl.load(FK + krow[:, None] * K + ok[None, :], mask=mj[:, None] & mk[None, :], other=0.0)
    v = tl.load(Vp + krow[:, None] * V + ovf[None, :], mask=mj[:, None] & mvf[None, :], other=0.0)
    dk = tl.zeros([BT, BD], dtype=tl.float32)
    dfk = tl.zeros([BT, BK], dtype=tl.float32)
    dv = tl.zeros([BT, BV * NV_BLK], dtype=tl.float32)
    if GATED:  # cumulative log decays over this chunk (c0) and the next (c1), from this chunk's start
        on = (n + 1) * BT + ar
        lg0 = tl.load(LG + (b.to(tl.int64) * T + oj) * HK + hk, mask=mj, other=0.0)
        lg1 = tl.load(LG + (b.to(tl.int64) * T + on) * HK + hk, mask=on < T, other=0.0)
        c0 = tl.cumsum(lg0, 0)
        c1 = _last(c0, ar, BT) + tl.cumsum(lg1, 0)
    else:  # not read
        c0 = tl.zeros([BT], dtype=tl.float32)
        c1 = c0
    for g in tl.static_range(G):
        h = hk * G + g
        w = tl.load(WF + h).to(tl.float32)
        if NB == 1:
            for qq in tl.static_range(2):
                dk, dfk, dv = _win_kv_pairs(Q, FQ, DO, MS, INVD, DDEN, k, fk, v, c0, c1, dk, dfk, dv, b, h, n, qq, T,
                                            H, W, scale, w, od, ok, ovf, md, mk, mvf, ar, D, K, V, BT, PREC, GATED)
        else:  # wide windows (ungated): a loop, not unrolled (NB + 1 unrolled blocks spill 14 KB per thread)
            for qq in range(NB + 1):
                dk, dfk, dv = _win_kv_pairs(Q, FQ, DO, MS, INVD, DDEN, k, fk, v, c0, c1, dk, dfk, dv, b, h, n, qq, T,
                                            H, W, scale, w, od, ok, ovf, md, mk, mvf, ar, D, K, V, BT, PREC, False)
    # queries in chunks >= n + NB + 1 see chunk n only through the linear state
    if n + NB < N:
        st = pbh.to(tl.int64) * N + n + NB
        R = tl.load(RS + st * K * V + ok[:, None] * V + ovf[None, :], mask=mk[:, None] & mvf[None, :], other=0.0)
        r = tl.load(RZ + st * K + ok, mask=mk, other=0.0)
        if GATED:  # the reverse state sits at the next chunk's end: e^{b_end - b_j}
            er = tl.exp(tl.minimum(_last(c1, ar, BT) - c0, 0.0))[:, None]
            dfk += er * (mm(v, tl.trans(R).to(v.dtype), PREC) + r[None, :])
            dv += er * mm(fk, R.to(fk.dtype), PREC)
        else:
            dfk += mm(v, tl.trans(R).to(v.dtype), PREC)
            dv += mm(fk, R.to(fk.dtype), PREC)
            dfk += r[None, :]
    if GATED:
        tl.store(DBK + krow, tl.sum(fk.to(tl.float32) * dfk, 1), mask=mj)
    tl.store(DK + krow[:, None] * D + od[None, :], (dk * scale).to(DK.dtype.element_ty), mask=mj[:, None] & md[None, :])
    tl.store(DFK + krow[:, None] * K + ok[None, :], dfk.to(DFK.dtype.element_ty), mask=mj[:, None] & mk[None, :])
    tl.store(DV + krow[:, None] * V + ovf[None, :], dv.to(DV.dtype.element_ty), mask=mj[:, None] & mvf[None, :])


CONFIG = {  # picked by linearize.bench.tune_kernels on an H200 (triton 3.6); measurements in kernels/README.md
    "fwd_bv": 128,
    "fwd_warps": 8,
    "fwd_stages": 2,
    "split_below_waves": 0.5,
    "fwd_waves": 4.0,
    "bwd_warps": 4,
    "scan_warps": 4,
    # the forward's segment sums (long T, small batch): warps and [seg_bk, seg_bv] state tile per program;
    # 64 x 128 reads v once (faster than 64 x 64)
    "seg_warps": 4,
    "seg_bk": 64,
    "seg_bv": 128,
    # forwards that compute Hedgehog features in the kernel hold more live tiles: their own value block and warps
    "fused_bv": 128,
    "fused_warps": 8,
    "scan_split_below_waves": 0.0,  # as in triton_linear.CONFIG (segmented scans were slower)
    "scan_waves": 8.0,
    # two-pass forward for W <= 64 (segmented launches when W is whole chunks of the linear forward: 64, or 32 / 64
    # with fused features): the plain linear forward on keys and values shifted by W, then a chunk-parallel
    # softmax-window kernel that adds the window and normalises; no carried state beside the score tiles, so no
    # spills, and faster than the single pass with 4 softmax warps (slower with 8)
    "fwd_two_pass": True,
    "softmax_warps": 4,
    # the backward's two kernels for windows over 128 (their key blocks a loop, not unrolled): 16 / 284 bytes spilled
    # per thread at 8 warps against 804 / 2,436 at 4 (query / key side, W = 256, K = V = D = 128, bf16, sm_90a
    # offline, triton 3.6; kernels/regs_offline.py); not yet timed on a GPU
    "wide_bwd_warps": 8,
}


#: widest window the Triton kernels run, the widest a recipe allows (wider ones: the chunked PyTorch path, which
#: copies the keys and values once per 64-token block the window spans); a window of ``W`` tokens walks
#: cdiv(W, 64) + 1 key blocks per query chunk, in loops (registers and shared memory do not grow with ``W``)
MAX_WINDOW = 4096


def _chunk_for(window: int, dtype: torch.dtype) -> Optional[int]:
    """The chunk for window ``W``: 64 when ``W`` fits it, 128 up to 128 (16-bit inputs only), 64 again for wider
    windows up to :data:`MAX_WINDOW` (fp32 from 65: the wide kernels walk several 64-token key blocks), else None
    (the chunked PyTorch path). fp32 128-token chunks are not built: with exact fp32 products their kernels spill
    50-120 KB per thread, ptxas (triton 3.6) ran past 150 s on each, and the key-side backward needs 320 KB of
    shared memory (sm_90a, compiled offline, 2026-12-01)."""
    if window <= 64:
        return 64
    if window <= 128 and dtype != torch.float32:
        return 128
    if window <= MAX_WINDOW:
        return 64
    return None


def _blocks_back(window: int, dtype: torch.dtype) -> int:
    """Chunks before a query's own that its window reaches: 1, or cdiv(W, 64) for the wide kernels."""
    return triton.cdiv(window, _chunk_for(window, dtype))


def supported(window: int, dtype: torch.dtype) -> bool:
    return _chunk_for(window, dtype) is not None


def wide(window: int, dtype: torch.dtype) -> bool:
    """Whether window ``W`` runs the wide kernels (several key blocks per query chunk; no log decay there)."""
    return supported(window, dtype) and _blocks_back(window, dtype) > 1


def _fwd(q, k, fq, fk, v, wf, W, scale, eps, S0, z0, store_stats, wqx=None, wkx=None, feps=0.0, make_fk=None,
         keep=None, lg=None):
    """Launch the forward. ``fq`` / ``fk`` None: computed inside the kernel from ``wqx`` / ``wkx`` (Hedgehog,
    ``[W, -W]`` per head); a segmented launch needs ``fk`` in memory for its segment sums (``make_fk()``).
    ``lg`` (log decays ``[B, T, Hk]`` fp32): the gated single pass, unsegmented."""
    B, T, H, D = q.shape
    HK, K, V = k.shape[2], (fq if fq is not None else wqx).shape[-1], v.shape[-1]
    dev = q.device
    BT = _chunk_for(W, q.dtype)
    BD, BK = pow2(D), pow2(K)
    BV, stages, warps = fwd_blocks(CONFIG, BK, V, q.dtype, fused=wqx is not None)
    NVB = triton.cdiv(V, BV)
    N = triton.cdiv(T, BT)
    progs = B * H * NVB
    nseg, seg_chunks = plan_segments(CONFIG, N, progs, dev) if lg is None else (1, N)
    if fk is None and nseg > 1:
        fk = make_fk()
    f32 = torch.float32
    o = new_empty((B, T, H, V), dtype=v.dtype, device=dev)
    ms = new_empty((B, T, H), dtype=f32, device=dev) if store_stats else None
    den = new_empty((B, T, H), dtype=f32, device=dev) if store_stats else None
    if wide(W, q.dtype) or keep is not None or (lg is None and CONFIG["fwd_two_pass"] and BT == 64
                                                and (nseg == 1 or W == BT)):
        _fwd_two_pass(q, k, fq, fk, v, wf, W, scale, eps, S0, z0, o, ms, den, wqx, wkx, feps, make_fk, keep)
        return o, ms, den
    # the carried linear state lags one chunk: each segment starts from the chunks before its first one's predecessor
    seg_S, seg_z = segment_starts(fk, v, HK, (S0, z0) if S0 is not None else None, nseg, seg_chunks, BT,
                                  **segment_sum_launch(CONFIG), seg_off=1)
    dummy = o
    launch(
        _win_fwd_kernel, (NVB, B * H, nseg),
        q, k, fq if fq is not None else dummy, fk if fk is not None else dummy, v, wf,
        o, ms if ms is not None else dummy, den if den is not None else dummy,
        seg_S if seg_S is not None else dummy, seg_z if seg_z is not None else dummy,
        wqx if wqx is not None else dummy, wkx if wkx is not None else dummy, lg if lg is not None else dummy,
        T, H, HK, nseg, seg_chunks, W, scale, eps, feps,
        D=D, K=K, V=V, BD=BD, BK=BK, BV=BV, BT=BT, HAS_LIN_CUR=W < BT, HAS_SEG=seg_S is not None,
        STORE_STATS=store_stats, PREC=prec(q.dtype), FUSE_Q=fq is None, FUSE_K=fk is None, GATED=lg is not None,
        num_warps=warps, num_stages=stages,
    )
    return o, ms, den


def _fwd_two_pass(q, k, fq, fk, v, wf, W, scale, eps, S0, z0, o, ms, den, wqx=None, wkx=None, feps=0.0,
                  make_fk=None, keep=None):
    """``CONFIG["fwd_two_pass"]``: the linear part ``sum_{j <= t-W} (fq_t.fk_j) v_j`` and its normaliser by the
    plain forward with keys and values shifted by ``W`` (``o_lin``, ``den_lin``; with ``fq`` None it computes
    the Hedgehog features itself, as in :func:`_fwd`), then :func:`_win_softmax_kernel` (writes ``o`` and, if
    given, the backward's ``ms`` / ``den``). ``keep`` ``[B, T]`` bool: the window leaves out the keys marked
    False (the caller has zeroed their ``k``, ``fk``, ``v``, so the linear part has none of them)."""

    B, T, H, D = q.shape
    HK, V = k.shape[2], v.shape[-1]
    # eps 1e-30: a query with no linear token gets o_lin = 0 / 1e-30 = 0 (den_lin is added to the window's below)
    if fq is not None:
        o_lin, den_lin, _, _ = linear_fwd(fq, fk, v, S0, z0, True, 1e-30, False, True, shift=W)
    else:  # raw q; raw k too unless its features are given
        o_lin, den_lin, _, _ = linear_fwd(q, fk if fk is not None else k, v, S0, z0, True, 1e-30, False, True,
                                          wqx=wqx, wkx=None if fk is not None else wkx, feps=feps,
                                          make_fk=make_fk, shift=W)
    BV = min(128 if q.dtype != torch.float32 else 64, pow2(V))
    dummy = o
    if wide(W, q.dtype):
        launch(
            _win_softmax_wide_kernel, (triton.cdiv(T, 64), B * H, triton.cdiv(V, BV)),
            q, k, v, wf, o_lin, den_lin, o, ms if ms is not None else dummy, den if den is not None else dummy,
            keep if keep is not None else dummy, T, H, HK, scale, eps, W=W, NB=_blocks_back(W, q.dtype),
            D=D, V=V, BD=pow2(D), BV=BV, BT=64, STORE_STATS=ms is not None, PREC=prec(q.dtype),
            HAS_KEEP=keep is not None, num_warps=CONFIG["softmax_warps"],
        )
        return
    launch(
        _win_softmax_kernel, (triton.cdiv(T, 64), B * H, triton.cdiv(V, BV)),
        q, k, v, wf, o_lin, den_lin, o, ms if ms is not None else dummy, den if den is not None else dummy,
        keep if keep is not None else dummy, T, H, HK, W, scale, eps,
        D=D, V=V, BD=pow2(D), BV=BV, BT=64, STORE_STATS=ms is not None, PREC=prec(q.dtype),
        HAS_KEEP=keep is not None, num_warps=CONFIG["softmax_warps"],
    )


def _final_state(fk, v, W, S0, z0):
    B, T, HK, K = fk.shape
    n = max(T - W, 0)
    S = torch.einsum("bthk,bthv->bhkv", fk[:, :n].float(), v[:, :n].float())
    z = fk[:, :n].float().sum(1)
    if S0 is not None:
        S, z = S + S0, z + z0
    return S, z


def _bwd(q, k, fq, fk, v, wf, o, ms, den, W, scale, S0, z0, do, dS_f, dz_f, need_state, lg=None, dlse=None):
    """Gradients ``(dq, dk, dfq, dfk, dv, dwf, dS0, dz0, dlg)`` (``dlg`` None without ``lg``). ``dlse`` ``[B, T, H]``
    (the gradient of the log normaliser ``lse = m + log den``) adds ``dlse / den`` to every weight's gradient,
    the same for every key of a row, so it joins ``dD = -(do.o) / den``. With ``lg`` the
    chunk states are the gated scans and ``d b_t = sum_group fq_t.dfq_t - fk_t.dfk_t`` (``b_t`` the cumulative log
    decay: a query gains from its own ``b``, a key loses), so ``d log_decay`` is its reverse cumulative sum; the
    final state's gradient is the caller's (its ``lg`` path is PyTorch's)."""
    B, T, H, D = q.shape
    HK, K, V = k.shape[2], fk.shape[-1], v.shape[-1]
    G = H // HK
    dev = q.device
    BT = _chunk_for(W, q.dtype)
    f32 = torch.float32
    N = triton.cdiv(T, BT)
    do = do.contiguous()
    invd, dD = row_stats(do, o, den)
    if dlse is not None:
        dD = dD + dlse.float() * invd
    cw = (1.0 - wf.to(f32)).view(1, 1, H) * torch.exp(-ms)  # (1-w) e^{-m}  [B,T,H]
    init_f = (S0, z0) if S0 is not None else None
    if lg is None:
        st, stz, _, _ = chunk_states(fk, v, heads=HK, cfg=CONFIG, do_z=True, init=init_f, BT=BT)
        rs, rz, fin, finz = chunk_states(fq, do, heads=HK, cfg=CONFIG, a=(cw * invd).contiguous(),
                                         u=(cw * dD).contiguous(), do_z=True, reverse=True, store_final=need_state,
                                         BT=BT)
    else:
        # the forward scan's decayed 16-bit rows as hi + lo (two products): S and z then agree exactly, as the
        # cancelling terms S dN + dD z need (the plain scan's rows are the inputs themselves, exact); the reverse
        # scan rounds its rows (c/D) e^{c} fq once for R, as the plain one rounds (c/D) fq
        st, stz, _, _ = gated_scan_states(fk, v, lg, init=init_f, BT=BT, num_warps=CONFIG["scan_warps"],
                                          split_rows=True)
        rs, rz, fin, finz = gated_scan_states(fq, do, lg, a=(cw * invd).contiguous(), u=(cw * dD).contiguous(),
                                              reverse=True, store_final=need_state, BT=BT,
                                              num_warps=CONFIG["scan_warps"])
        if need_state:
            fin, finz = fin[:, :, 0], finz[:, :, 0]
    dbq = new_empty((B, T, H), dtype=f32, device=dev) if lg is not None else None
    dbk = new_empty((B, T, HK), dtype=f32, device=dev) if lg is not None else None
    BD, BK = pow2(D), pow2(K)
    # value blocks of 64 even for narrower V (padded): at K = 128 a 32-wide block made triton 3.6 read past
    # the shared memory of the key-side kernel on an H200 (4 warps; 2026-12-01)
    BV = 64
    NVB = triton.cdiv(V, BV)
    dq = new_empty(q.shape, dtype=q.dtype, device=dev)
    dfq = new_empty(fq.shape, dtype=fq.dtype, device=dev)
    dk = new_empty(k.shape, dtype=k.dtype, device=dev)
    dfk = new_empty(fk.shape, dtype=fk.dtype, device=dev)
    dv = new_empty(v.shape, dtype=v.dtype, device=dev)
    dw_rows = new_empty((B, T, H), dtype=f32, device=dev)
    pr = prec(q.dtype)
    gated = lg is not None
    NB = _blocks_back(W, q.dtype)
    if NB > 1:
        launch(
            _win_bwd_q_wide_kernel, (N, B * H),
            q, k, fq, fk, v, wf, do, ms, invd, dD, st, stz, dq, dfq, dw_rows, T, H, HK, scale, W=W, NB=NB,
            D=D, K=K, V=V, BD=BD, BK=BK, BV=BV, BT=BT, NV_BLK=NVB, PREC=pr, num_warps=CONFIG["wide_bwd_warps"],
        )
    else:
        launch(
            _win_bwd_q_kernel, (N, B * H),
            q, k, fq, fk, v, wf, do, ms, invd, dD, st, stz, dq, dfq, dw_rows,
            lg if gated else dw_rows, dbq if gated else dw_rows,
            T, H, HK, W, scale, D=D, K=K, V=V, BD=BD, BK=BK, BV=BV, BT=BT, NV_BLK=NVB,
            HAS_LIN_CUR=W < BT, PREC=pr, GATED=gated, num_warps=CONFIG["bwd_warps"],
        )
    launch(
        _win_bwd_kv_kernel, (N, B * HK),
        q, k, fq, fk, v, wf, do, ms, invd, dD, rs, rz, dk, dfk, dv,
        lg if gated else dv, dbk if gated else dv,
        T, H, HK, W, scale, D=D, K=K, V=V, BD=BD, BK=BK, BV=BV, BT=BT, NV_BLK=NVB, G=G,
        PREC=pr, GATED=gated, NB=NB, num_warps=CONFIG["bwd_warps" if NB == 1 else "wide_bwd_warps"],
    )
    dwf = dw_rows.sum((0, 1))
    dlg = None
    if gated:
        db = dbq.view(B, T, HK, G).sum(-1) - dbk  # [B, T, HK]: d b_t
        dlg = db.flip(1).cumsum(1).flip(1)  # d log_decay_s = sum_{t >= s} d b_t
    n = max(T - W, 0)
    if n and (dS_f is not None or dz_f is not None):
        dfk32, dv32 = dfk.to(f32), dv.to(f32)
        if dS_f is not None:
            dfk32[:, :n] += torch.einsum("bthv,bhkv->bthk", v[:, :n].to(f32), dS_f.to(f32))
            dv32[:, :n] += torch.einsum("bthk,bhkv->bthv", fk[:, :n].to(f32), dS_f.to(f32))
        if dz_f is not None:
            dfk32[:, :n] += dz_f.to(f32).unsqueeze(1)
        dfk, dv = dfk32.to(fk.dtype), dv32.to(v.dtype)
    dS0 = dz0 = None
    if need_state:
        dS0, dz0 = fin, finz
        if dS_f is not None:
            dS0 = dS0 + dS_f
        if dz_f is not None:
            dz0 = dz0 + dz_f
    return dq, dk, dfq, dfk, dv, dwf, dS0, dz0, dlg


class _WindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, fq, fk, v, wf, S0, z0, W, scale, eps, output_final_state, lg=None, want_lse=False):
        needs_grad = any(ctx.needs_input_grad[:8]) or (lg is not None and ctx.needs_input_grad[12])
        o, ms, den = _fwd(q, k, fq, fk, v, wf, W, scale, eps, S0, z0, store_stats=needs_grad or want_lse, lg=lg)
        S_f = z_f = None
        if output_final_state:  # ungated only: a gated final state is the caller's (PyTorch, with autograd)
            S_f, z_f = _final_state(fk, v, W, S0, z0)
        lse = ms + den.log() if want_lse else None  # [B, T, H] fp32
        ctx.save_for_backward(q, k, fq, fk, v, wf, o, ms, den, S0, z0, lg)
        ctx.W, ctx.scale = W, scale
        ctx.set_materialize_grads(False)
        return o, S_f, z_f, lse

    @staticmethod
    def backward(ctx, do, dS_f, dz_f, dlse):
        q, k, fq, fk, v, wf, o, ms, den, S0, z0, lg = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        need_state = ctx.needs_input_grad[6] or ctx.needs_input_grad[7]
        dq, dk, dfq, dfk, dv, dwf, dS0, dz0, dlg = _bwd(q, k, fq, fk, v, wf, o, ms, den, ctx.W, ctx.scale, S0, z0,
                                                        do, dS_f, dz_f, need_state, lg=lg, dlse=dlse)
        return dq, dk, dfq, dfk, dv, dwf, dS0, dz0, None, None, None, None, dlg, None


def window_linear_attention_triton(
    q, k, fq, fk, v, window_factor, *, window: int = 64, scale: Optional[float] = None, eps: float = 1e-12,
    initial_state: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, output_final_state: bool = False,
    key_mask: Optional[torch.Tensor] = None, log_decay: Optional[torch.Tensor] = None, return_lse: bool = False,
):
    """Triton path of :func:`linearize.kernels.window_linear_attention` (``window <= 4096``; windows over 128, and
    fp32 ones over 64, walk several 64-token key blocks per chunk; wider windows run the chunked PyTorch path).
    With a ``key_mask`` (an inference forward of a padded batch): the padding rows of ``k``, ``fk``, ``v`` zeroed,
    then the two-pass forward whose window kernel reads the mask (64-token chunks, no gradient; otherwise the
    chunked PyTorch path). ``log_decay`` (``[B, T, Hk]``, windows up to 128): the single-pass forward and the
    backward with decays, unsegmented (one program walks a whole sequence per value block and head); the final
    state by PyTorch (:func:`reference.decayed_sum`); with a ``key_mask`` the chunked PyTorch path."""

    ensure_applied(q.device)  # this GPU's saved launch configuration (bench kernels --tune), once
    W = int(window)
    masked_chunked = key_mask is not None and (log_decay is not None or _chunk_for(W, q.dtype) != 64 or needs_grad(
        q, k, fq, fk, v, window_factor, *(initial_state or ())))
    if not supported(W, q.dtype) or (log_decay is not None and wide(W, q.dtype)) or masked_chunked:
        return window_linear_attention_chunked(q, k, fq, fk, v, window_factor, window=W, scale=scale, eps=eps,
                                               initial_state=initial_state, output_final_state=output_final_state,
                                               key_mask=key_mask, log_decay=log_decay, return_lse=return_lse)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if log_decay is not None:
        return _gated(q, k, fq, fk, v, window_factor, log_decay, W, float(scale), float(eps), initial_state,
                      output_final_state, return_lse)
    if key_mask is not None:
        k, fk, v = drop_keys(key_mask, k, fk, v)
    q, k, fq, fk, v = (x.contiguous() for x in (q, k, fq, fk, v))
    wf = window_factor.float().contiguous()
    S0 = z0 = None
    if initial_state is not None:
        S0, z0 = initial_state[0].float().contiguous(), initial_state[1].float().contiguous()
    if key_mask is not None:
        o, ms, den = _fwd(q, k, fq, fk, v, wf, W, float(scale), float(eps), S0, z0, store_stats=return_lse,
                          keep=key_mask.contiguous())
        return _results(o, _final_state(fk, v, W, S0, z0) if output_final_state else None,
                        ms + den.log() if return_lse else None)
    o, S_f, z_f, lse = _WindowAttention.apply(q, k, fq, fk, v, wf, S0, z0, W, float(scale), float(eps),
                                              output_final_state, None, return_lse)
    return _results(o, (S_f, z_f) if output_final_state else None, lse)


def _results(o, state, lse):
    """``(o, state)``, and ``lse`` third when it was asked for (not None)."""
    return (o, state) if lse is None else (o, state, lse)


def _gated(q, k, fq, fk, v, window_factor, log_decay, W, scale, eps, initial_state, output_final_state,
           return_lse=False):
    """:func:`window_linear_attention_triton` with ``log_decay``: the kernels for the output, PyTorch for the final
    state (``sum_{j <= T-1-W} e^{b_{T-1-W} - b_j} fk_j v_j^T + e^{b_{T-1-W}} S_0``, autograd's gradients)."""
    qc, kc, fqc, fkc, vc = (x.contiguous() for x in (q, k, fq, fk, v))
    wf = window_factor.float().contiguous()
    S0 = z0 = None
    if initial_state is not None:
        S0, z0 = initial_state[0].float().contiguous(), initial_state[1].float().contiguous()
    lg = log_decay.float().contiguous()
    o, _, _, lse = _WindowAttention.apply(qc, kc, fqc, fkc, vc, wf, S0, z0, W, scale, eps, False, lg, return_lse)
    state = None
    if output_final_state:
        n = max(q.shape[1] - W, 0)
        state = decayed_sum(log_decay[:, :n], fk[:, :n], v[:, :n], initial_state, torch.float32)
    return _results(o, state, lse)


def window_linear_attention_hedgehog_triton(
    q, k, v, window_factor, weight_q, weight_k, *, fk=None, window: int = 64, scale: Optional[float] = None,
    eps: float = 1e-12, feature_eps: float = 1e-12, initial_state: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    output_final_state: bool = False,
):
    """Triton path of :func:`linearize.kernels.window_linear_attention_hedgehog`: forward only (no autograd),
    the query features (and the key features unless ``fk`` is given) computed inside the kernel."""

    ensure_applied(q.device)
    W = int(window)

    made = []

    def make_fk():  # as HedgehogFeatureMap: fp32 features, rounded to the inputs' dtype; computed once
        if not made:
            made.append(hedgehog_features_rounded(k, weight_k, feature_eps).contiguous())
        return made[0]

    if not supported(W, q.dtype):

        fq = hedgehog_features_rounded(q, weight_q, feature_eps)
        return window_linear_attention_chunked(q, k, fq, fk if fk is not None else make_fk(), v, window_factor,
                                               window=W, scale=scale, eps=eps, initial_state=initial_state,
                                               output_final_state=output_final_state)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q, k, v = (x.contiguous() for x in (q, k, v))
    wqx, wkx = signed_projections(weight_q, weight_k, q.dtype)  # [H, D, 2f], [Hk, D, 2f]
    fk = fk.contiguous() if fk is not None else None
    wf = window_factor.float().contiguous()
    S0 = z0 = None
    if initial_state is not None:
        S0, z0 = initial_state[0].float().contiguous(), initial_state[1].float().contiguous()
    with torch.no_grad():
        o, _, _ = _fwd(q, k, None, fk, v, wf, W, float(scale), float(eps), S0, z0, store_stats=False,
                       wqx=wqx, wkx=wkx, feps=float(feature_eps), make_fk=make_fk)
        state = _final_state(fk if fk is not None else make_fk(), v, W, S0, z0) if output_final_state else None
    return o, state


register("window", CONFIG)  # tunable per GPU (tuning.py)

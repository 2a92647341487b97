"""Triton decode-step kernels (one token, state updated in place).

Linear step: programs over (batch x KV head, value block) read their columns of the ``[K, V]`` state once, add
``k v^T`` (gated: to the state decayed by ``e^{log_decay}``), write them back and answer every query head of the KV
group from registers; ``z`` is shared by all
value columns, so with more than one block a second kernel adds ``phi(k)`` to it afterwards (with one block,
``CONFIG["linear_step_waves"]`` 0, the program updates it itself). With ``CONFIG["linear_step_heads"]`` the
group's query heads are spread over programs too; those only read ``S``, and the second kernel adds ``k v^T``.

Window step: programs over (batch x KV head, value block) each fold the token leaving the window into their
columns of ``S`` and answer the group's query heads for those columns, reading ``z`` and the key rings
unchanged; a second, small kernel then updates ``z`` and writes the new key and key features into the rings
(stream order makes that race-free without one program owning the whole state, so a batch of 8 with 8 KV
heads fills the GPU). With ``CONFIG["step_heads"]`` a group's query heads are also spread over programs; those
only read the state, and the second kernel writes the fold into ``S`` and the new value as well. Wide rings
(``CONFIG["step_ring_split"]``) are first walked in parts, each read once for all of a KV group's heads, whose
partial softmax sums the step kernel merges. Nothing is allocated except the output (``out=`` avoids that too)
and the parts' scratch, so a CUDA graph can replay the call (under capture the scratch comes from the graph's
pool); the window step's token counter ``seen`` is read on the device and incremented by one in-place add after
the kernels.

At small batches (``CONFIG["small_grid_heads_per_sm"]``) both steps answer one query head per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import hedgehog_row, mm, num_sms, pow2, to16
from .tuning import ensure_applied, register


@triton.jit
def _linear_step_kernel(
    Q, Kp, Vp, S, Z, O,  # q [B,H,K], k [B,HK,K], v [B,HK,V], S [B,HK,K,V], z [B,HK,K], o [B,H,V]
    WQX, WKX,  # FUSE: q, k are raw [B,H|HK,D] and these the Hedgehog maps [Wq, -Wq] [H,D,K], [Wk, -Wk] [HK,D,K]
    LD,  # DECAY: log decay [B,HK] fp32
    H, HK, eps, feps,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, G: tl.constexpr,
    NORMALIZE: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, FUSE: tl.constexpr, UPDATE_Z: tl.constexpr,
    GH: tl.constexpr, OWN: tl.constexpr, DECAY: tl.constexpr,
):
    """Program (batch x KV head, value block, head group): adds ``k v^T`` to its columns of ``S`` and answers
    ``GH`` of the KV group's ``G`` query heads for them. With one head group (``OWN``) it writes those columns
    back; with several every program only reads ``S`` and :func:`_linear_step_commit_kernel` adds ``k v^T``.
    ``z`` is shared by the value blocks: with one block and one head group (``UPDATE_Z``) it is written here,
    otherwise read here and updated by the commit kernel after this one. ``DECAY``: ``S`` and ``z`` are first
    multiplied by ``e^{log_decay}`` (gated)."""
    pbh = tl.program_id(0)
    pg = tl.program_id(2)
    b = pbh // HK
    hk = pbh % HK
    ok = tl.arange(0, BK)
    ov = tl.program_id(1) * BV + tl.arange(0, BV)
    od = tl.arange(0, BD)
    mk, mv, md = ok < K, ov < V, od < D
    base = pbh.to(tl.int64)
    if FUSE:  # the features the layer would compute: fp32, rounded to the input dtype
        k = tl.load(Kp + base * D + od, mask=md, other=0.0)
        k = hedgehog_row(k.to(tl.float32), WKX, hk, od, ok, md, mk, D, K, K // 2, feps).to(k.dtype).to(tl.float32)
    else:
        k = tl.load(Kp + base * K + ok, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(Vp + base * V + ov, mask=mv, other=0.0).to(tl.float32)
    sp = S + base * K * V + ok[:, None] * V + ov[None, :]
    s = tl.load(sp, mask=mk[:, None] & mv[None, :], other=0.0)
    if DECAY:
        a = tl.exp(tl.load(LD + base))
        s = s * a
    s += k[:, None] * v[None, :]
    if OWN:
        tl.store(sp, s, mask=mk[:, None] & mv[None, :])
    if DECAY:
        z = tl.load(Z + base * K + ok, mask=mk, other=0.0) * a + k
    else:
        z = tl.load(Z + base * K + ok, mask=mk, other=0.0) + k
    if UPDATE_Z:
        tl.store(Z + base * K + ok, z, mask=mk)
    for g in tl.static_range(GH):
        # a short last head group answers the group's last head again past the end (the same row, the same value)
        h = hk * G + tl.minimum(pg * GH + g, G - 1)
        qrow = b.to(tl.int64) * H + h
        if FUSE:
            q = tl.load(Q + qrow * D + od, mask=md, other=0.0)
            q = hedgehog_row(q.to(tl.float32), WQX, h, od, ok, md, mk, D, K, K // 2, feps).to(q.dtype).to(tl.float32)
        else:
            q = tl.load(Q + qrow * K + ok, mask=mk, other=0.0).to(tl.float32)
        o = tl.sum(q[:, None] * s, 0)
        if NORMALIZE:
            o = o / (tl.sum(q * z, 0) + eps)
        tl.store(O + qrow * V + ov, o.to(O.dtype.element_ty), mask=mv)


@triton.jit
def _linear_step_commit_kernel(
    Kp, Z, WKX,  # k [B,HK,K] (raw [B,HK,D] with FUSE), z [B,HK,K], [Wk, -Wk] [HK,D,K]
    Vp, S,  # FOLD: v [B,HK,V], S [B,HK,K,V]
    LD,  # DECAY: log decay [B,HK] fp32
    HK, feps,
    K: tl.constexpr, BK: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, FUSE: tl.constexpr,
    V: tl.constexpr, BVC: tl.constexpr, FOLD: tl.constexpr, DECAY: tl.constexpr,
):
    """Program (batch x KV head), after a split :func:`_linear_step_kernel`: ``z += phi(k)``; ``FOLD`` (the step
    kernel ran in several head groups, so it wrote nothing to ``S``): also ``S += phi(k) v^T``, ``BVC`` columns
    at a time. ``DECAY``: ``z`` (and a folded ``S``) first multiplied by ``e^{log_decay}``."""
    pbh = tl.program_id(0)
    ok, od = tl.arange(0, BK), tl.arange(0, BD)
    mk, md = ok < K, od < D
    base = pbh.to(tl.int64)
    if FUSE:  # as the step kernel computes them
        k = tl.load(Kp + base * D + od, mask=md, other=0.0)
        k = hedgehog_row(k.to(tl.float32), WKX, pbh % HK, od, ok, md, mk, D, K, K // 2, feps).to(k.dtype)
    else:
        k = tl.load(Kp + base * K + ok, mask=mk, other=0.0)
    k = k.to(tl.float32)
    if DECAY:
        a = tl.exp(tl.load(LD + base))
        tl.store(Z + base * K + ok, tl.load(Z + base * K + ok, mask=mk, other=0.0) * a + k, mask=mk)
    else:
        tl.store(Z + base * K + ok, tl.load(Z + base * K + ok, mask=mk, other=0.0) + k, mask=mk)
    if FOLD:
        for v0 in tl.static_range(0, V, BVC):
            ov = v0 + tl.arange(0, BVC)
            mv = ov < V
            v = tl.load(Vp + base * V + ov, mask=mv, other=0.0).to(tl.float32)
            sp = S + base * K * V + ok[:, None] * V + ov[None, :]
            m2 = mk[:, None] & mv[None, :]
            if DECAY:
                tl.store(sp, tl.load(sp, mask=m2, other=0.0) * a + k[:, None] * v[None, :], mask=m2)
            else:
                tl.store(sp, tl.load(sp, mask=m2, other=0.0) + k[:, None] * v[None, :], mask=m2)


@triton.jit
def _ring_rows(KR, VR, KEEP, base, b, rows, slot, t, W, k_new, v_new, od, ov, md, mv,
               D: tl.constexpr, V: tl.constexpr, RING_DTYPE: tl.constexpr = False):
    """Rows ``rows`` of the key and value rings as fp32 ``[R, BD]`` / ``[R, BV]`` (``RING_DTYPE``: in the rings'
    dtype), the new token in row ``slot``, and which of them a query sees ``[R]`` (written, not padding; the new
    token never is)."""
    mr = rows < W
    here = rows == slot
    kr = tl.load(KR + (base * W + rows[:, None]) * D + od[None, :], mask=mr[:, None] & md[None, :], other=0.0)
    kr = tl.where(here[:, None], k_new.to(KR.dtype.element_ty)[None, :], kr)
    vr = tl.load(VR + (base * W + rows[:, None]) * V + ov[None, :], mask=mr[:, None] & mv[None, :], other=0.0)
    vr = tl.where(here[:, None], v_new.to(VR.dtype.element_ty)[None, :], vr)
    kept = tl.load(KEEP + b.to(tl.int64) * W + rows, mask=mr, other=0) != 0
    if not RING_DTYPE:
        kr, vr = kr.to(tl.float32), vr.to(tl.float32)
    return kr, vr, (rows <= t) & mr & (kept | here)


@triton.jit
def _softmax_rows(q, kr, vr, valid, m, acc, total, scale):
    """An online-softmax update by ring rows ``kr``, ``vr`` (``valid`` of them): ``(acc, total, m)`` with
    ``acc = sum_j p_j v_j``, ``total = sum_j p_j``, ``p_j = exp(s_j - m)`` over every row so far, ``m`` the running
    row maximum (what came before rescaled to the new one)."""
    sc = tl.where(valid, tl.sum(kr * q[None, :], 1) * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(sc, 0))
    alpha = tl.exp(m - m_new)
    p = tl.where(valid, tl.exp(sc - m_new), 0.0)
    return acc * alpha + tl.sum(p[:, None] * vr, 0), total * alpha + tl.sum(p, 0), m_new


@triton.jit
def _ring_walk(q, m, KR, VR, KEEP, base, b, slot, t, W, k_new, v_new, od, ov, md, mv, scale,
               D: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, RB: tl.constexpr):
    """One query head's softmax part over the window rings, ``RB`` rows at a time (:func:`_ring_rows`,
    :func:`_softmax_rows`) from the row maximum ``m`` (0, or the sinks'): ``(sum_j p_j v_j [BV], sum_j p_j, m)``."""
    acc = tl.zeros([BV], tl.float32)
    total = tl.zeros([], tl.float32)
    for r0 in range(0, W, RB):
        kb, vb, valid = _ring_rows(KR, VR, KEEP, base, b, r0 + tl.arange(0, RB), slot, t, W, k_new, v_new, od, ov,
                                   md, mv, D, V)
        acc, total, m = _softmax_rows(q, kb, vb, valid, m, acc, total, scale)
    return acc, total, m


@triton.jit
def _part_dot(a, b, DT: tl.constexpr, LOW16: tl.constexpr):
    """``a b`` (``a`` fp32) with fp32 sums: under ``LOW16`` on tensor cores with ``a`` rounded to the 16-bit ``DT``
    of ``b``, else exact fp32 products."""
    if LOW16:
        return mm(to16(a, DT), b, "tf32")
    else:
        return mm(a, b, "ieee")


@triton.jit
def _window_ring_part_kernel(
    Q, Kr, Vp, KR, VR, SEEN, KEEP,  # q [B,H,D] (raw rows); new k [B,HK,D], v [B,HK,V]; rings; seen; keep [B,W]
    PM, PT, PA,  # out, fp32: row maximum and sum of weights [B*HK, NP, G], weighted values [B*HK, NP, G, V]
    H, HK, W, NP, scale,
    D: tl.constexpr, V: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, G: tl.constexpr, BG: tl.constexpr,
    RS: tl.constexpr, RB: tl.constexpr, LOW16: tl.constexpr,
):
    """Program (batch x KV head, ring part): the softmax part of every query head of the KV group over ring rows
    ``[part * RS, (part + 1) * RS)`` (the new token in its slot), ``RB`` rows at a time with an online softmax
    from the floor 0: ``(m, sum_j p_j, sum_j p_j v_j)``, ``p_j = exp(s_j - m)``, for :func:`_window_step_kernel`
    to merge. Each key and value row is read once per step, whatever the group's size. ``LOW16`` (16-bit rings):
    both products on tensor cores with the rings' dtype as operands and fp32 sums, as a flash-decoding kernel
    (``q k^T`` exact for 16-bit ``q``; the weights ``p`` rounded to 16 bits for ``p V``), else in exact fp32."""
    pbh = tl.program_id(0)
    part = tl.program_id(1)
    b = pbh // HK
    hk = pbh % HK
    od, ov, og = tl.arange(0, BD), tl.arange(0, BV), tl.arange(0, BG)
    md, mv, mg = od < D, ov < V, og < G
    base = pbh.to(tl.int64)
    t = tl.load(SEEN)
    slot = (t % W).to(tl.int32)
    k_new = tl.load(Kr + base * D + od, mask=md, other=0.0)
    v_new = tl.load(Vp + base * V + ov, mask=mv, other=0.0)
    qrow = b.to(tl.int64) * H + hk * G + og  # [BG]: the group's query heads (rows past G masked)
    q = tl.load(Q + qrow[:, None] * D + od[None, :], mask=mg[:, None] & md[None, :], other=0.0).to(tl.float32)
    m = tl.zeros([BG], tl.float32)
    total = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BV], tl.float32)
    DT = KR.dtype.element_ty
    for r0 in range(0, RS, RB):
        kb, vb, valid = _ring_rows(KR, VR, KEEP, base, b, part * RS + r0 + tl.arange(0, RB), slot, t, W, k_new,
                                   v_new, od, ov, md, mv, D, V, LOW16)
        sc = tl.where(valid[None, :], _part_dot(q, tl.trans(kb), DT, LOW16) * scale, float("-inf"))  # [BG, RB]
        m_new = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.exp(m - m_new)
        p = tl.where(valid[None, :], tl.exp(sc - m_new[:, None]), 0.0)
        acc = acc * alpha[:, None] + _part_dot(p, vb, DT, LOW16)
        total = total * alpha + tl.sum(p, 1)
        m = m_new
    out = (base * NP + part) * G + og  # the group's heads only (the padding rows past G are not stored)
    tl.store(PM + out, m, mask=mg)
    tl.store(PT + out, total, mask=mg)
    tl.store(PA + out[:, None] * V + ov[None, :], acc, mask=mg[:, None] & mv[None, :])


@triton.jit
def _window_step_kernel(
    Q, FQ, Kr, Vp, WF,  # q [B,H,D], fq [B,H,K] (not read with FUSE), k [B,HK,D], v [B,HK,V], wf [H] fp32
    S, Z, KR, FKR, VR, SEEN, KEEP,  # state; rings [B,HK,W,*]; seen int64 [1]; keep bool [B,W] (False: padding)
    O,
    WQX,  # FUSE: Hedgehog map [Wq, -Wq] [H,D,K]; fq is then computed here
    SK, SV, SPOS, SVALID,  # SINKS: sink keys [B,NS,HK,D], values [B,NS,HK,V], positions int64 / valid bool [B,NS]
    PM, PT, PA,  # NP > 0: the ring parts of _window_ring_part_kernel
    H, HK, W, NS, NP, scale, eps, feps,
    D: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr, G: tl.constexpr,
    FUSE: tl.constexpr, GH: tl.constexpr, OWN: tl.constexpr, SINKS: tl.constexpr, BN: tl.constexpr,
    RB: tl.constexpr, PARTS: tl.constexpr, BP: tl.constexpr, BG: tl.constexpr,
):
    """Program (batch x KV head, value block, head group): answers ``GH`` of the KV group's ``G`` query heads for
    its value columns, with the token leaving the window folded into ``S`` and the new value in the ring. With
    one head group (``OWN``) it also writes that fold and value into its columns of ``S`` and the value ring;
    with several, every program only reads the state and :func:`_window_step_commit_kernel` writes them.
    ``z``, the key ring and the key-feature ring are shared by every value block, so they are read here and
    written only by the commit kernel, launched after this one. ``RB`` > 0: each head walks the rings in blocks
    of ``RB`` rows with an online softmax (:func:`_ring_walk`) instead of holding them whole (``BW`` rows).
    ``PARTS``: :func:`_window_ring_part_kernel` walked the rings (``NP`` parts, ``BP`` = pow2); each head merges
    its parts' ``(m, sum p, sum p v)`` instead."""
    pbh = tl.program_id(0)
    pv = tl.program_id(1)
    pg = tl.program_id(2)
    b = pbh // HK
    hk = pbh % HK
    od, ok, ow = tl.arange(0, BD), tl.arange(0, BK), tl.arange(0, BW)
    ov = pv * BV + tl.arange(0, BV)
    md, mk, mv = od < D, ok < K, ov < V
    base = pbh.to(tl.int64)
    t = tl.load(SEEN)
    slot = (t % W).to(tl.int32)
    fold = (t >= W).to(tl.float32)
    fk_old = tl.load(FKR + (base * W + slot) * K + ok, mask=mk, other=0.0).to(tl.float32) * fold  # [BK]
    k_new = tl.load(Kr + base * D + od, mask=md, other=0.0)
    v_new = tl.load(Vp + base * V + ov, mask=mv, other=0.0)
    if RB == 0 and not PARTS:  # the whole rings, read once for every head of the program (before the writes below)
        kr, vr, valid = _ring_rows(KR, VR, KEEP, base, b, ow, slot, t, W, k_new, v_new, od, ov, md, mv, D, V)
    v_old = tl.load(VR + (base * W + slot) * V + ov, mask=mv, other=0.0).to(tl.float32)  # before the slot's write
    sp = S + base * K * V + ok[:, None] * V + ov[None, :]
    s = tl.load(sp, mask=mk[:, None] & mv[None, :], other=0.0) + fk_old[:, None] * v_old[None, :]
    z = tl.load(Z + base * K + ok, mask=mk, other=0.0) + fk_old
    if OWN:
        tl.store(sp, s, mask=mk[:, None] & mv[None, :])
        tl.store(VR + (base * W + slot) * V + ov, v_new.to(VR.dtype.element_ty), mask=mv)
    if SINKS:  # the sinks out of this token's window join the softmax part
        on = tl.arange(0, BN)
        mn = on < NS
        srow = b.to(tl.int64) * NS + on  # [BN]
        spos = tl.load(SPOS + srow, mask=mn, other=0)
        sseen = mn & (tl.load(SVALID + srow, mask=mn, other=0) != 0) & (t - spos >= W)
        sk = tl.load(SK + (srow[:, None] * HK + hk) * D + od[None, :], mask=mn[:, None] & md[None, :],
                     other=0.0).to(tl.float32)
        sv = tl.load(SV + (srow[:, None] * HK + hk) * V + ov[None, :], mask=mn[:, None] & mv[None, :],
                     other=0.0).to(tl.float32)
    for g in tl.static_range(GH):
        # a short last head group answers the group's last head again past the end (the same row, the same value)
        h = hk * G + tl.minimum(pg * GH + g, G - 1)
        qrow = b.to(tl.int64) * H + h
        w = tl.load(WF + h).to(tl.float32)
        q = tl.load(Q + qrow * D + od, mask=md, other=0.0).to(tl.float32)
        if FUSE:  # rounded to q's dtype, as the layer's feature map returns them
            fq = hedgehog_row(q, WQX, h, od, ok, md, mk, D, K, K // 2, feps).to(Q.dtype.element_ty).to(tl.float32)
        else:
            fq = tl.load(FQ + qrow * K + ok, mask=mk, other=0.0).to(tl.float32)
        m = tl.zeros([], tl.float32)  # the normaliser's floor: the row maximum starts at 0
        if SINKS:
            ss = tl.where(sseen, tl.sum(sk * q[None, :], 1) * scale, float("-inf"))
            m = tl.maximum(m, tl.max(ss, 0))
        if PARTS:  # m_p >= 0 (the parts' floor), so the merged maximum is the one a single walk reaches
            op = tl.arange(0, BP)
            mp = op < NP
            prow = (base * NP + op) * G + tl.minimum(pg * GH + g, G - 1)  # [BP]
            pm = tl.load(PM + prow, mask=mp, other=0.0)
            m = tl.maximum(m, tl.max(pm, 0))
            e = tl.where(mp, tl.exp(pm - m), 0.0)
            total = tl.sum(e * tl.load(PT + prow, mask=mp, other=0.0), 0)
            acc = tl.sum(e[:, None] * tl.load(PA + prow[:, None] * V + ov[None, :], mask=mp[:, None] & mv[None, :],
                                              other=0.0), 0)
        elif RB == 0:
            acc, total, m = _softmax_rows(q, kr, vr, valid, m, tl.zeros([BV], tl.float32), tl.zeros([], tl.float32),
                                          scale)
        else:
            acc, total, m = _ring_walk(q, m, KR, VR, KEEP, base, b, slot, t, W, k_new, v_new, od, ov, md, mv, scale,
                                       D, V, BV, RB)
        em = tl.exp(-m)
        c = (1.0 - w) * em
        num = w * acc + c * tl.sum(fq[:, None] * s, 0)
        den = w * total + c * tl.sum(fq * z, 0) + eps * em
        if SINKS:
            ps = tl.where(sseen, tl.exp(ss - m), 0.0)
            num += w * tl.sum(ps[:, None] * sv, 0)
            den += w * tl.sum(ps, 0)
        tl.store(O + qrow * V + ov, (num / den).to(O.dtype.element_ty), mask=mv)


@triton.jit
def _window_step_commit_kernel(
    Kr, FK, KR, FKR, Z, SEEN, KEEP,  # k [B,HK,D], fk [B,HK,K] (not read with FUSE); rings; z; seen; keep [B,W]
    WKX,  # FUSE: Hedgehog map [Wk, -Wk] [HK,D,K]; fk is then computed here
    Vp, S, VR,  # FOLD: v [B,HK,V], S [B,HK,K,V], value ring [B,HK,W,V]
    HK, W, feps,
    D: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, FUSE: tl.constexpr,
    V: tl.constexpr, BVC: tl.constexpr, FOLD: tl.constexpr,
):
    """Program (batch x KV head), after :func:`_window_step_kernel`: ``z`` gains the key features leaving the
    window, and the new token's key and key features take their ring slot (which no longer holds padding). ``FOLD`` (the step kernel ran in
    several head groups, so it wrote nothing): also folds the token leaving the window into ``S`` and writes
    the new value into the value ring, ``BVC`` columns at a time."""
    pbh = tl.program_id(0)
    hk = pbh % HK
    od, ok = tl.arange(0, BD), tl.arange(0, BK)
    md, mk = od < D, ok < K
    base = pbh.to(tl.int64)
    t = tl.load(SEEN)
    slot = (t % W).to(tl.int32)
    fk_old = tl.load(FKR + (base * W + slot) * K + ok, mask=mk, other=0.0).to(tl.float32) * (t >= W).to(tl.float32)
    tl.store(Z + base * K + ok, tl.load(Z + base * K + ok, mask=mk, other=0.0) + fk_old, mask=mk)
    if FOLD:
        for v0 in tl.static_range(0, V, BVC):
            ov = v0 + tl.arange(0, BVC)
            mv = ov < V
            vrow = VR + (base * W + slot) * V + ov
            v_old = tl.load(vrow, mask=mv, other=0.0).to(tl.float32)  # read before the new value replaces it
            sp = S + base * K * V + ok[:, None] * V + ov[None, :]
            m2 = mk[:, None] & mv[None, :]
            tl.store(sp, tl.load(sp, mask=m2, other=0.0) + fk_old[:, None] * v_old[None, :], mask=m2)
            tl.store(vrow, tl.load(Vp + base * V + ov, mask=mv, other=0.0).to(VR.dtype.element_ty), mask=mv)
    k_new = tl.load(Kr + base * D + od, mask=md, other=0.0)
    if FUSE:  # the features the layer would compute: fp32, rounded to the ring's dtype
        fk_new = hedgehog_row(k_new.to(tl.float32), WKX, hk, od, ok, md, mk, D, K, K // 2, feps)
    else:
        fk_new = tl.load(FK + base * K + ok, mask=mk, other=0.0)
    if hk == 0:
        tl.store(KEEP + (pbh // HK).to(tl.int64) * W + slot, 1)
    tl.store(KR + (base * W + slot) * D + od, k_new.to(KR.dtype.element_ty), mask=md)
    tl.store(FKR + (base * W + slot) * K + ok, fk_new.to(FKR.dtype.element_ty), mask=mk)


CONFIG = {  # tuned on an H200 with CUDA graphs; measurements in kernels/README.md
    # window step: each (batch, KV head)'s value columns are split over programs (value blocks of >= 16) until the
    # grid has step_waves programs per SM, each with step_warps warps: more programs in flight for a small step
    "step_waves": 0.5,
    "step_bv": 0,  # > 0: this value block (tests, sweeps)
    # query heads of a KV group answered per program (0: the whole group); fewer spread a group over more
    # programs, which only read the state, and the commit kernel then writes the fold into S and the new value;
    # value blocks stay <= SPLIT_HEADS_MAX_BV then. Two per program was fastest for groups of 4, 7 and 8
    "step_heads": 2,
    # warps of the window step's main kernel at value blocks <= 64 (0: from its tile sizes, as wider blocks
    # always are: 16 at 128, where 4 warps would spill)
    "step_warps": 4,
    # rings of at least step_ring_block_from rows (pow2(W)) are walked step_ring_block rows at a time with an online
    # softmax instead of held whole (0: never). Offline for sm_90a (K = V = D = 128, bf16, triton 3.6): the whole
    # 512-row ring spills 1.0 KB per thread at 16 warps; in 64-row blocks 249 registers at 4 warps, no spills.
    # Not yet timed on a GPU
    "step_ring_block": 64,
    "step_ring_block_from": 512,
    # rings of at least step_ring_split_from rows (pow2(W)) are split over programs of step_ring_split rows, each
    # walking its rows once for all of a KV group's query heads (_window_ring_part_kernel), the step kernel then
    # merging the parts (0: never; a power of two >= 16). Otherwise every program of the step walks the whole ring,
    # reading each row 16 times per step at batch 1. H100, batch 1, W = 4096 (kernels/window_step_blocks.py): the
    # whole walk 113.8 us, the split 23.2 us in parts of 128 rows, 24.5 / 25.5 / 33.5 / 50.1 at 64 / 256 / 512 /
    # 1024
    "step_ring_split": 128,
    "step_ring_split_from": 1024,
    # warps of the ring parts' kernel with 16-bit products: 4 (23.2 us) and 8 (28.2) alike; with fp32 products
    # (fp32 rings) it runs twice as many: at 4 they spill 2.4 KB per thread (sm_90a, Triton 3.6), at 8 none
    "step_ring_part_warps": 4,
    # 16-bit rings: the parts' two products on tensor cores with 16-bit operands (p rounded to 16 bits for p V;
    # 3.9e-4 from the PyTorch step at W = 4096) instead of exact fp32 ones (6.1e-5, 8x slower)
    "step_ring_part_16bit": 1,
    # the linear step's split over value blocks (then z is added by a second kernel; 0 = one program per
    # (batch, KV head)): half a wave of programs was fastest
    "linear_step_waves": 0.5,
    # query heads of a KV group answered per program of the linear step, as step_heads for the window step (0: the
    # whole group; fed precomputed features only from groups of unfused_linear_step_split_min_group)
    "linear_step_heads": 2,
    # both steps answer one query head per program, whatever *_heads says, when the batch's query heads
    # (batch x H) are at most this many per SM (0: never): such a step is latency-bound and more programs beat
    # fewer reads of the state
    "small_grid_heads_per_sm": 1.0,
    # the linear step fed precomputed features (elu) spreads a KV group's query heads over programs only from
    # groups of this many: each program then holds little, and at groups of 4 whole groups were faster
    "unfused_linear_step_split_min_group": 8,
}


#: widest value block of either step when a KV group's query heads are split over programs: in the window step 128
#: took 31-49 us where 64 took 19-23 (the measurements at ``step_heads`` above)
SPLIT_HEADS_MAX_BV = 64

#: widest value block of the linear step when it computes Hedgehog features: 64 matched the PyTorch step exactly
#: on an H200 (bf16, every warp count), 128 with 8 / 16 warps did not (7.8e-3 / 8.5e-3 relative error)
FUSED_LINEAR_STEP_MAX_BV = 64


def step_value_block(programs: int, V: int, device: torch.device, waves: float, max_bv: int | None = None) -> int:
    """Value block of a decode step for ``programs`` (batch x KV head) pairs: halved from the whole ``V``
    while the grid stays under ``waves`` programs per SM (one program per pair off CUDA or at 0 waves), and
    never wider than ``max_bv``."""
    BV = pow2(V) if max_bv is None else min(pow2(V), max_bv)
    if CONFIG["step_bv"]:
        return min(int(CONFIG["step_bv"]), BV)
    if device.type == "cuda":
        target = waves * num_sms(device)
        while BV > 16 and programs * triton.cdiv(V, BV) < target:
            BV //= 2
    return BV


def step_heads(G: int, key: str = "step_heads") -> int:
    """Query heads per program of a decode step for KV groups of ``G`` (``CONFIG[key]``; 0 or ``>= G``: the whole
    group). Need not divide ``G``: the last program of a group then answers the remaining heads."""
    n = int(CONFIG[key])
    return n if 0 < n < G else G


def _tiles(pairs: int, G: int, V: int, device: torch.device, heads_key: str, waves_key: str,
           max_bv: int | None, split_max_bv: int | None, min_split_group: int = 1) -> tuple[int, int]:
    """``(query heads per program, value block)`` of a decode step for ``pairs`` (batch x KV head) with KV groups
    of ``G``: heads per program from ``CONFIG[heads_key]`` (one at small batches: ``small_grid_heads_per_sm``), the
    value block for all the programs (pairs x head groups) at ``CONFIG[waves_key]``, at most ``max_bv``, or
    ``split_max_bv`` when given and the heads are split; groups under ``min_split_group`` stay whole)."""
    GH = step_heads(G, heads_key)
    if G < min_split_group:
        GH = G
    elif device.type == "cuda" and pairs * G <= CONFIG["small_grid_heads_per_sm"] * num_sms(device):
        GH = 1
    cap = split_max_bv if GH < G and split_max_bv is not None else max_bv
    return GH, step_value_block(pairs * triton.cdiv(G, GH), V, device, CONFIG[waves_key], cap)


def window_step_tiles(pairs: int, G: int, V: int, device: torch.device) -> tuple[int, int]:
    """:func:`_tiles` of the window step (value blocks of at most ``SPLIT_HEADS_MAX_BV`` when heads are split)."""
    return _tiles(pairs, G, V, device, "step_heads", "step_waves", None, SPLIT_HEADS_MAX_BV)


def linear_step_tiles(pairs: int, G: int, V: int, device: torch.device, fuse: bool) -> tuple[int, int]:
    """:func:`_tiles` of the linear step (``fuse``: Hedgehog features in the kernel, value blocks of at most
    ``FUSED_LINEAR_STEP_MAX_BV``; at most ``SPLIT_HEADS_MAX_BV`` when heads are split; without ``fuse`` groups
    under ``CONFIG["unfused_linear_step_split_min_group"]`` stay whole)."""
    return _tiles(pairs, G, V, device, "linear_step_heads", "linear_step_waves",
                  FUSED_LINEAR_STEP_MAX_BV if fuse else None, SPLIT_HEADS_MAX_BV,
                  1 if fuse else int(CONFIG["unfused_linear_step_split_min_group"]))


#: value columns the commit kernels fold into ``S`` at a time when the heads are split
COMMIT_BV = 32


def _commit_launch(BD: int, BK: int, V: int, fuse: bool, split: bool) -> tuple[int, int]:
    """``(BVC, num_warps)`` of a commit kernel: the key-feature tile when it computes features, the fold tile
    when it folds ``S``."""
    BVC = min(pow2(V), COMMIT_BV)
    return BVC, _warps(4 * max(BD * BK if fuse else 0, BK * BVC if split else 0))


def _warps(nbytes: int) -> int:
    return 4 if nbytes <= 32 * 1024 else (8 if nbytes <= 96 * 1024 else 16)


def ring_block(BW: int) -> int:
    """Rows of the rings the window step reads at a time for a ring tile of ``BW`` rows: ``step_ring_block`` from
    ``step_ring_block_from`` rows on, else 0 (the whole ring at once)."""
    rb, start = int(CONFIG["step_ring_block"]), int(CONFIG["step_ring_block_from"])
    return min(rb, BW) if rb and start and BW >= start else 0


def ring_split(BW: int) -> int:
    """Rows per program of the ring's split walk (:func:`_window_ring_part_kernel`) for a ring tile of ``BW`` rows:
    ``step_ring_split`` (at least 16, the smallest ``tl.dot``) from ``step_ring_split_from`` rows on, else 0."""
    rs, start = int(CONFIG["step_ring_split"]), int(CONFIG["step_ring_split_from"])
    return max(16, triton.next_power_of_2(rs)) if rs and start and BW >= start else 0


def window_step_warps(BD: int, BK: int, BV: int, BW: int, fuse: bool) -> int:
    """Warps of :func:`_window_step_kernel`: ``step_warps`` at value blocks <= 64 (twice that for rings of 65-256
    rows, four times beyond: at 4 warps a 128-row ring spills 0.8 KB per thread, a 256-row one 12 KB; with 8 warps
    nothing, 16 B; a 512-row one 2.6 KB at 16 warps, sm_90a offline, K = V = D = 128, triton 3.6), else from the
    tiles it holds. A ring walked in blocks (:func:`ring_block`) passes the block's rows as ``BW``."""
    if BV <= 64 and CONFIG["step_warps"]:
        return int(CONFIG["step_warps"]) * (1 if BW <= 64 else 2 if BW <= 256 else 4)
    return _warps(4 * (BK * BV + BW * (BD + BV) + (BD * BK if fuse else 0)))  # fp32 values live at once


def linear_step_triton(q, k, v, S, z, *, normalize=True, eps=1e-6, out=None, wqx=None, wkx=None, feps=0.0,
                       log_decay=None):
    """The linear step; with ``wqx`` / ``wkx`` (``signed_projections``) ``q`` / ``k`` are the raw rows and the
    kernel computes their Hedgehog features itself. ``log_decay`` ``[B, HK]`` (gated): ``S = e^{ld} S + k v^T``,
    ``z = e^{ld} z + k`` (an fp32 contiguous one is read as is; others are converted, one copy per call)."""
    ensure_applied(q.device)  # this GPU's saved launch configuration (bench kernels --tune), once
    fuse = wqx is not None
    B, H, D = q.shape
    K = wqx.shape[-1] if fuse else D
    HK, V = k.shape[1], v.shape[-1]
    if out is None:
        out = torch.empty((B, H, V), dtype=v.dtype, device=q.device)
    BK, BD = pow2(K), pow2(D)
    G = H // HK
    GH, BV = linear_step_tiles(B * HK, G, V, q.device, fuse)
    split = GH < G  # several head groups per (batch, KV head): the commit kernel adds k v^T to S
    NV = triton.cdiv(V, BV)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    decay = log_decay is not None
    if decay:
        if tuple(log_decay.shape) != (B, HK):
            raise ValueError(f"log_decay must have shape [B, Hk]={(B, HK)}, got {tuple(log_decay.shape)}")
        log_decay = log_decay.float().contiguous()
    ld = log_decay if decay else q
    _linear_step_kernel[(B * HK, NV, triton.cdiv(G, GH))](
        q, k, v, S, z, out, wqx if fuse else q, wkx if fuse else q, ld, H, HK, eps, float(feps),
        K=K, V=V, BK=BK, BV=BV, G=G, NORMALIZE=normalize, D=D, BD=BD, FUSE=fuse, UPDATE_Z=NV == 1 and not split,
        GH=GH, OWN=not split, DECAY=decay, num_warps=_warps(BK * BV * 4),
    )
    if NV > 1 or split:
        BVC, warps = _commit_launch(BD, BK, V, fuse, split)
        _linear_step_commit_kernel[(B * HK,)](
            k, z, wkx if fuse else k, v, S, ld, HK, float(feps), K=K, BK=BK, D=D, BD=BD, FUSE=fuse, V=V, BVC=BVC,
            FOLD=split, DECAY=decay, num_warps=warps)
    return out


def window_step_triton(q, k, fq, fk, v, wf, st, *, scale, eps=1e-12, out=None, wqx=None, wkx=None, feps=0.0,
                       sinks=None):
    """The window step: :func:`_window_step_kernel` over (batch x KV head, value block), then
    :func:`_window_step_commit_kernel` and ``seen += 1``. With ``wqx`` / ``wkx`` (``signed_projections``)
    ``fq`` / ``fk`` are None and the kernels compute the Hedgehog features of ``q`` and ``k`` themselves.
    ``sinks`` (:class:`~linearize.kernels.sinks.Sinks`): read by the step kernel, the ones out of the window
    joining its softmax part."""
    ensure_applied(q.device)
    B, H, D = q.shape
    HK, W = st.k_ring.shape[1], st.k_ring.shape[2]
    K, V = st.fk_ring.shape[-1], st.v_ring.shape[-1]
    if out is None:
        out = torch.empty((B, H, V), dtype=v.dtype, device=q.device)
    if wf.dtype != torch.float32:
        wf = wf.float()
    BD, BK, BW = pow2(D), pow2(K), pow2(W)
    RB = ring_block(BW)
    G = H // HK
    GH, BV = window_step_tiles(B * HK, G, V, q.device)
    split = GH < G  # then the grid has several head groups per (batch, KV head), and the commit kernel folds
    fuse = wqx is not None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    NS = sinks.k.shape[1] if sinks is not None else 0
    sk, sv, spos, svalid = ((sinks.k.contiguous(), sinks.v.contiguous(), sinks.pos.contiguous(),
                             sinks.valid.contiguous()) if sinks is not None else (q, q, st.seen, st.keep))
    RS = ring_split(BW)
    NP, BG = (triton.cdiv(W, RS), max(16, pow2(G))) if RS else (0, 1)
    pm = pt = pa = q
    if RS:  # the rings walked once, in parts; scratch from the graph's pool under CUDA-graph capture
        pm, pt = (torch.empty((B * HK, NP, G), dtype=torch.float32, device=q.device) for _ in range(2))
        pa = torch.empty((B * HK, NP, G, V), dtype=torch.float32, device=q.device)
        low16 = bool(CONFIG["step_ring_part_16bit"]) and st.k_ring.dtype in (torch.bfloat16, torch.float16)
        RBP = min(RS, 64 if max(BD, pow2(V)) <= 128 else 32)  # key and value blocks: 64 fp32 registers each at 128
        _window_ring_part_kernel[(B * HK, NP)](
            q, k, v, st.k_ring, st.v_ring, st.seen, st.keep, pm, pt, pa, H, HK, W, NP, float(scale),
            D=D, V=V, BD=BD, BV=pow2(V), G=G, BG=BG, RS=RS, RB=RBP, LOW16=low16,
            num_warps=int(CONFIG["step_ring_part_warps"]) * (1 if low16 else 2))  # fp32 blocks: twice the warps
        RB = 0
    _window_step_kernel[(B * HK, triton.cdiv(V, BV), triton.cdiv(G, GH))](
        q, q if fuse else fq.contiguous(), k, v, wf.contiguous(), st.S, st.z, st.k_ring, st.fk_ring, st.v_ring,
        st.seen, st.keep, out, wqx if fuse else q, sk, sv, spos, svalid, pm, pt, pa,
        H, HK, W, NS, NP, float(scale), eps, float(feps), D=D, K=K, V=V, BD=BD, BK=BK, BV=BV, BW=BW, G=G,
        FUSE=fuse, GH=GH, OWN=not split, SINKS=NS > 0, BN=pow2(max(NS, 1)), RB=RB, PARTS=RS > 0,
        BP=pow2(max(NP, 1)), BG=BG, num_warps=window_step_warps(BD, BK, BV, RB or (16 if RS else BW), fuse),
    )
    BVC, warps = _commit_launch(BD, BK, V, fuse, split)
    _window_step_commit_kernel[(B * HK,)](
        k, k if fuse else fk.contiguous(), st.k_ring, st.fk_ring, st.z, st.seen, st.keep, wkx if fuse else k,
        v, st.S, st.v_ring, HK, W, float(feps), D=D, K=K, BD=BD, BK=BK, FUSE=fuse, V=V, BVC=BVC, FOLD=split,
        num_warps=warps,
    )
    st.seen.add_(1)
    return out


register("step", CONFIG)  # tunable per GPU (tuning.py)

"""Triton kernels for the gated delta rule (Gated DeltaNet): chunked forward and backward.

Chunks of ``BT`` (64) tokens; per chunk ``c`` the chunk-local inclusive cumulative log decays (``decay_cumsum``: an
fp32 pair, the chunk total its last element), ``gamma = e^c``, ``M = e^{c_i - c_j}`` for ``j <= i`` only (masked
before ``exp``), so no factor exceeds 1. The forward is three launches:

1. ``_prep_kernel`` (chunk-parallel, per KV head): ``A = strict_lower(diag(beta) (K K^T) * M)``, the UT transform
   ``T = (I + A)^{-1}`` by blocked forward substitution (16-row blocks, tensor-core products),
   ``w = T diag(beta gamma) K``, ``u = T diag(beta) V``;
2. ``_walk_kernel`` (one program per (value block, batch x KV head) walking the chunks): the state before each
   chunk ``S`` (stored), the chunk's new values ``U = u - w S`` (written over ``u``), ``S <- e^{c_last} S +
   (e^{c_last - c} K)^T U``;
3. ``_out_kernel`` (chunk-parallel, per query head): ``O = scale (gamma * (Q S) + (tril(Q K^T) * M) U)``.

The backward recomputes 1 and 2 (``T``, the states and ``U`` kept in fp32), then: ``_dvl_kernel`` (``sum_h P_h^T
dO_h``, the intra-chunk part of ``dU``), ``_bwd_walk_kernel`` (reverse over chunks: ``dU = dvl + (e^{c_last - c}
K) dS``, ``dS <- e^{c_last} dS + sum_h (gamma scale Q_h)^T dO_h - w^T dU``), ``_dqk_kernel`` (``dq``, the query-side
parts of ``dk`` and ``d log_decay``) and ``_wy_kernel`` (the UT transform's backward: ``dk``, ``dv``, ``d beta``,
``d log_decay``). The math is in ``kernels/README.md``. The state and the UT transform belong to the KV heads; a
KV head's query heads are looped over inside the programs (GQA is never materialised).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .triton_common import (decay_cumsum, decay_pairs, interpreting, launch, mm, mm_acc, new_empty, num_sms, pow2,
                            prec, to16)
from .tuning import ensure_applied, register

_INTERP = tl.constexpr(interpreting())

CONFIG = {  # launch configuration: untuned; registers and spills from an offline sm_90a compile (kernels/README.md)
    "bt": 64,  # chunk of every kernel (they share the per-chunk states)
    "prep_warps": 4,  # 255 registers, no spills (214 with the row steps, 226 with prep_diag_rows 0)
    # the UT inverse's 16-row diagonal blocks on [16, 16] tiles (15 row steps of two small reductions) instead of 15
    # masked [BT, BT] tensor-core products (_unit_lower_inverse): H100, bf16, 2K x 16, the UT launch 1.69 -> 1.62 ms
    "prep_diag_rows": 1,
    # for 16-bit keys, those diagonal blocks by doubling instead (_diagonal_inverses_doubling: (I - N)(I + N^2)
    # (I + N^4)(I + N^8), six batched fp32 [16, 16] products three squarings deep, where the row steps are 15
    # dependent reductions). H100, bf16, 2K x 16: the prep 1.22 -> 0.92 ms, forward 2.87 -> 2.59 ms, forward and
    # backward 15.17 -> 14.50 ms; relative error 3.81e-3 either way (fla's 3.77e-3)
    "prep_diag_doubling": 1,
    # the forward's w = T (beta gamma k) and u = T (beta v) on 16-bit operands (16-bit inputs; as fla's
    # recompute_w_u) instead of tf32 ones; the transform T is computed in fp32 either way. H200, bf16, 2K x 16: the
    # prep launch 1.68 -> 1.24 ms; relative error 3.1e-3 -> 3.5e-3 (fla's 3.8e-3)
    "prep_16bit": 1,
    # the UT inverse of a 64-token chunk as four 16-row blocks (_blocked_unit_lower_inverse: the blocks below the
    # diagonal by [16, 16] products, no masked [64, 64] ones; other chunk sizes keep _unit_lower_inverse); 207
    # registers, no spills. H200, bf16, 2K x 16: slower (the prep 1.68 -> 1.82 ms; 1.24 -> 1.40 with prep_16bit)
    "prep_blocks": 0,
    # the prep as two launches, as fla's (solve_tril, then recompute_w_u): the UT transforms alone (_ut_kernel, per
    # chunk and KV head; a forward's passed on in the keys' 16-bit dtype under prep_16bit, fp32 otherwise), then w and
    # u (_wu_kernel, a program per chunk, KV head and w or value block of u): fewer registers per program and more
    # programs than the one launch holding T, k and every u block at once, for 8 (16-bit) or 16 KB more traffic a chunk
    "prep_split": 0,
    "ut_warps": 4,
    "wu_warps": 4,
    # value block of the forward and backward walks (the [K, BV] fp32 state lives in registers), halved to 32 while
    # the grid has fewer than walk_waves programs per SM (long T, small batch: the walk is serial); walk_warps for
    # state tiles of 128 x 64 or more, walk_warps_narrow below (sm_90a offline, Triton 3.6, K = V = 128, BV 64: the
    # forward walk 222 registers at 8 warps, 255 at 4; the backward walk 44 bytes spilled at 8, 156 at 4)
    "walk_bv": 64,
    "walk_waves": 1.0,
    "walk_warps": 8,
    "walk_warps_narrow": 4,
    "walk_stages": 2,
    # the forward walk's two products on 16-bit operands (16-bit inputs; as fla's walk) instead of tf32 ones; the
    # state accumulates in fp32 either way and the backward recomputes the walk in fp32. H100, bf16: the walk 1.27
    # -> 1.01 ms at 2K x 16, 2.19 -> 1.58 ms at 32K x 1; relative error 3.0e-3 -> 3.1e-3 (fla's 3.8e-3)
    "walk_16bit": 1,
    # the output kernel's in-chunk product (tril(q k^T) * M) U on 16-bit operands (16-bit inputs; as fla's) instead
    # of tf32 ones. H200, bf16, 2K x 16: the output launch 0.81 -> 0.57 ms; relative error 3.1e-3 -> 3.5e-3
    "out_16bit": 1,
    "out_bv": 128,  # value block of the output kernel and of the backward's dvl kernel (162 registers; 136 at 64)
    "out_warps": 4,
    # value block the chunk-parallel backward kernels loop over: at 64 the UT backward spilled ~350 bytes, at 32
    # 88 (the query-side kernel none at either)
    "bwd_bv": 32,
    "bwd_warps": 8,
    # the forward's chunk states in fp32 instead of the inputs' dtype: twice the bytes of its largest intermediate,
    # bf16 outputs 3.9e-3 instead of 5.8e-3 off float64 under the interpreter (its bf16 output alone: 3.3e-3)
    "fwd_states_fp32": False,
    # the forward's w, u and U in the inputs' 16-bit dtype instead of fp32 (as fla keeps them): half the bytes the
    # walk and output kernels read and write, most of the forward's traffic; the state moves by the unrounded U, so
    # only this chunk's outputs see the rounding; the backward recomputes them in fp32 either way. H100, bf16, 2K x
    # 16: forward 4.34 -> 3.84 ms, 2.1e-3 -> 3.0e-3 relative error (fla's: 3.8e-3; kernels/README.md)
    "fwd_inter_16bit": True,
    # the backward's chunk states and state gradients ([B, HK, N, K, V], its largest intermediates: 1 GB each in
    # fp32 at 2K x 16, H = 32, K = V = 128, written once and read twice) stored in the inputs' 16-bit dtype (16-bit
    # inputs; as fla keeps them); both walks still carry them in fp32 registers, so only the chunk-parallel
    # kernels' products see the rounding. Not yet timed: off
    "bwd_states_16bit": 0,
    # the backward's w, U and dU ([B, T, HK, K or V], fp32: written once, read two or three times) stored in the
    # inputs' 16-bit dtype (16-bit inputs; as fla keeps them); the walks move by the unrounded U and dU. H100,
    # Triton 3.7.1: forward + backward 14.00 -> 12.58 ms at 2K x 16, 16.01 -> 13.63 ms at 32K x 1 (the states in
    # 16 bits: 13.23 / 15.48), the quick check unchanged (3.8e-3). Off until the GPU tier passes with it: under the
    # interpreter (truncating bf16 casts, K = 16) dk reaches 1.08e-2 with prep_blocks and the row steps
    "bwd_inter_16bit": 0,
}


@triton.jit
def _tf32(x):
    """``x`` (fp32) with the low 13 mantissa bits cleared: a tf32 operand (truncated, the worse case)."""
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def dot32(a, b, PREC: tl.constexpr):
    """Product of fp32 operands with fp32 accumulation: exact for fp32 inputs (``PREC`` "ieee"), tf32 tensor cores
    for 16-bit inputs ("tf32": 10-bit mantissas, where bf16 operands would keep 7). The interpreter rounds the
    operands to tf32 itself, so the tests on the CPU see the GPU's error."""
    if _INTERP:
        if PREC == "tf32":
            return tl.dot(_tf32(a), _tf32(b), input_precision="ieee")
        else:
            return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _chunk_decays(LG, row, mt, BT: tl.constexpr):
    """``(gamma [BT] = e^c, wk [BT] = e^{c_last - c}, keep = e^{c_last}, M [BT, BT] = e^{c_i - c_j} (j <= i, else
    0))`` of a chunk, ``c`` its inclusive cumulative log decays (0 past T)."""
    hi, lo, last_hi, last_lo = decay_cumsum(tl.load(LG + row, mask=mt, other=0.0), BT)
    return (tl.exp(hi + lo), tl.exp((last_hi - hi) + (last_lo - lo)), tl.exp(last_hi + last_lo),
            decay_pairs(hi, lo, BT))


@triton.jit
def _walk_decays(LG, row, mt):
    """``(gamma [BT] = e^c, wk [BT] = e^{c_last - c}, keep = e^{c_last})`` of a chunk for the walks, without
    :func:`_chunk_decays`' ``[BT, BT]`` work: ``c`` a plain prefix sum, ``c_last - c_t`` the inclusive suffix sum
    less the token's own log decay (off by an ulp of that suffix sum, which the ``exp`` shrinks: ``wk`` within
    2e-7 absolute and 7e-7 relative where it exceeds 1e-3, for log decays down to -5 in fp32 sums against float64;
    a bf16 forward is 4e-3 off), and ``c_last`` the chunk's total. A shifted load summing the later tokens alone
    costs 6-16 more registers."""
    lg = tl.load(LG + row, mask=mt, other=0.0)
    return tl.exp(tl.cumsum(lg, 0)), tl.exp(tl.cumsum(lg, 0, reverse=True) - lg), tl.exp(tl.sum(lg, 0))


@triton.jit
def _diagonal_inverses(A, BT: tl.constexpr, SB: tl.constexpr):
    """The inverses ``[BT / SB, SB, SB]`` of the diagonal blocks of ``I + A`` (``A [BT, BT]`` strictly lower, fp32):
    the blocks are taken out of a ``[NB, SB, NB, SB]`` view and each row ``t`` is ``e_t - A_t. D^{-1}`` as two
    reductions over ``SB`` (all blocks at once, exact fp32): ``SB - 1`` steps on ``BT * SB`` elements each."""
    NB: tl.constexpr = BT // SB
    bb = tl.arange(0, NB)
    on = bb[:, None, None, None] == bb[None, None, :, None]  # [NB, 1, NB, 1]: block b's own columns
    Ad = tl.sum(tl.where(on, tl.reshape(A, [NB, SB, NB, SB]), 0.0), axis=2)  # [NB, SB, SB]
    s = tl.arange(0, SB)
    D = tl.zeros([NB, SB, SB], dtype=tl.float32) + tl.where(s[:, None] == s[None, :], 1.0, 0.0)[None, :, :]
    for t in range(1, SB):
        row = (s == t)[None, :, None]
        a = tl.sum(tl.where(row, Ad, 0.0), axis=1)  # [NB, SB]: row t of each block's A
        D = tl.where(row, D - tl.sum(a[:, :, None] * D, axis=1)[:, None, :], D)
    return D


@triton.jit
def _diagonal_inverses_doubling(A, BT: tl.constexpr, SB: tl.constexpr):
    """:func:`_diagonal_inverses` by the finite Neumann series in product form: with ``N`` a strictly lower
    ``[SB, SB]`` block (``N^SB = 0``), ``(I + N)^{-1} = (I - N)(I + N^2)(I + N^4)(I + N^8)``: batched fp32 products
    (``ieee``: exact fp32 sums, no tf32 rounding), ``2 log2(SB) - 2`` of them three squarings deep, instead of
    ``SB - 1`` dependent row steps (``CONFIG["prep_diag_doubling"]``)."""
    NB: tl.constexpr = BT // SB
    bb = tl.arange(0, NB)
    on = bb[:, None, None, None] == bb[None, None, :, None]  # [NB, 1, NB, 1]: block b's own columns
    N = tl.sum(tl.where(on, tl.reshape(A, [NB, SB, NB, SB]), 0.0), axis=2)  # [NB, SB, SB]
    s = tl.arange(0, SB)
    P = tl.where(s[:, None] == s[None, :], 1.0, 0.0)[None, :, :] - N  # the series' terms below 2
    for i in tl.static_range(4):  # SB <= 16
        if (2 << i) < SB:  # P: the terms below 2^(i+2), from N^(2^(i+1))
            N = tl.dot(N, N, input_precision="ieee")
            P = P + tl.dot(P, N, input_precision="ieee")
    return P


@triton.jit
def _on_diagonal(D, NB: tl.constexpr, SB: tl.constexpr):
    """``D [NB, SB, SB]`` as the diagonal blocks of an ``[NB, SB, NB, SB]`` tile (zeros elsewhere)."""
    bb = tl.arange(0, NB)
    return tl.where(bb[:, None, None, None] == bb[None, None, :, None], D[:, :, None, :], 0.0)


@triton.jit
def _diagonal_block_inverse(A, BT: tl.constexpr, SB: tl.constexpr, DOUBLING: tl.constexpr = False):
    """The block-diagonal ``D^{-1} [BT, BT]`` of ``I + A`` (:func:`_diagonal_inverses`, or under ``DOUBLING``
    :func:`_diagonal_inverses_doubling`, put back on the diagonal), where the tile-wide form multiplies
    ``[BT, BT]`` tiles."""
    NB: tl.constexpr = BT // SB
    if DOUBLING:
        D = _diagonal_inverses_doubling(A, BT, SB)
    else:
        D = _diagonal_inverses(A, BT, SB)
    return tl.reshape(_on_diagonal(D, NB, SB), [BT, BT])


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, PREC: tl.constexpr, DIAG: tl.constexpr = 0):
    """``(I + A)^{-1}`` of a strictly lower triangular ``A [BT, BT]`` (fp32) by blocked forward substitution, each
    step a ``tl.dot`` (tensor cores for 16-bit inputs): the diagonal ``[SB, SB]`` blocks first (row ``t`` of each
    block is ``e_t - A_t. Tm``, the block's earlier rows already final; all blocks at once), then each block row
    ``r`` below the first as ``D_r^{-1} (E_r - A_r,<r T_<r)`` with ``D^{-1}`` the block-diagonal inverse. ``SB`` =
    16 (the smallest ``tl.dot`` side): 15 + 2 x (BT / 16 - 1) products instead of ``BT`` steps that each reduce a
    whole tile across threads (``DIAG`` 0). ``DIAG`` 1 / 2: the diagonal blocks on ``[SB, SB]`` tiles instead
    (:func:`_diagonal_block_inverse`), by row steps (``CONFIG["prep_diag_rows"]``) or by doubling
    (``CONFIG["prep_diag_doubling"]``)."""
    SB: tl.constexpr = 16 if BT > 16 else BT
    ar = tl.arange(0, BT)
    blk = ar // SB
    same = blk[:, None] == blk[None, :]
    if DIAG:
        Dinv = _diagonal_block_inverse(A, BT, SB, DIAG == 2)
    else:
        Ad = tl.where(same, A, 0.0)  # the diagonal blocks (strictly lower)
        Dinv = tl.where(ar[:, None] == ar[None, :], 1.0, 0.0)
        for t in range(1, SB):
            sel = (ar % SB) == t  # row t of every block
            Dinv = tl.where(sel[:, None], Dinv - dot32(tl.where(sel[:, None], Ad, 0.0), Dinv, PREC), Dinv)
    Ao = tl.where(same, 0.0, A)  # below the diagonal blocks
    Tm = Dinv
    for r in range(1, BT // SB):
        X = dot32(tl.where((blk == r)[:, None], Ao, 0.0), Tm, PREC)  # rows of block r: A_r,<r T_<r (else 0)
        Tm = Tm - dot32(Dinv, X, PREC)
    return Tm


@triton.jit
def _chunk_rows(i, pbh, T, HK, BT: tl.constexpr):
    """Chunk ``i`` of sequence ``pbh`` (batch x KV head): positions in the chunk ``[BT]``, which are real tokens,
    and their rows of a ``[B, T, HK, ...]`` tensor (int64)."""
    ar = tl.arange(0, BT)
    ot = i * BT + ar
    return ar, ot < T, ((pbh // HK).to(tl.int64) * T + ot) * HK + pbh % HK


@triton.jit
def _chunk_transform(Kp, BETA, LG, row, mt, ok, mk, K: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
                     DIAG: tl.constexpr, BLOCKS: tl.constexpr):
    """A chunk's keys ``[BT, BK]`` (their dtype), ``beta``, ``gamma`` and its UT transform ``T = (I + A)^{-1}``
    (fp32), ``A = strict_lower(diag(beta) (K K^T) * M)``."""
    ar = tl.arange(0, BT)
    k = tl.load(Kp + row[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
    beta = tl.load(BETA + row, mask=mt, other=0.0).to(tl.float32)
    gam, _, _, M = _chunk_decays(LG, row, mt, BT)
    A = tl.where(ar[:, None] > ar[None, :], mm(k, tl.trans(k), PREC) * M, 0.0) * beta[:, None]
    if BLOCKS:
        Tm = _blocked_unit_lower_inverse(A, BT, PREC)
    else:
        Tm = _unit_lower_inverse(A, BT, PREC, DIAG)
    return k, beta, gam, Tm


@triton.jit
def _transform_product(Tm, x, DT: tl.constexpr, PREC: tl.constexpr, LOW16: tl.constexpr):
    """``T x`` (``x [BT, *]`` fp32) with fp32 accumulation: on operands of the 16-bit dtype ``DT`` under ``LOW16``
    (``Tm`` already in it, or fp32 and rounded to it here, as fla's ``recompute_w_u``), else tf32 / fp32 ones
    (``Tm`` fp32)."""
    if LOW16:
        return mm(to16(Tm, DT) if Tm.dtype == tl.float32 else Tm, to16(x, DT), PREC)
    else:
        return dot32(Tm, x, PREC)


@triton.jit
def _prep_kernel(
    Kp, Vp, BETA, LG,  # k [B,T,HK,K], v [B,T,HK,V], beta [B,T,HK], log decays [B,T,HK] fp32
    W, U, TM,  # w [B,T,HK,K], u [B,T,HK,V] (fp32; 16-bit under fwd_inter_16bit), STORE_T: T [B,HK,N,BT,BT] fp32
    T, HK,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, NV_BLK: tl.constexpr,
    STORE_T: tl.constexpr, PREC: tl.constexpr, DIAG: tl.constexpr, LOW16: tl.constexpr,
    BLOCKS: tl.constexpr = False,
):
    """Program (chunk, batch x KV head): the UT transform of the chunk and ``w``, ``u``. ``LOW16`` (the forward
    under ``CONFIG["prep_16bit"]``, 16-bit inputs): the two products that make ``w`` and ``u`` take the transform
    and their right-hand sides in the keys' dtype, as fla's ``recompute_w_u`` does; the transform itself stays
    fp32."""
    i = tl.program_id(0)
    pbh = tl.program_id(1)
    ar, mt, row = _chunk_rows(i, pbh, T, HK, BT)  # [BT]
    ok = tl.arange(0, BK)
    mk = ok < K
    k, beta, gam, Tm = _chunk_transform(Kp, BETA, LG, row, mt, ok, mk, K, BT, PREC, DIAG, BLOCKS)
    if STORE_T:
        N = tl.cdiv(T, BT)
        tl.store(TM + ((pbh.to(tl.int64) * N + i) * BT + ar[:, None]) * BT + ar[None, :], Tm)
    DT = Kp.dtype.element_ty
    if LOW16:
        Tm = to16(Tm, DT)  # rounded once for both products
    wv = _transform_product(Tm, k.to(tl.float32) * (beta * gam)[:, None], DT, PREC, LOW16)
    tl.store(W + row[:, None] * K + ok[None, :], wv.to(W.dtype.element_ty), mask=mt[:, None] & mk[None, :])
    for vb in tl.static_range(NV_BLK):
        ov = vb * BV + tl.arange(0, BV)
        mv = ov < V
        v = tl.load(Vp + row[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        uv = _transform_product(Tm, v.to(tl.float32) * beta[:, None], DT, PREC, LOW16)
        tl.store(U + row[:, None] * V + ov[None, :], uv.to(U.dtype.element_ty), mask=mt[:, None] & mv[None, :])


@triton.jit
def _ut_kernel(
    Kp, BETA, LG,  # k [B,T,HK,K], beta [B,T,HK], log decays [B,T,HK] fp32
    TM,  # T [B,HK,N,BT,BT]: fp32, or the keys' 16-bit dtype for a forward under prep_16bit
    T, HK,
    K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, DIAG: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """Program (chunk, batch x KV head) of the split prep (``CONFIG["prep_split"]``): the chunk's UT transform
    alone, stored for :func:`_wu_kernel`."""
    i = tl.program_id(0)
    pbh = tl.program_id(1)
    ar, mt, row = _chunk_rows(i, pbh, T, HK, BT)  # [BT]
    ok = tl.arange(0, BK)
    _, _, _, Tm = _chunk_transform(Kp, BETA, LG, row, mt, ok, ok < K, K, BT, PREC, DIAG, BLOCKS)
    N = tl.cdiv(T, BT)
    out = TM + ((pbh.to(tl.int64) * N + i) * BT + ar[:, None]) * BT + ar[None, :]
    if TM.dtype.element_ty == tl.float32:
        tl.store(out, Tm)
    else:
        tl.store(out, to16(Tm, TM.dtype.element_ty))


@triton.jit
def _wu_kernel(
    Kp, Vp, BETA, LG, TM,  # k [B,T,HK,K], v [B,T,HK,V], beta [B,T,HK], log decays [B,T,HK], T [B,HK,N,BT,BT]
    W, U,  # w [B,T,HK,K], u [B,T,HK,V]
    T, HK,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
    LOW16: tl.constexpr,
):
    """Program (chunk, batch x KV head, part) of the split prep: part 0 ``w = T diag(beta gamma) K``, part
    ``j > 0`` value block ``j - 1`` of ``u = T diag(beta) V``, from the transform :func:`_ut_kernel` stored."""
    i = tl.program_id(0)
    pbh = tl.program_id(1)
    ar, mt, row = _chunk_rows(i, pbh, T, HK, BT)  # [BT]
    part = tl.program_id(2)
    N = tl.cdiv(T, BT)
    Tm = tl.load(TM + ((pbh.to(tl.int64) * N + i) * BT + ar[:, None]) * BT + ar[None, :])
    beta = tl.load(BETA + row, mask=mt, other=0.0).to(tl.float32)
    DT = Kp.dtype.element_ty
    if part == 0:
        ok = tl.arange(0, BK)
        mk = ok < K
        k = tl.load(Kp + row[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        hi, lo, _, _ = decay_cumsum(tl.load(LG + row, mask=mt, other=0.0), BT)
        wv = _transform_product(Tm, k.to(tl.float32) * (beta * tl.exp(hi + lo))[:, None], DT, PREC, LOW16)
        tl.store(W + row[:, None] * K + ok[None, :], wv.to(W.dtype.element_ty), mask=mt[:, None] & mk[None, :])
    else:
        ov = (part - 1) * BV + tl.arange(0, BV)
        mv = ov < V
        v = tl.load(Vp + row[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        uv = _transform_product(Tm, v.to(tl.float32) * beta[:, None], DT, PREC, LOW16)
        tl.store(U + row[:, None] * V + ov[None, :], uv.to(U.dtype.element_ty), mask=mt[:, None] & mv[None, :])


@triton.jit
def _is_block(bi: tl.constexpr, bj: tl.constexpr, NB: tl.constexpr):
    """``[NB, 1, NB, 1]``: where block ``(bi, bj)`` of an ``[NB, SB, NB, SB]`` view lies."""
    b = tl.arange(0, NB)
    return (b[:, None, None, None] == bi) & (b[None, None, :, None] == bj)


@triton.jit
def _block(X4, bi: tl.constexpr, bj: tl.constexpr, NB: tl.constexpr):
    """Block ``(bi, bj)`` ``[SB, SB]`` of a ``[NB, SB, NB, SB]`` view of a ``[BT, BT]`` tile (a select and two
    reductions: registers cannot be sliced)."""
    return tl.sum(tl.sum(tl.where(_is_block(bi, bj, NB), X4, 0.0), 2), 0)


@triton.jit
def _place(X4, Y, bi: tl.constexpr, bj: tl.constexpr, NB: tl.constexpr):
    """``X4 [NB, SB, NB, SB]`` with block ``(bi, bj)`` replaced by ``Y [SB, SB]``."""
    return tl.where(_is_block(bi, bj, NB), Y[None, :, None, :], X4)


@triton.jit
def _nth(D, n: tl.constexpr, NB: tl.constexpr):
    """``D[n]`` of ``D [NB, SB, SB]``."""
    return tl.sum(tl.where((tl.arange(0, NB) == n)[:, None, None], D, 0.0), 0)


@triton.jit
def _blocked_unit_lower_inverse(A, BT: tl.constexpr, PREC: tl.constexpr):
    """``(I + A)^{-1}`` of a strictly lower ``A [64, 64]`` (fp32) as four 16-row blocks: the diagonal inverses on
    ``[16, 16]`` tiles (:func:`_diagonal_inverses`), then the six blocks below them by block forward
    substitution, ``T_ij = -D_i sum_{j <= m < i} A_im T_mj``: 16 products of ``[16, 16]`` tiles, three deep, where
    :func:`_unit_lower_inverse` multiplies masked ``[64, 64]`` tiles six deep (``CONFIG["prep_blocks"]``)."""
    SB: tl.constexpr = 16
    NB: tl.constexpr = 4
    D = _diagonal_inverses(A, BT, SB)  # [NB, SB, SB]
    A4 = tl.reshape(A, [NB, SB, NB, SB])
    T00, T11, T22, T33 = _nth(D, 0, NB), _nth(D, 1, NB), _nth(D, 2, NB), _nth(D, 3, NB)
    A10, A20, A21 = _block(A4, 1, 0, NB), _block(A4, 2, 0, NB), _block(A4, 2, 1, NB)
    A30, A31, A32 = _block(A4, 3, 0, NB), _block(A4, 3, 1, NB), _block(A4, 3, 2, NB)
    T10 = -dot32(T11, dot32(A10, T00, PREC), PREC)
    T21 = -dot32(T22, dot32(A21, T11, PREC), PREC)
    T32 = -dot32(T33, dot32(A32, T22, PREC), PREC)
    T20 = -dot32(T22, dot32(A20, T00, PREC) + dot32(A21, T10, PREC), PREC)
    T31 = -dot32(T33, dot32(A31, T11, PREC) + dot32(A32, T21, PREC), PREC)
    T30 = -dot32(T33, dot32(A30, T00, PREC) + dot32(A31, T10, PREC) + dot32(A32, T20, PREC), PREC)
    T4 = _place(_place(_place(_on_diagonal(D, NB, SB), T10, 1, 0, NB), T20, 2, 0, NB), T21, 2, 1, NB)
    T4 = _place(_place(_place(T4, T30, 3, 0, NB), T31, 3, 1, NB), T32, 3, 2, NB)
    return tl.reshape(T4, [BT, BT])


@triton.jit
def _walk_start(INIT, pv, pbh, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                HAS_INIT: tl.constexpr):
    """A walk's tile of value block ``pv``: key rows ``ok [BK]``, value columns ``ov [BV]``, their masks, the
    ``[BK, BV]`` offsets ``kv`` into a ``[K, V]`` state and its mask, and the block of the state (or, in the
    backward, of its gradient) the walk starts from: ``INIT``'s (fp32) under ``HAS_INIT``, else zeros."""
    ok = tl.arange(0, BK)
    ov = pv * BV + tl.arange(0, BV)
    mk = ok < K
    mv = ov < V
    m2 = mk[:, None] & mv[None, :]
    kv = ok[:, None] * V + ov[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_INIT:
        S += tl.load(INIT + pbh.to(tl.int64) * K * V + kv, mask=m2, other=0.0)
    return ok, ov, mk, mv, m2, kv, S


@triton.jit
def _walk_new(W, U, DT: tl.constexpr, S, row, ok, ov, mt, mk, mv, K: tl.constexpr, V: tl.constexpr,
              PREC: tl.constexpr, LOW16: tl.constexpr):
    """A chunk's new values ``U = u - w S`` ``[BT, BV]`` (fp32) from ``w``, ``u`` at ``row``; ``LOW16``: the product
    on operands of the keys' dtype ``DT``, else fp32 ones."""
    w = tl.load(W + row[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
    u = tl.load(U + row[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)
    if LOW16:
        return u - mm(w.to(DT), to16(S, DT), PREC)
    else:
        return u - dot32(w.to(tl.float32), S, PREC)


@triton.jit
def _walk_advance(S, kt, wk, keep, new, DT: tl.constexpr, PREC: tl.constexpr, LOW16: tl.constexpr):
    """The state at the chunk's end: ``e^{c_last} S + k^T (e^{c_last - c} U)``, with ``kt [BK, BT]`` the chunk's
    keys transposed (loaded so from memory) and the decay on the values; ``LOW16`` as in :func:`_walk_new`, the
    product then accumulating into the decayed state."""
    nd = new * wk[:, None]  # new values decayed to the chunk's end
    if LOW16:
        return mm_acc(kt.to(DT), to16(nd, DT), S * keep, PREC)
    else:
        return S * keep + dot32(kt.to(tl.float32), nd, PREC)


@triton.jit
def _walk_kernel(
    Kp, W, U, LG,  # k [B,T,HK,K], w [B,T,HK,K], u [B,T,HK,V] (becomes U = u - w S; fp32 or 16-bit), log decays
    INIT, HS, FIN,  # initial state [B,HK,K,V] fp32; states before each chunk [B,HK,N,K,V]; final state fp32
    T, HK,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr, PREC: tl.constexpr, LOW16: tl.constexpr,
):
    """Program (value block, batch x KV head): walks the chunks in order with the ``[K, BV]`` state in fp32
    registers, stores it before each chunk, turns ``u`` into ``U = u - w S`` in place and moves the state to the
    chunk's end. A value block's columns depend only on themselves, so the blocks run independently. The
    products that feed the state take fp32 operands (``dot32``): this path accumulates over the whole sequence.
    ``LOW16`` (the forward under ``CONFIG["walk_16bit"]``, 16-bit inputs): their operands in the keys' dtype
    instead, as fla's walk; the state still accumulates in fp32."""
    pbh = tl.program_id(1)
    b = pbh // HK
    hk = pbh % HK
    ok, ov, mk, mv, m2, kv, S = _walk_start(INIT, tl.program_id(0), pbh, K, V, BK, BV, HAS_INIT)
    N = tl.cdiv(T, BT)
    ar = tl.arange(0, BT)
    for i in range(N):
        tl.store(HS + (pbh.to(tl.int64) * N + i) * K * V + kv, S.to(HS.dtype.element_ty), mask=m2)
        ot = i * BT + ar
        mt = ot < T
        row = (b.to(tl.int64) * T + ot) * HK + hk
        _, wk, keep = _walk_decays(LG, row, mt)
        new = _walk_new(W, U, Kp.dtype.element_ty, S, row, ok, ov, mt, mk, mv, K, V, PREC, LOW16)
        up = U + row[:, None] * V + ov[None, :]
        tl.store(up, new.to(U.dtype.element_ty), mask=mt[:, None] & mv[None, :])  # the state moves by fp32 U
        kt = tl.load(Kp + row[None, :] * K + ok[:, None], mask=mk[:, None] & mt[None, :], other=0.0)  # [BK, BT]
        S = _walk_advance(S, kt, wk, keep, new, Kp.dtype.element_ty, PREC, LOW16)
    if STORE_FINAL:
        tl.store(FIN + pbh.to(tl.int64) * K * V + kv, S, mask=m2)


@triton.jit
def _out_kernel(
    Q, Kp, U, HS, LG, O,  # q [B,T,H,K], k, U [B,T,HK,V] (fp32 or 16-bit), states [B,HK,N,K,V], log decays, o [B,T,H,V]
    T, H, HK, scale,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
    S32: tl.constexpr, LOW16: tl.constexpr = False,
):
    """Program (value block, chunk, batch x query head): ``o = scale (gamma * (q S) + (tril(q k^T) * M) U)``;
    ``q S`` a 16-bit product for 16-bit inputs unless the states are fp32 (``S32``); ``LOW16`` (16-bit inputs
    under ``CONFIG["out_16bit"]``): the chunk's own part too, on the keys' dtype as fla's output kernel, instead of
    tf32."""
    pv = tl.program_id(0)
    i = tl.program_id(1)
    pbh = tl.program_id(2)
    b = pbh // H
    h = pbh % H
    hk = h // (H // HK)
    DT = Kp.dtype.element_ty
    ar = tl.arange(0, BT)
    ot = i * BT + ar
    mt = ot < T
    qrow = (b.to(tl.int64) * T + ot) * H + h
    krow = (b.to(tl.int64) * T + ot) * HK + hk
    ok = tl.arange(0, BK)
    ov = pv * BV + tl.arange(0, BV)
    mk = ok < K
    mv = ov < V
    N = tl.cdiv(T, BT)
    gam, _, _, M = _chunk_decays(LG, krow, mt, BT)
    q = tl.load(Q + qrow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
    k = tl.load(Kp + krow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
    S = tl.load(HS + ((b * HK + hk).to(tl.int64) * N + i) * K * V + ok[:, None] * V + ov[None, :],
                mask=mk[:, None] & mv[None, :], other=0.0)
    new = tl.load(U + krow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
    if not LOW16:
        new = new.to(tl.float32)
    if S32:
        o = dot32(q.to(tl.float32), S, PREC)
    else:
        o = mm(q, S.to(DT), PREC)
    if LOW16:
        o = gam[:, None] * o + mm(to16(mm(q, tl.trans(k), PREC) * M, DT), new.to(DT), PREC)
    else:
        o = gam[:, None] * o + dot32(mm(q, tl.trans(k), PREC) * M, new, PREC)
    tl.store(O + qrow[:, None] * V + ov[None, :], (o * scale).to(O.dtype.element_ty), mask=mt[:, None] & mv[None, :])


@triton.jit
def _dvl_kernel(
    Q, Kp, DO, LG, DVL,  # q [B,T,H,K], k, do [B,T,H,V], log decays, dvl [B,T,HK,V] fp32
    T, H, HK, scale,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, G: tl.constexpr,
    PREC: tl.constexpr,
):
    """Program (value block, chunk, batch x KV head): ``dvl = sum_h P_h^T dO_h`` over the KV group's query heads,
    the part of ``dU`` inside the chunk."""
    pv = tl.program_id(0)
    i = tl.program_id(1)
    pbh = tl.program_id(2)
    b = pbh // HK
    hk = pbh % HK
    ar = tl.arange(0, BT)
    ot = i * BT + ar
    mt = ot < T
    krow = (b.to(tl.int64) * T + ot) * HK + hk
    ok = tl.arange(0, BK)
    ov = pv * BV + tl.arange(0, BV)
    mk = ok < K
    mv = ov < V
    _, _, _, M = _chunk_decays(LG, krow, mt, BT)
    k = tl.load(Kp + krow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    for g in tl.static_range(G):
        qrow = (b.to(tl.int64) * T + ot) * H + hk * G + g
        q = tl.load(Q + qrow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        do = tl.load(DO + qrow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        P = mm(q, tl.trans(k), PREC) * M * scale  # [t, j]
        acc += dot32(tl.trans(P), do.to(tl.float32), PREC)
    tl.store(DVL + krow[:, None] * V + ov[None, :], acc.to(DVL.dtype.element_ty), mask=mt[:, None] & mv[None, :])


@triton.jit
def _bwd_walk_kernel(
    Q, Kp, W, DO, LG,  # q, k, w [B,T,HK,K] fp32, do, log decays
    DU,  # [B,T,HK,V] fp32: dvl in, dU out
    DSF, DH, DS0,  # final-state gradient [B,HK,K,V]; state gradients after each chunk [B,HK,N,K,V] fp32; dS0
    T, H, HK, scale,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, G: tl.constexpr,
    HAS_DSF: tl.constexpr, STORE_DS0: tl.constexpr, PREC: tl.constexpr,
):
    """Program (value block, batch x KV head): walks the chunks backwards with the ``[K, BV]`` state gradient in
    fp32 registers, stores it after each chunk (``dS1``), completes ``dU`` in place and moves the gradient to the
    chunk's start; at the end it is the initial state's gradient."""
    pbh = tl.program_id(1)
    b = pbh // HK
    hk = pbh % HK
    ok, ov, mk, mv, m2, kv, dS = _walk_start(DSF, tl.program_id(0), pbh, K, V, BK, BV, HAS_DSF)
    N = tl.cdiv(T, BT)
    ar = tl.arange(0, BT)
    for it in range(N):
        i = N - 1 - it
        tl.store(DH + (pbh.to(tl.int64) * N + i) * K * V + kv, dS.to(DH.dtype.element_ty), mask=m2)
        ot = i * BT + ar
        mt = ot < T
        krow = (b.to(tl.int64) * T + ot) * HK + hk
        gam, wk, keep = _walk_decays(LG, krow, mt)
        k = tl.load(Kp + krow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        dup = DU + krow[:, None] * V + ov[None, :]
        du = tl.load(dup, mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)
        du += dot32(k.to(tl.float32) * wk[:, None], dS, PREC)
        tl.store(dup, du.to(DU.dtype.element_ty), mask=mt[:, None] & mv[None, :])  # the gradient moves by fp32 du
        wt = tl.load(W + krow[None, :] * K + ok[:, None], mask=mk[:, None] & mt[None, :], other=0.0)  # [BK, BT]
        wt = wt.to(tl.float32)
        dS = dS * keep - dot32(wt, du, PREC)
        for g in tl.static_range(G):
            qrow = (b.to(tl.int64) * T + ot) * H + hk * G + g
            qt = tl.load(Q + qrow[None, :] * K + ok[:, None], mask=mk[:, None] & mt[None, :], other=0.0)  # [BK, BT]
            do = tl.load(DO + qrow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
            dS += dot32(qt.to(tl.float32) * (gam * scale)[None, :], do.to(tl.float32), PREC)
    if STORE_DS0:
        tl.store(DS0 + pbh.to(tl.int64) * K * V + kv, dS, mask=m2)


@triton.jit
def _dqk_kernel(
    Q, Kp, DO, HS, U, LG,  # q, k, do, states before each chunk [B,HK,N,K,V] fp32, U [B,T,HK,V] fp32, log decays
    DQ, DKA, DGA,  # dq [B,T,H,K]; the query side's dk [B,T,HK,K] fp32 and dL/dc [B,T,HK] fp32
    T, H, HK, scale,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, G: tl.constexpr,
    NV_BLK: tl.constexpr, PREC: tl.constexpr,
):
    """Program (chunk, batch x KV head), each query head of the group in turn, with ``X = dO S0^T`` and ``DP =
    (dO U^T) * M * scale`` summed over value blocks: ``dq = gamma scale X + DP K``; the group's ``DP^T Q`` (the
    keys' share of the outputs) and the outputs' share of ``dL/dc`` (``c`` the chunk-local cumulative log decay):
    ``gamma scale q.X + rowsum(DP * QK) - colsum(DP * QK)``."""
    i = tl.program_id(0)
    pbh = tl.program_id(1)
    b = pbh // HK
    hk = pbh % HK
    ar = tl.arange(0, BT)
    ot = i * BT + ar
    mt = ot < T
    krow = (b.to(tl.int64) * T + ot) * HK + hk
    ok = tl.arange(0, BK)
    mk = ok < K
    N = tl.cdiv(T, BT)
    st = (pbh.to(tl.int64) * N + i) * K * V
    gam, _, _, M = _chunk_decays(LG, krow, mt, BT)
    k = tl.load(Kp + krow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
    k32 = k.to(tl.float32)
    dk = tl.zeros([BT, BK], dtype=tl.float32)
    dc = tl.zeros([BT], dtype=tl.float32)
    for g in tl.static_range(G):
        qrow = (b.to(tl.int64) * T + ot) * H + hk * G + g
        q = tl.load(Q + qrow[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        X = tl.zeros([BT, BK], dtype=tl.float32)
        DP = tl.zeros([BT, BT], dtype=tl.float32)
        for vb in range(NV_BLK):  # not unrolled: one value block's tiles live at a time (unrolled: ~300 B spilled)
            ov = vb * BV + tl.arange(0, BV)
            mv = ov < V
            do = tl.load(DO + qrow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
            do = do.to(tl.float32)
            S0 = tl.load(HS + st + ok[:, None] * V + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
            S0 = S0.to(tl.float32)
            new = tl.load(U + krow[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
            new = new.to(tl.float32)
            X += dot32(do, tl.trans(S0), PREC)
            DP += dot32(do, tl.trans(new), PREC)
        DP = DP * M * scale
        q32 = q.to(tl.float32)
        dq = X * (gam * scale)[:, None] + dot32(DP, k32, PREC)
        tl.store(DQ + qrow[:, None] * K + ok[None, :], dq.to(DQ.dtype.element_ty), mask=mt[:, None] & mk[None, :])
        dk += dot32(tl.trans(DP), q32, PREC)
        D = DP * mm(q, tl.trans(k), PREC)
        dc += gam * scale * tl.sum(q32 * X, 1) + tl.sum(D, 1) - tl.sum(D, 0)
    tl.store(DKA + krow[:, None] * K + ok[None, :], dk, mask=mt[:, None] & mk[None, :])
    tl.store(DGA + krow, dc, mask=mt)


@triton.jit
def _wy_kernel(
    Kp, Vp, BETA, LG, TM,  # k, v, beta, log decays, the UT transforms [B,HK,N,BT,BT] fp32
    HS, DH, U, DU,  # states before / gradients after each chunk [B,HK,N,K,V] fp32; U, dU [B,T,HK,V] fp32
    DKA, DGA,  # the query side's dk and dL/dc (_dqk_kernel)
    DK, DV, DBETA, DLG,  # dk [B,T,HK,K], dv [B,T,HK,V], dbeta [B,T,HK], d log_decay [B,T,HK] fp32
    T, HK,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    NV_BLK: tl.constexpr, PREC: tl.constexpr,
):
    """Program (chunk, batch x KV head): the backward of ``U = u - w S0``, ``S1 = e^{c_last} S0 + Kd^T U`` and of
    the UT transform (``w = T Kb``, ``u = T Vb``, ``Kb = diag(beta gamma) K``, ``Vb = diag(beta) V``,
    ``A = diag(beta) (K K^T) * M`` strictly lower); adds the query side, and turns ``dL/dc`` into ``d log_decay``
    by a reverse cumulative sum over the chunk. Its value-block loop is not unrolled and carries two ``[BT, BK]``
    accumulators (unrolled, or folding the key terms into one accumulator with two more products, it spilled
    1-3 KB per thread compiled for sm_90a)."""
    i = tl.program_id(0)
    pbh = tl.program_id(1)
    b = pbh // HK
    hk = pbh % HK
    ar = tl.arange(0, BT)
    ot = i * BT + ar
    mt = ot < T
    row = (b.to(tl.int64) * T + ot) * HK + hk
    ok = tl.arange(0, BK)
    mk = ok < K
    m_tk = mt[:, None] & mk[None, :]
    N = tl.cdiv(T, BT)
    st = (pbh.to(tl.int64) * N + i) * K * V
    gam, wk, keep, M = _chunk_decays(LG, row, mt, BT)
    strict = ar[:, None] > ar[None, :]
    k = tl.load(Kp + row[:, None] * K + ok[None, :], mask=m_tk, other=0.0)
    k32 = k.to(tl.float32)
    beta = tl.load(BETA + row, mask=mt, other=0.0).to(tl.float32)
    Tt = tl.load(TM + ((pbh.to(tl.int64) * N + i) * BT + ar[None, :]) * BT + ar[:, None])  # T^T, read transposed
    bg = beta * gam
    # With Y = Vb - Kb S0 = (I + A) U (U = T Y), the gradient of T is dT = dU Y^T, so dA = -T^T dT T^T = -dVb U^T and
    # d(Kb) = T^T dw = -dVb S0^T, with dVb = T^T dU the gradient of Vb = diag(beta) V: neither dT nor dw is formed
    dKd = tl.zeros([BT, BK], dtype=tl.float32)  # U dS1^T (S1 = e^{c_last} S0 + Kd^T U)
    dKb = tl.zeros([BT, BK], dtype=tl.float32)  # d(Kb), Kb = diag(beta gamma) K
    dA = tl.zeros([BT, BT], dtype=tl.float32)
    db = tl.zeros([BT], dtype=tl.float32)
    dSS = tl.zeros([BK], dtype=tl.float32)  # rows of <S0, dS1>
    for vb in range(NV_BLK):  # a loop, not unrolled: one value block's tiles live at a time
        ov = vb * BV + tl.arange(0, BV)
        mv = ov < V
        m_tv = mt[:, None] & mv[None, :]
        m_kv = mk[:, None] & mv[None, :]
        S0 = tl.load(HS + st + ok[:, None] * V + ov[None, :], mask=m_kv, other=0.0).to(tl.float32)
        dS1 = tl.load(DH + st + ok[:, None] * V + ov[None, :], mask=m_kv, other=0.0).to(tl.float32)
        new = tl.load(U + row[:, None] * V + ov[None, :], mask=m_tv, other=0.0).to(tl.float32)
        du = tl.load(DU + row[:, None] * V + ov[None, :], mask=m_tv, other=0.0).to(tl.float32)
        v = tl.load(Vp + row[:, None] * V + ov[None, :], mask=m_tv, other=0.0).to(tl.float32)
        dVb = dot32(Tt, du, PREC)
        tl.store(DV + row[:, None] * V + ov[None, :], (dVb * beta[:, None]).to(DV.dtype.element_ty), mask=m_tv)
        db += tl.sum(dVb * v, 1)
        dA -= dot32(dVb, tl.trans(new), PREC)
        dKd += dot32(new, tl.trans(dS1), PREC)
        dKb -= dot32(dVb, tl.trans(S0), PREC)
        dSS += tl.sum(S0 * dS1, 1)
    e = wk * tl.sum(k32 * dKd, 1)  # the keys' decay to the chunk's end, e^{c_last - c_t}
    kdKb = tl.sum(k32 * dKb, 1)
    dk = dKd * wk[:, None] + dKb * bg[:, None]
    dA = tl.where(strict, dA, 0.0)
    KK = mm(k, tl.trans(k), PREC)
    dKK = dA * M * beta[:, None]  # A = beta_t (k_t.k_j) M_tj below the diagonal
    dk += dot32(dKK + tl.trans(dKK), k32, PREC)  # both keys of each pair: dKK K + dKK^T K
    db += gam * kdKb + tl.sum(dA * M * KK, 1)
    DA = dKK * KK  # dA * A
    dc = bg * kdKb + tl.sum(DA, 1) - tl.sum(DA, 0) - e
    dc += tl.where(ar == BT - 1, tl.sum(e, 0) + keep * tl.sum(dSS, 0), 0.0)  # c_last: the last row, padding or not
    dk += tl.load(DKA + row[:, None] * K + ok[None, :], mask=m_tk, other=0.0)
    dc += tl.load(DGA + row, mask=mt, other=0.0)
    tl.store(DK + row[:, None] * K + ok[None, :], dk.to(DK.dtype.element_ty), mask=m_tk)
    tl.store(DBETA + row, db.to(DBETA.dtype.element_ty), mask=mt)
    # d log_decay_s = sum_{t >= s in the chunk} dL/dc_t
    tl.store(DLG + row, tl.sum(dc, 0) - tl.cumsum(dc, 0) + dc, mask=mt)


# ---------------------------------------------------------------------------
# launches


def _walk_launch(programs: int, K: int, V: int, device: torch.device) -> tuple[int, int]:
    """``(BV, num_warps)`` of a walk over ``programs`` (batch x KV head) sequences: ``walk_bv`` halved (to 32 at
    least) while the grid has fewer than ``walk_waves`` programs per SM (off CUDA: ``walk_bv``); the warps by the
    size of the ``[K, BV]`` state tile."""
    BV = _blocks("walk_bv", V)
    if device.type == "cuda":
        while BV > 32 and programs * triton.cdiv(V, BV) < CONFIG["walk_waves"] * num_sms(device):
            BV //= 2
    return BV, CONFIG["walk_warps"] if pow2(K) * BV >= 128 * 64 else CONFIG["walk_warps_narrow"]


def _sixteen(setting: str, x: torch.Tensor) -> bool:
    """``CONFIG[setting]`` on and ``x`` in a 16-bit dtype (the settings that put products on 16-bit operands)."""
    return bool(CONFIG[setting]) and x.dtype in (torch.bfloat16, torch.float16)


def _blocks(key: str, V: int) -> int:
    """A value block from ``CONFIG[key]``, no wider than ``V`` padded to a power of two (at least 32)."""
    return pow2(min(int(CONFIG[key]), pow2(V)))


def _inverse_settings(BT: int, dtype: torch.dtype) -> dict:
    """The UT inverse's constexprs from ``CONFIG`` for keys of ``dtype``: the doubling inverse for 16-bit keys only
    (fp32 sums, but on the worst inputs, identical keys with beta near 1, its series grows before it cancels: 2.4e-4
    off float64 where the row steps stay at 3e-8, far below a 16-bit forward's error, not below fp32's 1e-4)."""
    doubling = CONFIG["prep_diag_doubling"] and BT >= 16 and dtype != torch.float32
    diag = 2 if doubling else int(bool(CONFIG["prep_diag_rows"]))
    return dict(DIAG=diag, BLOCKS=BT == 64 and bool(CONFIG["prep_blocks"]))


def _transforms(k, beta, lg, *, dtype=torch.float32):
    """The UT transforms ``[B, HK, N, BT, BT]`` in ``dtype`` alone (``_ut_kernel``: the split prep's first launch)."""
    B, T, HK, K = k.shape
    BT = CONFIG["bt"]
    N = triton.cdiv(T, BT)
    Tm = new_empty((B, HK, N, BT, BT), dtype=dtype, device=k.device)
    launch(_ut_kernel, (N, B * HK), k, beta, lg, Tm, T, HK, K=K, BK=pow2(K), BT=BT, PREC=prec(k.dtype),
           **_inverse_settings(BT, k.dtype), num_warps=CONFIG["ut_warps"])
    return Tm


def _prep(k, v, beta, lg, *, store_t, dtype=torch.float32, low16=False):
    """``w``, ``u`` (in ``dtype``: fp32, or the inputs' 16-bit dtype for the forward under ``fwd_inter_16bit``) and,
    with ``store_t``, the UT transforms ``[B, HK, N, BT, BT]`` (fp32); ``low16`` (16-bit keys: :func:`_sixteen`):
    their products on 16-bit operands. One launch, or two under ``CONFIG["prep_split"]`` (the transforms, then the
    products; a forward's transforms pass between them in the 16-bit dtype under ``low16``)."""
    B, T, HK, K = k.shape
    V = v.shape[-1]
    BT = CONFIG["bt"]
    N = triton.cdiv(T, BT)
    dev = k.device
    w = new_empty((B, T, HK, K), dtype=dtype, device=dev)
    u = new_empty((B, T, HK, V), dtype=dtype, device=dev)
    BV = min(pow2(V), 64)
    if CONFIG["prep_split"]:
        Tm = _transforms(k, beta, lg, dtype=k.dtype if low16 and not store_t else torch.float32)
        launch(_wu_kernel, (N, B * HK, 1 + triton.cdiv(V, BV)), k, v, beta, lg, Tm, w, u, T, HK, K=K, V=V,
               BK=pow2(K), BV=BV, BT=BT, PREC=prec(k.dtype), LOW16=low16, num_warps=CONFIG["wu_warps"])
        return w, u, Tm if store_t else None
    Tm = new_empty((B, HK, N, BT, BT), dtype=torch.float32, device=dev) if store_t else None
    launch(_prep_kernel, (N, B * HK), k, v, beta, lg, w, u, Tm if store_t else w, T, HK,
           K=K, V=V, BK=pow2(K), BV=BV, BT=BT, NV_BLK=triton.cdiv(V, BV), STORE_T=store_t, PREC=prec(k.dtype),
           LOW16=low16, **_inverse_settings(BT, k.dtype), num_warps=CONFIG["prep_warps"])
    return w, u, Tm


def _walk(k, w, u, lg, S0, *, state_dtype, want_final, low16=False):
    """The chunk states ``[B, HK, N, K, V]`` in ``state_dtype`` (``u`` becomes ``U``) and the final state;
    ``low16`` (16-bit keys: :func:`_sixteen`): the products on 16-bit operands."""
    B, T, HK, K = k.shape
    V = u.shape[-1]
    BT = CONFIG["bt"]
    N = triton.cdiv(T, BT)
    dev = k.device
    hs = new_empty((B, HK, N, K, V), dtype=state_dtype, device=dev)
    fin = new_empty((B, HK, K, V), dtype=torch.float32, device=dev) if want_final else None
    BV, warps = _walk_launch(B * HK, K, V, dev)
    launch(_walk_kernel, (triton.cdiv(V, BV), B * HK), k, w, u, lg, S0 if S0 is not None else hs, hs,
           fin if want_final else hs, T, HK, K=K, V=V, BK=pow2(K), BV=BV, BT=BT, HAS_INIT=S0 is not None,
           STORE_FINAL=want_final, PREC=prec(k.dtype), LOW16=low16,
           num_warps=warps, num_stages=CONFIG["walk_stages"])
    return hs, fin


def _fwd_prep(k, v, beta, lg):
    """The forward's UT-transform launch: ``w``, ``u`` in the dtype ``CONFIG`` asks for."""
    w, u, _ = _prep(k, v, beta, lg, store_t=False, dtype=k.dtype if _sixteen("fwd_inter_16bit", k) else torch.float32,
                    low16=_sixteen("prep_16bit", k))
    return w, u


def _fwd_walk(k, w, u, lg, S0, want_final):
    """The forward's state walk (``u`` becomes ``U``): ``(chunk states, final state, states in fp32)``."""
    s32 = bool(CONFIG["fwd_states_fp32"]) or k.dtype == torch.float32
    hs, fin = _walk(k, w, u, lg, S0, state_dtype=torch.float32 if s32 else k.dtype, want_final=want_final,
                    low16=_sixteen("walk_16bit", k))
    return hs, fin, s32


def _fwd(q, k, v, beta, lg, S0, scale, want_final):
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT = CONFIG["bt"]
    w, u = _fwd_prep(k, v, beta, lg)
    hs, fin, s32 = _fwd_walk(k, w, u, lg, S0, want_final)
    o = new_empty((B, T, H, V), dtype=v.dtype, device=q.device)
    BV = _blocks("out_bv", V)
    launch(_out_kernel, (triton.cdiv(V, BV), triton.cdiv(T, BT), B * H), q, k, u, hs, lg, o, T, H, k.shape[2],
           float(scale), K=K, V=V, BK=pow2(K), BV=BV, BT=BT, PREC=prec(q.dtype), S32=s32,
           LOW16=_sixteen("out_16bit", k), num_warps=CONFIG["out_warps"])
    return o, fin


def _bwd(q, k, v, beta, lg, S0, scale, do, dS_f, need_dS0):
    """``(dq, dk, dv, dbeta, d log_decay, dS0)``: the forward's prep and walk recomputed with fp32 states, then the
    reverse walk and the chunk-parallel kernels."""
    B, T, H, K = q.shape
    HK, V = k.shape[2], v.shape[-1]
    G = H // HK
    BT = CONFIG["bt"]
    N = triton.cdiv(T, BT)
    dev = q.device
    f32 = torch.float32
    pr = prec(q.dtype)
    BK = pow2(K)
    # the chunk states and their gradients, and w, U and dU, as stored between launches (each walk keeps its state
    # or gradient, and the U or dU it moves by, in fp32)
    sdt = k.dtype if _sixteen("bwd_states_16bit", k) else f32
    idt = k.dtype if _sixteen("bwd_inter_16bit", k) else f32
    w, u, Tm = _prep(k, v, beta, lg, store_t=True, dtype=idt)
    hs, _ = _walk(k, w, u, lg, S0, state_dtype=sdt, want_final=False)  # u is now U
    do = do.contiguous()
    du = new_empty((B, T, HK, V), dtype=idt, device=dev)
    BVo = _blocks("out_bv", V)
    launch(_dvl_kernel, (triton.cdiv(V, BVo), N, B * HK), q, k, do, lg, du, T, H, HK, float(scale),
           K=K, V=V, BK=BK, BV=BVo, BT=BT, G=G, PREC=pr, num_warps=CONFIG["out_warps"])
    dh = new_empty((B, HK, N, K, V), dtype=sdt, device=dev)
    dS0 = new_empty((B, HK, K, V), dtype=f32, device=dev) if need_dS0 else None
    BVw, warps = _walk_launch(B * HK, K, V, dev)
    launch(_bwd_walk_kernel, (triton.cdiv(V, BVw), B * HK), q, k, w, do, lg, du,
           dS_f.float().contiguous() if dS_f is not None else dh, dh, dS0 if need_dS0 else dh, T, H, HK, float(scale),
           K=K, V=V, BK=BK, BV=BVw, BT=BT, G=G, HAS_DSF=dS_f is not None, STORE_DS0=need_dS0, PREC=pr,
           num_warps=warps, num_stages=CONFIG["walk_stages"])
    dq = new_empty(q.shape, dtype=q.dtype, device=dev)
    dka = new_empty((B, T, HK, K), dtype=f32, device=dev)
    dca = new_empty((B, T, HK), dtype=f32, device=dev)
    BVb = _blocks("bwd_bv", V)
    NVB = triton.cdiv(V, BVb)
    launch(_dqk_kernel, (N, B * HK), q, k, do, hs, u, lg, dq, dka, dca, T, H, HK, float(scale),
           K=K, V=V, BK=BK, BV=BVb, BT=BT, G=G, NV_BLK=NVB, PREC=pr, num_warps=CONFIG["bwd_warps"])
    dk = new_empty(k.shape, dtype=k.dtype, device=dev)
    dv = new_empty(v.shape, dtype=v.dtype, device=dev)
    dbeta = new_empty(beta.shape, dtype=beta.dtype, device=dev)
    dlg = new_empty(lg.shape, dtype=f32, device=dev)
    launch(_wy_kernel, (N, B * HK), k, v, beta, lg, Tm, hs, dh, u, du, dka, dca, dk, dv, dbeta, dlg, T, HK,
           K=K, V=V, BK=BK, BV=BVb, BT=BT, NV_BLK=NVB, PREC=pr, num_warps=CONFIG["bwd_warps"])
    return dq, dk, dv, dbeta, dlg, dS0


class _GatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, lg, S0, scale, output_final_state):
        o, fin = _fwd(q, k, v, beta, lg, S0, scale, output_final_state)
        ctx.save_for_backward(q, k, v, beta, lg, S0)
        ctx.scale = scale
        ctx.set_materialize_grads(False)
        return o, fin

    @staticmethod
    def backward(ctx, do, dS_f):
        q, k, v, beta, lg, S0 = ctx.saved_tensors
        if do is None:
            do = torch.zeros(q.shape[:3] + v.shape[3:], dtype=v.dtype, device=q.device)
        dq, dk, dv, dbeta, dlg, dS0 = _bwd(q, k, v, beta, lg, S0, ctx.scale, do, dS_f, ctx.needs_input_grad[5])
        return dq, dk, dv, dbeta, dlg, dS0, None, None


def gated_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_decay: Optional[torch.Tensor],
    *,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Triton path of :func:`linearize.kernels.delta.gated_delta_rule` (autograd: ``_GatedDeltaRule``)."""
    ensure_applied(q.device)  # this GPU's saved launch configuration, once
    B, T, H, K = q.shape
    HK, V = k.shape[2], v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    S0 = initial_state.float().contiguous() if initial_state is not None else None
    if T == 0:  # nothing to launch: the state passes through
        o = q.new_zeros(B, 0, H, V, dtype=v.dtype)
        if not output_final_state:
            return o, None
        return o, (S0 * 1 if S0 is not None else q.new_zeros(B, HK, K, V, dtype=torch.float32))
    lg = (log_decay.float() if log_decay is not None else q.new_zeros(B, T, HK, dtype=torch.float32)).contiguous()
    o, fin = _GatedDeltaRule.apply(q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous(), lg, S0, scale,
                                   output_final_state)
    return o, fin


register("delta", CONFIG)  # tunable per GPU (tuning.py)

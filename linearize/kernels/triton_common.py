"""Shared Triton pieces: the chunk-state scan kernel and launch helpers.

``_scan_kernel`` accumulates ``S = init + sum_t (a_t x_t)^T y_t`` (and optionally
``z = zinit + sum_t u_t x_t``) over chunks of ``BT`` tokens, forward or reverse in
time, for one ``[BK, BV]`` block of the state per program. It can

* store the *exclusive* state before every ``STRIDE``-th chunk (per-chunk states
  for the backward passes), and/or
* run over a sub-range of chunks (a "segment") and store its final sum
  (per-segment partial states for the sequence-parallel forward).

Several source heads (``G``) may feed one state head: that is how the GQA
reductions of the backward pass (sum over the query heads of a KV group) happen
inside the kernel instead of through a materialised repeat.

With ``DECAY`` the scan decays the state at every token (gated linear attention), and
``_decay_prefix_scan_kernel`` chains its per-segment sums into each segment's starting state.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: NaN-fill every output before a launch (tests turn it on with set_poison to catch elements a kernel skips)
POISON_OUTPUTS = False


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# The CPU interpreter multiplies 16-bit operands incorrectly (triton 3.9); upcast there.
_INTERP = tl.constexpr(interpreting())


@triton.jit
def mm(a, b, PREC: tl.constexpr):
    """tl.dot with fp32 accumulation (operands upcast under the interpreter)."""
    if _INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def mm_acc(a, b, acc, PREC: tl.constexpr):
    """``acc + a b`` as one tl.dot accumulating into ``acc`` (fp32): no second accumulator in registers."""
    if _INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def to16(x, DT: tl.constexpr):
    """fp32 ``x`` as a 16-bit operand of dtype ``DT``, rounded to nearest even as the GPU's cast does; the
    interpreter truncates bf16 casts, so there the rounding is done on the bits first (the cast is then exact)."""
    if _INTERP and DT == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(DT)
    else:
        return x.to(DT)


def new_empty(shape, *, dtype, device):
    """torch.empty, or NaN-filled when poisoning is on (tests)."""
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def set_poison(flag: bool) -> None:
    """Turn output poisoning on or off (tests)."""
    global POISON_OUTPUTS
    POISON_OUTPUTS = bool(flag)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def prec(dtype: torch.dtype) -> str:
    """Dot precision: exact fp32 for fp32 inputs, native for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


#: smallest tile side; masked loads pad smaller dimensions with zeros. 32 is what ran on an H200 (2026-12-01:
#: the window check at D = K = V = 16 passed with 32-wide tiles; 16-wide ones were never run on a GPU)
MIN_TILE = 32


def pow2(n: int, lo: int = MIN_TILE) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


def _out_of_resources(e: Exception) -> bool:
    return "OutOfResources" in type(e).__name__ or "out of resource" in str(e)


#: (entry point, shapes, dtype) of launches that ran out of shared memory even unpipelined: they take the fallback
TOO_BIG: set = set()


def _drop_traceback(e: BaseException) -> None:
    """Free the frames a caught launch error holds. Triton raises its ``OutOfResources`` from a helper whose frame
    keeps the exception in a local: a reference cycle through the traceback that holds every frame on the stack,
    with their tensors, until Python's garbage collector runs (on an H200 a Gemma 3 hybrid's prefill kept ~0.5 GiB
    per linear layer that way, 2026-12-02). Cutting the exception's link to its traceback frees them at once."""
    e.__traceback__ = None


#: the largest signed Hedgehog projection ``[D, 2f]`` a kernel is asked to hold in shared memory. 128 KB ran on an
#: H200 (bf16 at head_dim 256 with the default 2f = 256, Gemma's shape); fp32 at that shape (256 KB) asked for
#: 320 KB of 227, and Triton spent over four minutes compiling the feature-map kernel before saying so (2026-12-02)
PROJECTION_SMEM_BYTES = 128 * 1024


def projection_fits(D: int, features: int, dtype: torch.dtype) -> bool:
    """Whether a Hedgehog kernel's signed projection (``[D, features]`` in ``dtype``, padded to powers of two) is
    worth compiling: larger ones take the features-first fallback without a compile."""
    return pow2(D) * pow2(features) * dtype.itemsize <= PROJECTION_SMEM_BYTES


def triton_or_fallback(key: tuple, run, fallback, *, fits: bool = True):
    """``run()``, or ``fallback()`` where this ``key``'s kernel does not fit the GPU's shared memory (e.g. a Hedgehog
    projection ``[D, 2f]`` of fp32 at head_dim 256, 256 KB, next to its input tile). A launch that fails this way
    ran nothing, so in-place state updates are untouched; the key is remembered so that later calls go straight
    to the fallback. ``fits=False`` (:func:`projection_fits`) goes there without trying."""
    if not fits or key in TOO_BIG:
        return fallback()
    try:
        return run()
    except Exception as e:
        if not _out_of_resources(e):
            raise
        _drop_traceback(e)
        TOO_BIG.add(key)
    return fallback()


#: launches whose pipelined configuration ran out of shared memory (see :func:`launch`): per kernel, its keyword
#: arguments (constexprs, warps, stages) and the dtypes of the positional arguments
UNPIPELINED: dict = {}


def _launch_config(args: tuple, kw: dict) -> tuple:
    def kind(a):
        return a.dtype if torch.is_tensor(a) else type(a)

    return tuple(sorted((k, kind(v) if torch.is_tensor(v) else v) for k, v in kw.items())), tuple(map(kind, args))


def launch(kernel, grid, *args, **kw):
    """``kernel[grid](*args, **kw)``; on "out of resources" (shared memory) retry unpipelined, and launch that
    configuration unpipelined from then on (each failed launch costs Triton a fresh launcher and an exception).
    Only a kernel that has failed so once pays for building its configuration's key."""
    known = UNPIPELINED.get(kernel)
    if known and kw.get("num_stages") != 1 and _launch_config(args, kw) in known:
        kw = {**kw, "num_stages": 1}
    try:
        return kernel[grid](*args, **kw)
    except Exception as e:
        if not _out_of_resources(e) or kw.get("num_stages") == 1:
            raise
        _drop_traceback(e)
        UNPIPELINED.setdefault(kernel, set()).add(_launch_config(args, kw))
    return kernel[grid](*args, **{**kw, "num_stages": 1})


def plan_segments(cfg: dict, N: int, progs: int, device: torch.device) -> tuple[int, int]:
    """Split each sequence of ``N`` chunks into segments so ``progs`` programs fill the GPU.

    Returns ``(segments, chunks_per_segment)``; one segment off CUDA, when there are enough programs, or for
    empty inputs.
    """
    if N == 0 or progs == 0:
        return 1, 1
    nseg = 1
    if cfg.get("force_segments"):
        nseg = min(N, int(cfg["force_segments"]))
    elif device.type == "cuda":
        sms = num_sms(device)
        # split only when the grid leaves most SMs idle; then into as many segments as keep the grid within
        # fwd_waves programs per SM (rounded down: a last, part-filled wave costs as long as a full one)
        if progs < cfg["split_below_waves"] * sms and N >= 4:
            nseg = min(N // 2, max(1, int(cfg["fwd_waves"] * sms) // progs))
    seg_chunks = triton.cdiv(N, nseg)
    return triton.cdiv(N, seg_chunks), seg_chunks


def fwd_blocks(cfg: dict, BK: int, V: int, dtype: torch.dtype, fused: bool = False):
    """(BV, num_stages, num_warps) of a forward kernel: fp32 tiles are twice as large, wide K needs a narrower BV.
    ``fused`` (Hedgehog features computed in the kernel, more live tiles): ``fused_bv`` / ``fused_warps`` /
    ``fused_stages`` where the configuration has them."""
    BV = max(MIN_TILE, min(cfg["fused_bv" if fused else "fwd_bv"], pow2(V), 16384 // BK))
    stages = cfg.get("fused_stages", cfg["fwd_stages"]) if fused else cfg["fwd_stages"]
    if dtype == torch.float32:
        BV, stages = min(BV, 64), min(stages, 2)
    return BV, stages, cfg["fused_warps" if fused else "fwd_warps"]


_NEG_INF = tl.constexpr(float("-inf"))


def signed_projection(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[W, -W]`` (``[H, D, 2f]``) in ``dtype``: the weight :func:`hedgehog_tile` reads, one product giving both
    halves of the Hedgehog features."""
    return torch.cat([weight, -weight], -1).to(dtype).contiguous()


def signed_projections(weight_q: torch.Tensor, weight_k: torch.Tensor, dtype: torch.dtype):
    """:func:`signed_projection` of the query and key maps: ``([Wq, -Wq], [Wk, -Wk])``."""
    return signed_projection(weight_q, dtype), signed_projection(weight_k, dtype)


@triton.jit
def _hedgehog_halves(u, ok, mk, F: tl.constexpr, feps):
    """``[softmax(u[:, :F]), softmax(u[:, F:K])]`` per row of ``u [R, BK]``, clamped to ``>= feps``, zero past K."""
    pos = ok < F
    neg = (ok >= F) & mk
    m_pos = tl.max(tl.where(pos[None, :], u, _NEG_INF), 1)
    m_neg = tl.max(tl.where(neg[None, :], u, _NEG_INF), 1)
    e = tl.where(mk[None, :], tl.exp(u - tl.where(pos[None, :], m_pos[:, None], m_neg[:, None])), 0.0)
    s_pos = tl.sum(tl.where(pos[None, :], e, 0.0), 1)
    s_neg = tl.sum(tl.where(neg[None, :], e, 0.0), 1)
    f = e / tl.where(pos[None, :], s_pos[:, None], s_neg[:, None])
    return tl.where(mk[None, :], tl.maximum(f, feps), 0.0)


@triton.jit
def hedgehog_tile(x, W, wrow, od, ok, md, mk, D: tl.constexpr, K: tl.constexpr, F: tl.constexpr, feps,
                  PREC: tl.constexpr):
    """Hedgehog features of a ``[BT, BD]`` tile: ``[softmax(x Wh), softmax(-x Wh)]``, clamped to ``>= feps``.

    ``W`` holds ``[Wh, -Wh]`` per head (``[D, K]``, ``K = 2F``; ``wrow`` = head index); returns ``[BT, BK]``
    fp32 with zero padding columns (``>= K``). Rows of ``x`` that are zero padding get features too: the
    caller masks them where they would count.
    """
    w = tl.load(W + wrow * D * K + od[:, None] * K + ok[None, :], mask=md[:, None] & mk[None, :], other=0.0)
    return _hedgehog_halves(mm(x, w, PREC), ok, mk, F, feps)  # u = [x Wh, -x Wh, 0...]


@triton.jit
def hedgehog_row(x, W, wrow, od, ok, md, mk, D: tl.constexpr, K: tl.constexpr, F: tl.constexpr, feps):
    """:func:`hedgehog_tile` for one row ``x [BD]`` (fp32), the projection as lane reductions (a decode step has
    no tile for a tensor-core product): ``[BK]`` fp32 features, zero past ``K``."""
    w = tl.load(W + wrow * D * K + od[:, None] * K + ok[None, :], mask=md[:, None] & mk[None, :], other=0.0)
    u = tl.sum(x[:, None] * w.to(tl.float32), 0)  # [BK]
    return tl.sum(_hedgehog_halves(u[None, :], ok, mk, F, feps), 0)  # the one row


@triton.jit
def decay_cumsum(lg, BT: tl.constexpr):
    """Chunk-local inclusive cumulative sums ``c`` of the log decays ``lg [BT]`` (0 past the sequence) as
    ``hi + lo`` (fp32 pairs), and the chunk's total ``c_last`` as ``last_hi + last_lo``. ``hi`` alone is off by up
    to an ulp of sums of a few hundred (~3e-5 at log decays of -5), which the differences ``c_i - c_j`` of nearby
    tokens would keep: ``lo`` accumulates what each step of ``hi`` rounded away. Returns ``(hi, lo, last_hi,
    last_lo)``; the last token's ``c_last - c`` is exactly 0."""
    ar = tl.arange(0, BT)
    hi = tl.cumsum(lg, 0)
    prev = tl.sum(tl.where(ar[None, :] == ar[:, None] - 1, hi[None, :], 0.0), 1)  # hi one token earlier (0 first)
    lo = tl.cumsum(lg - (hi - prev), 0)
    last = ar == BT - 1
    return hi, lo, tl.sum(tl.where(last, hi, 0.0), 0), tl.sum(tl.where(last, lo, 0.0), 0)


@triton.jit
def decay_pairs(hi, lo, BT: tl.constexpr):
    """``M [BT, BT]``: ``e^{c_t - c_j}`` for ``j <= t``, 0 above the diagonal (never an ``exp`` of a positive)."""
    ar = tl.arange(0, BT)
    d = (hi[:, None] - hi[None, :]) + (lo[:, None] - lo[None, :])
    return tl.exp(tl.where(ar[:, None] >= ar[None, :], d, float("-inf")))


@triton.jit
def _scan_kernel(
    X, Y, A, U,  # X [B,T,HXY,K], Y [B,T,HXY,V], A/U [B,T,HXY] row scalars
    LG,  # DECAY: log decays [B,T,HS] fp32
    INIT_S, INIT_Z,  # [B,HS,K,V], [B,HS,K]
    OUT_S, OUT_Z,  # per-chunk exclusive states [B,HS,NSTATE,K,V], [B,HS,NSTATE,K]
    FIN_S, FIN_Z,  # final / per-segment sums [B,HS,NSEG,K,V], [B,HS,NSEG,K]
    T, HS, NSTATE, NSEG, SEG_CHUNKS, SEG_OFF,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    G: tl.constexpr, STRIDE: tl.constexpr, REVERSE: tl.constexpr,
    HAS_A: tl.constexpr, HAS_U: tl.constexpr, DO_Z: tl.constexpr, HAS_INIT: tl.constexpr,
    STORE_STATES: tl.constexpr, STORE_FINAL: tl.constexpr, INIT_PER_SEG: tl.constexpr, PREC: tl.constexpr,
    DECAY: tl.constexpr, Z_ROWS: tl.constexpr, Z_OF_R: tl.constexpr, SPLIT_ROWS: tl.constexpr,
):
    """``DECAY`` (gated): the state decays at every token. Chunk ``i`` with chunk-local inclusive cumulative log
    decays ``c`` and total ``c_last``: forward ``S <- e^{c_last} S + sum_t r_t^T y_t`` with ``r_t = e^{c_last -
    c_t} a_t x_t`` (the state of the tokens before each chunk at the position just before it); reverse ``r_t =
    e^{c_t} a_t x_t`` (the state of the tokens after each chunk, decayed to its last position). Every factor is
    ``<= 1``; ``r_t`` is rounded to the input dtype for the product (``SPLIT_ROWS``: plus a second product with
    the rounding residual, fp32-exact rows). ``z`` likewise (``Z_ROWS``; without it ``z`` is only the decayed
    ``init``): ``sum_t u_t e^{..} x_t`` in fp32, or with ``Z_OF_R`` ``sum_t u_t r_t`` of the same rows as ``S``
    (a backward's ``S dn + dd z`` cancels, so ``S`` and ``z`` must agree)."""
    pk = tl.program_id(0)
    pv = tl.program_id(1)
    pz = tl.program_id(2)
    seg = pz % NSEG
    bh = pz // NSEG
    b = bh // HS
    hs = bh % HS
    HXY = HS * G
    ok = pk * BK + tl.arange(0, BK)
    ov = pv * BV + tl.arange(0, BV)
    mk = ok < K
    mv = ov < V
    acc = tl.zeros([BK, BV], dtype=tl.float32)
    accz = tl.zeros([BK], dtype=tl.float32)
    if HAS_INIT:
        if INIT_PER_SEG:  # each segment starts from its own state [B,HS,NSEG,...]
            ib = bh.to(tl.int64) * NSEG + seg
        else:
            ib = bh.to(tl.int64)
        acc += tl.load(INIT_S + ib * K * V + ok[:, None] * V + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
        if DO_Z:
            accz += tl.load(INIT_Z + ib * K + ok, mask=mk, other=0.0)
    N = tl.cdiv(T, BT)
    c0 = tl.maximum(seg * SEG_CHUNKS - SEG_OFF, 0)
    c1 = tl.minimum((seg + 1) * SEG_CHUNKS - SEG_OFF, N)
    for it in range(c0, c1):
        if REVERSE:
            i = c1 - 1 - (it - c0)
        else:
            i = it
        if STORE_STATES:
            if i % STRIDE == 0:
                op = OUT_S + (bh.to(tl.int64) * NSTATE + i // STRIDE) * K * V
                tl.store(op + ok[:, None] * V + ov[None, :], acc, mask=mk[:, None] & mv[None, :])
                if DO_Z:
                    if pv == 0:
                        tl.store(OUT_Z + (bh.to(tl.int64) * NSTATE + i // STRIDE) * K + ok, accz, mask=mk)
        ot = i * BT + tl.arange(0, BT)
        mt = ot < T
        if DECAY:
            hi, lo, last_hi, last_lo = decay_cumsum(tl.load(LG + (b.to(tl.int64) * T + ot) * HS + hs, mask=mt,
                                                            other=0.0), BT)
            if REVERSE:
                w = tl.exp(hi + lo)
            else:
                w = tl.exp((last_hi - hi) + (last_lo - lo))
            keep = tl.exp(last_hi + last_lo)
            acc = acc * keep
            if DO_Z:
                accz = accz * keep
        for g in tl.static_range(G):
            hx = hs * G + g
            row = (b.to(tl.int64) * T + ot) * HXY + hx  # [BT]
            x = tl.load(X + row[:, None] * K + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
            y = tl.load(Y + row[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
            if DECAY:
                if HAS_A:
                    wa = w * tl.load(A + row, mask=mt, other=0.0)
                else:
                    wa = w
                r32 = x.to(tl.float32) * wa[:, None]
                r = r32.to(x.dtype)
                acc += mm(tl.trans(r), y, PREC)
                if SPLIT_ROWS:
                    acc += mm(tl.trans((r32 - r.to(tl.float32)).to(x.dtype)), y, PREC)
                if DO_Z:
                    if Z_ROWS:
                        if SPLIT_ROWS:
                            zr = r32
                        elif Z_OF_R:
                            zr = r.to(tl.float32)
                        else:
                            zr = x.to(tl.float32) * w[:, None]
                        if HAS_U:
                            zr = zr * tl.load(U + row, mask=mt, other=0.0)[:, None]
                        accz += tl.sum(zr, 0)
            else:
                if HAS_A:
                    a = tl.load(A + row, mask=mt, other=0.0)
                    xa = (x.to(tl.float32) * a[:, None]).to(x.dtype)
                else:
                    xa = x
                acc += mm(tl.trans(xa), y, PREC)
                if DO_Z:
                    if HAS_U:
                        u = tl.load(U + row, mask=mt, other=0.0)
                        accz += tl.sum(x.to(tl.float32) * u[:, None], 0)
                    else:
                        accz += tl.sum(x.to(tl.float32), 0)
    if STORE_FINAL:
        fp = FIN_S + (bh.to(tl.int64) * NSEG + seg) * K * V
        tl.store(fp + ok[:, None] * V + ov[None, :], acc, mask=mk[:, None] & mv[None, :])
        if DO_Z:
            if pv == 0:
                tl.store(FIN_Z + (bh.to(tl.int64) * NSEG + seg) * K + ok, accz, mask=mk)


@triton.jit
def _row_stats_kernel(DO, O, DEN, INVD, DD, R, V: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr):
    # rows of do, o [R, V] (any dtype) and den [R] fp32 -> invd = 1/den, dd = -(do.o)/den  [R] fp32
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    mr = rows < R
    ov = tl.arange(0, BV)
    m = mr[:, None] & (ov[None, :] < V)
    do = tl.load(DO + rows[:, None] * V + ov[None, :], mask=m, other=0.0).to(tl.float32)
    o = tl.load(O + rows[:, None] * V + ov[None, :], mask=m, other=0.0).to(tl.float32)
    den = tl.load(DEN + rows, mask=mr, other=1.0)
    invd = 1.0 / den
    tl.store(INVD + rows, invd, mask=mr)
    tl.store(DD + rows, -tl.sum(do * o, 1) * invd, mask=mr)


def row_stats(do: torch.Tensor, o: torch.Tensor, den: torch.Tensor):
    """``(1/den, -(do.o)/den)`` per row, fp32 ``[B,T,H]``, in one pass over ``do`` and ``o`` ``[B,T,H,V]``.

    (The PyTorch expression would materialise fp32 copies of both, ~6x the bytes.)
    """
    V = o.shape[-1]
    R = o.numel() // V
    invd = torch.empty(den.shape, dtype=torch.float32, device=o.device)
    dd = torch.empty(den.shape, dtype=torch.float32, device=o.device)
    BV = pow2(V)
    BR = max(1, min(64, 8192 // BV))
    _row_stats_kernel[(triton.cdiv(R, BR),)](do, o, den, invd, dd, R, V=V, BV=BV, BR=BR, num_warps=4)
    return invd, dd


def scan_states(
    x: torch.Tensor,  # [B, T, HXY, K]
    y: torch.Tensor,  # [B, T, HXY, V]
    *,
    heads: int,  # state heads HS (HXY = HS * G)
    a: torch.Tensor = None,  # [B, T, HXY] fp32 row scale of the outer product
    u: torch.Tensor = None,  # [B, T, HXY] fp32 row weights of the z sum
    do_z: bool = True,
    init=None,  # (S [B,HS,K,V] fp32, z [B,HS,K] fp32 or None); [B,HS,NSEG,...] with init_per_segment
    reverse: bool = False,
    per_chunk: bool = True,  # store exclusive per-chunk states
    store_final: bool = False,
    segments: int = 1,
    seg_chunks: int = 0,
    seg_off: int = 0,
    init_per_segment: bool = False,
    BT: int = 64,
    BK: int = 64,
    BV: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    log_decay: torch.Tensor = None,  # [B, T, HS] fp32: the gated scan (DECAY)
    z_rows: bool = True,  # gated: the tokens add to z (else z is only the decayed init)
    z_of_rows: bool = False,  # gated: z sums u times the rounded rows of the S sum (a x, decayed), not u x in fp32
    split_rows: bool = False,  # gated, 16-bit x: rows as hi + lo (two products), so S and z are fp32-exact
):
    """Run the scan; returns (states, zstates, final, zfinal) (unrequested ones None)."""
    B, T, HXY, K = x.shape
    V = y.shape[-1]
    G = HXY // heads
    N = triton.cdiv(T, BT)
    dev = x.device
    BK = max(MIN_TILE, min(BK, pow2(K)))
    BV = max(MIN_TILE, min(BV, pow2(V)))
    if segments == 1:
        seg_chunks = N + seg_off
    f32 = torch.float32
    st = new_empty((B, heads, N, K, V), dtype=f32, device=dev) if per_chunk else None
    stz = new_empty((B, heads, N, K), dtype=f32, device=dev) if (per_chunk and do_z) else None
    fin = new_empty((B, heads, segments, K, V), dtype=f32, device=dev) if store_final else None
    finz = new_empty((B, heads, segments, K), dtype=f32, device=dev) if (store_final and do_z) else None
    dummy = x  # never dereferenced when the matching flag is off
    S0, z0 = init if init is not None else (None, None)
    has_init = S0 is not None
    if has_init and do_z and z0 is None:
        raise ValueError("scan_states: init z required when do_z")
    grid = (triton.cdiv(K, BK), triton.cdiv(V, BV), B * heads * segments)
    launch(
        _scan_kernel, grid,
        x, y, a if a is not None else dummy, u if u is not None else dummy,
        log_decay if log_decay is not None else dummy,
        S0 if has_init else dummy, z0 if (has_init and z0 is not None) else dummy,
        st if st is not None else dummy, stz if stz is not None else dummy,
        fin if fin is not None else dummy, finz if finz is not None else dummy,
        T, heads, N, segments, seg_chunks, seg_off,
        K=K, V=V, BK=BK, BV=BV, BT=BT, G=G, STRIDE=1, REVERSE=reverse,
        HAS_A=a is not None, HAS_U=u is not None, DO_Z=do_z,
        HAS_INIT=has_init, STORE_STATES=per_chunk, STORE_FINAL=store_final, INIT_PER_SEG=init_per_segment,
        PREC=prec(x.dtype), DECAY=log_decay is not None, Z_ROWS=z_rows, Z_OF_R=z_of_rows,
        SPLIT_ROWS=split_rows and x.dtype != torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )
    return st, stz, fin, finz


def segment_sum_launch(cfg: dict) -> dict:
    """``segment_starts`` keyword arguments from a kernel family's CONFIG (``seg_warps``, ``seg_bk``, ``seg_bv``)."""
    return {"scan_warps": cfg.get("seg_warps", cfg.get("scan_warps", 4)),
            "BK": cfg.get("seg_bk", 64), "BV": cfg.get("seg_bv", 64)}


def segment_starts(x, y, heads, init, nseg, seg_chunks, BT, *, reverse=False, a=None, u=None, scan_warps=4,
                   seg_off=0, BK=64, BV=64):
    """State entering each segment: ``init`` plus the sum over the segments before it (after it when
    ``reverse``) of ``(a x)^T y`` and ``sum u x``. Returns ``(S [B,heads,NSEG,K,V], z [B,heads,NSEG,K])``
    fp32, or ``(None, None)`` for one segment and no ``init``; ``init = (S, z or None)``. ``seg_off``
    shifts the summed chunks that many chunks earlier (the window kernel's state lags one chunk, the shifted
    linear forward's ``shift / BT``).
    Each summing program holds a ``[BK, BV]`` state tile, so ``x`` is read ``V / BV`` times and ``y`` ``K / BK``
    times (the CONFIG's ``seg_bk`` / ``seg_bv``; ``[128, 128]`` tiles once gave wrong gradients on an H200)."""
    f32 = torch.float32
    S0, z0 = init if init is not None else (None, None)
    if nseg == 1:
        if S0 is None:
            return None, None
        if z0 is None:
            z0 = torch.zeros(S0.shape[:-1], device=S0.device, dtype=f32)
        return S0.to(f32).contiguous().unsqueeze(2), z0.to(f32).contiguous().unsqueeze(2)
    _, _, part, partz = scan_states(x, y, heads=heads, a=a, u=u, per_chunk=False, store_final=True, do_z=True,
                                    segments=nseg, seg_chunks=seg_chunks, seg_off=seg_off, BT=BT,
                                    BK=BK, BV=BV, num_warps=scan_warps)
    if reverse:  # exclusive: the segments after each one
        seg_S = part.flip(2).cumsum(2).flip(2) - part
        seg_z = partz.flip(2).cumsum(2).flip(2) - partz
    else:
        seg_S = torch.cumsum(part, 2) - part
        seg_z = torch.cumsum(partz, 2) - partz
    if S0 is not None:
        seg_S += S0.to(f32).unsqueeze(2)
    if z0 is not None:
        seg_z += z0.to(f32).unsqueeze(2)
    return seg_S.contiguous(), seg_z.contiguous()


def chunk_states(x, y, *, heads, cfg, a=None, u=None, do_z=True, init=None, reverse=False, store_final=False,
                 BT=64):
    """Exclusive per-chunk states for a backward pass: ``(states [B,HS,N,K,V], zstates [B,HS,N,K] or None,
    total [B,HS,K,V] or None, ztotal [B,HS,K] or None)``, ``total`` = ``init`` + the whole sequence
    (requested with ``store_final``).

    One program walks all chunks of its ``[64, 64]`` state block. When those programs would leave most of
    the GPU idle (``cfg["scan_split_below_waves"]`` programs per SM; long sequences at small batch), the walk is
    cut into segments: their sums in parallel, an exclusive prefix over segments, then every segment writes
    its chunks' states from its own starting state (``cfg["scan_waves"]`` programs per SM).
    """
    B, T, _, K = x.shape
    V = y.shape[-1]
    N = triton.cdiv(T, BT)
    progs = triton.cdiv(K, min(64, pow2(K))) * triton.cdiv(V, min(64, pow2(V))) * B * heads
    plan = {"split_below_waves": cfg["scan_split_below_waves"], "fwd_waves": cfg["scan_waves"],
            "force_segments": cfg.get("force_segments")}
    nseg, seg_chunks = plan_segments(plan, N, progs, x.device)
    warps = cfg["scan_warps"]
    if nseg == 1:
        st, stz, fin, finz = scan_states(x, y, heads=heads, a=a, u=u, do_z=do_z, init=init, reverse=reverse,
                                         store_final=store_final, BT=BT, num_warps=warps)
        return st, stz, (fin[:, :, 0] if store_final else None), (finz[:, :, 0] if store_final and do_z else None)
    seg_S, seg_z = segment_starts(x, y, heads, init, nseg, seg_chunks, BT, reverse=reverse, a=a, u=u,
                                  **segment_sum_launch(cfg))
    st, stz, fin, finz = scan_states(x, y, heads=heads, a=a, u=u, do_z=do_z, init=(seg_S, seg_z if do_z else None),
                                     reverse=reverse, store_final=store_final, segments=nseg, seg_chunks=seg_chunks,
                                     init_per_segment=True, BT=BT, num_warps=warps)
    if not store_final:
        return st, stz, None, None
    last = 0 if reverse else nseg - 1  # the segment whose walk ends at the sequence's far end
    return st, stz, fin[:, :, last], (finz[:, :, last] if do_z else None)


# ---------------------------------------------------------------------------
# gated (decayed) chunk-state scans: the state decays by exp(log_decay_t) at every token


def gated_scan_states(x, y, log_decay, **kw):
    """:func:`scan_states` with ``log_decay [B, T, HS]`` fp32 (its ``DECAY`` scan; ``heads`` from ``log_decay``).
    Forward states are those entering each chunk; reverse ones cover the chunks after each chunk."""
    return scan_states(x, y, heads=log_decay.shape[2], log_decay=log_decay, **kw)


@triton.jit
def _decay_prefix_scan_kernel(
    P_S, P_Z, LSEG,  # per-segment sums decayed to the segment's end [B,HS,NSEG,K,V], [B,HS,NSEG,K]; LSEG [B,HS,NSEG]
    INIT_S, INIT_Z,  # [B,HS,K,V], [B,HS,K]
    OUT_S, OUT_Z,  # state entering each segment [B,HS,NSEG,K,V], [B,HS,NSEG,K]
    NSEG, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_INIT: tl.constexpr,
):
    """``OUT[0] = init``, ``OUT[s] = e^{L[s-1]} OUT[s-1] + P[s-1]`` (``L`` a segment's total log decay)."""
    pk = tl.program_id(0)
    pv = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    ok = pk * BK + tl.arange(0, BK)
    ov = pv * BV + tl.arange(0, BV)
    mk = ok < K
    mv = ov < V
    m2 = mk[:, None] & mv[None, :]
    kv = ok[:, None] * V + ov[None, :]
    acc = tl.zeros([BK, BV], dtype=tl.float32)
    accz = tl.zeros([BK], dtype=tl.float32)
    if HAS_INIT:
        acc += tl.load(INIT_S + bh * K * V + kv, mask=m2, other=0.0)
        accz += tl.load(INIT_Z + bh * K + ok, mask=mk, other=0.0)
    for s in range(NSEG):
        r = bh * NSEG + s
        tl.store(OUT_S + r * K * V + kv, acc, mask=m2)
        keep = tl.exp(tl.load(LSEG + r))
        acc = acc * keep + tl.load(P_S + r * K * V + kv, mask=m2, other=0.0)
        if pv == 0:
            tl.store(OUT_Z + r * K + ok, accz, mask=mk)
            accz = accz * keep + tl.load(P_Z + r * K + ok, mask=mk, other=0.0)


def gated_segment_starts(x, y, log_decay, init, nseg, seg_chunks, BT, *, BK=64, BV=64, scan_warps=4):
    """Gated :func:`segment_starts` (forward only): the state entering each of ``nseg`` segments of
    ``seg_chunks`` chunks, the tokens before it decayed to the position just before it, plus ``init`` decayed
    likewise. Returns ``(S [B,HS,NSEG,K,V], z [B,HS,NSEG,K])`` fp32, or ``(None, None)`` for one segment and
    no ``init``."""
    f32 = torch.float32
    S0, z0 = init if init is not None else (None, None)
    if nseg == 1:
        if S0 is None:
            return None, None
        return S0.to(f32).contiguous().unsqueeze(2), z0.to(f32).contiguous().unsqueeze(2)
    B, T, HS = log_decay.shape
    K, V = x.shape[-1], y.shape[-1]
    _, _, part, partz = gated_scan_states(x, y, log_decay, per_chunk=False, store_final=True, segments=nseg,
                                          seg_chunks=seg_chunks, z_of_rows=True, BT=BT, BK=BK, BV=BV,
                                          num_warps=scan_warps)
    span = nseg * seg_chunks * BT  # >= T
    lseg = torch.nn.functional.pad(log_decay, (0, 0, 0, span - T)).view(B, nseg, seg_chunks * BT, HS).sum(2)
    lseg = lseg.transpose(1, 2).contiguous()  # [B, HS, NSEG]
    seg_S = torch.empty_like(part)
    seg_z = torch.empty_like(partz)
    BK = max(MIN_TILE, min(BK, pow2(K)))
    BV = max(MIN_TILE, min(BV, pow2(V)))
    _decay_prefix_scan_kernel[(triton.cdiv(K, BK), triton.cdiv(V, BV), B * HS)](
        part, partz, lseg, S0 if S0 is not None else part, z0 if S0 is not None else partz, seg_S, seg_z,
        nseg, K=K, V=V, BK=BK, BV=BV, HAS_INIT=S0 is not None, num_warps=scan_warps)
    return seg_S, seg_z

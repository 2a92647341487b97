"""Kernel tests: reference vs the literal spec, chunked PyTorch vs reference (outputs
and gradients), decode steps vs full forwards, dispatcher errors.

The Triton kernels are tested (under TRITON_INTERPRET=1 on CPU) in
``tests/test_kernels_triton.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from linearize.kernels import (
    empty_linear_state,
    empty_window_state,
    linear_attention,
    linear_attention_step,
    window_linear_attention,
    window_linear_attention_step,
    window_state_from_prefill,
)
from linearize.kernels.reference import linear_attention_reference, window_linear_attention_reference
from linearize.kernels.testing import check_left_padding
from linearize.kernels.testing import check_linear, check_window, linear_inputs, rel_err, window_inputs

F64 = torch.float64
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}


# ---------------------------------------------------------------------------
# the reference is the spec: compare with a literal per-query loop


def test_reference_linear_literal():
    torch.manual_seed(0)
    B, T, H, Hk, K, V = 1, 9, 4, 2, 3, 5
    inp = linear_inputs(B, T, H, Hk, K, V, dtype=F64, state=True)
    q, k, v = inp["q"], inp["k"], inp["v"]
    S0, z0 = inp["initial_state"]
    o, (S, z) = linear_attention_reference(q, k, v, initial_state=(S0, z0), output_final_state=True)
    for b in range(B):
        for h in range(H):
            hk = h // (H // Hk)
            St, zt = S0[b, hk].clone(), z0[b, hk].clone()
            for t in range(T):
                St += torch.outer(k[b, t, hk], v[b, t, hk])
                zt += k[b, t, hk]
                exp = q[b, t, h] @ St / (q[b, t, h] @ zt + 1e-6)
                torch.testing.assert_close(o[b, t, h], exp)
            torch.testing.assert_close(S[b, hk], St)
            torch.testing.assert_close(z[b, hk], zt)


def test_reference_window_literal():
    B, T, H, Hk, D, K, V, W = 1, 13, 4, 2, 6, 3, 5, 4
    inp = window_inputs(B, T, H, Hk, D, K, V, dtype=F64, state=True)
    q, k, fq, fk, v, wf = (inp[n] for n in ("q", "k", "fq", "fk", "v", "window_factor"))
    wf = wf.double()
    S0, z0 = inp["initial_state"]
    eps = 1e-12
    o, (S, z) = window_linear_attention_reference(
        q, k, fq, fk, v, wf, window=W, initial_state=(S0, z0), output_final_state=True, eps=eps
    )
    sc = D ** -0.5
    for h in range(H):
        hk = h // (H // Hk)
        for i in range(T):
            num = (1 - wf[h]) * (fq[0, i, h] @ S0[0, hk])
            den = (1 - wf[h]) * (fq[0, i, h] @ z0[0, hk]) + eps
            for j in range(i + 1):
                if i - j < W:
                    e = math.exp(sc * float(q[0, i, h] @ k[0, j, hk]))
                    num = num + wf[h] * e * v[0, j, hk]
                    den = den + wf[h] * e
                else:
                    a = fq[0, i, h] @ fk[0, j, hk]
                    num = num + (1 - wf[h]) * a * v[0, j, hk]
                    den = den + (1 - wf[h]) * a
            torch.testing.assert_close(o[0, i, h], num / den)
    n = T - W
    torch.testing.assert_close(S, S0 + torch.einsum("bthk,bthv->bhkv", fk[:, :n], v[:, :n]))
    torch.testing.assert_close(z, z0 + fk[:, :n].sum(1))


def test_reference_window_shift_invariance_extreme_scores():
    """Very large and very negative scores: no overflow, no NaN, result unchanged by the shift."""
    B, T, H, Hk, D, K, V, W = 1, 40, 2, 1, 8, 4, 4, 8
    inp = window_inputs(B, T, H, Hk, D, K, V, dtype=F64, qk_std=40.0)
    o, _ = window_linear_attention_reference(*(inp[n] for n in ("q", "k", "fq", "fk", "v", "window_factor")), window=W)
    assert torch.isfinite(o).all()
    inp2 = dict(inp)
    inp2["q"] = -inp["q"]  # flips which scores are extreme
    o2, _ = window_linear_attention_reference(*(inp2[n] for n in ("q", "k", "fq", "fk", "v", "window_factor")), window=W)
    assert torch.isfinite(o2).all()
    o3, _ = window_linear_attention(*(inp[n].float() for n in ("q", "k", "fq", "fk", "v", "window_factor")), window=W, backend="torch")
    assert rel_err(o3, o) < 1e-4


# ---------------------------------------------------------------------------
# chunked PyTorch path vs reference

LIN_SHAPES = [
    # B, T, H, Hk, K, V
    (2, 1, 2, 2, 16, 16),
    (1, 63, 4, 2, 16, 32),
    (2, 65, 4, 1, 32, 16),
    (1, 64, 2, 2, 16, 16),
    (1, 1000, 4, 2, 32, 16),
]


@pytest.mark.parametrize("shape", LIN_SHAPES, ids=lambda s: "B{}T{}H{}Hk{}K{}V{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "num"])
def test_linear_torch_vs_reference(shape, dtype, normalize):
    check_linear("torch", *shape, dtype, normalize=normalize, state=shape[1] % 2 == 1)


WIN_SHAPES = [
    # B, T, H, Hk, D, K, V, W
    (2, 1, 2, 2, 16, 16, 16, 64),
    (1, 63, 4, 2, 16, 32, 16, 64),
    (2, 65, 4, 1, 32, 16, 32, 64),
    (1, 200, 4, 2, 16, 16, 16, 16),
    (1, 150, 2, 1, 16, 16, 8, 100),
    (1, 1000, 4, 2, 32, 32, 16, 64),
]


@pytest.mark.parametrize("shape", WIN_SHAPES, ids=lambda s: "B{}T{}H{}Hk{}D{}K{}V{}W{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_torch_vs_reference(shape, dtype):
    check_window("torch", *shape, dtype, state=shape[1] % 2 == 1)


def test_linear_continuation_two_halves():
    inp = linear_inputs(2, 130, 4, 2, 16, 8)
    q, k, v = inp["q"], inp["k"], inp["v"]
    o, st = linear_attention(q, k, v, output_final_state=True, backend="torch")
    o1, st1 = linear_attention(q[:, :57], k[:, :57], v[:, :57], output_final_state=True, backend="torch")
    o2, st2 = linear_attention(q[:, 57:], k[:, 57:], v[:, 57:], initial_state=st1, output_final_state=True, backend="torch")
    assert rel_err(torch.cat([o1, o2], 1), o) < 1e-5
    assert rel_err(st2[0], st[0]) < 1e-5 and rel_err(st2[1], st[1]) < 1e-5


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("split", [3, 50, 90])
def test_window_continuation_prepend(backend, split):
    """Second part with the previous W tokens prepended and the first part's state == one whole."""
    W = 16
    inp = window_inputs(1, 120, 4, 2, 16, 8, 8)
    names = ("q", "k", "fq", "fk", "v")
    q, k, fq, fk, v = (inp[n] for n in names)
    wf = inp["window_factor"]
    o, st = window_linear_attention(q, k, fq, fk, v, wf, window=W, output_final_state=True, backend=backend)
    _, st1 = window_linear_attention(*(x[:, :split] for x in (q, k, fq, fk, v)), wf, window=W, output_final_state=True, backend=backend)
    lo = max(split - W, 0)
    o2, st2 = window_linear_attention(
        *(x[:, lo:] for x in (q, k, fq, fk, v)), wf, window=W, initial_state=st1, output_final_state=True, backend=backend
    )
    assert rel_err(o2[:, split - lo :], o[:, split:]) < 1e-5
    assert rel_err(st2[0], st[0]) < 1e-5 and rel_err(st2[1], st[1]) < 1e-5


def test_torch_path_gradient_to_window_factor_is_real():
    inp = window_inputs(1, 80, 2, 1, 8, 8, 8)
    wf = inp["window_factor"].clone().requires_grad_()
    o, _ = window_linear_attention(inp["q"], inp["k"], inp["fq"], inp["fk"], inp["v"], wf, window=8, backend="torch")
    o.square().sum().backward()
    assert wf.grad is not None and wf.grad.abs().min() > 0


# ---------------------------------------------------------------------------
# decode steps


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("prefill", [0, 5, 70])
def test_linear_step_matches_forward(normalize, prefill):
    B, T, H, Hk, K, V = 2, 90, 4, 2, 16, 8
    inp = linear_inputs(B, T, H, Hk, K, V)
    q, k, v = inp["q"], inp["k"], inp["v"]
    o_full, st_full = linear_attention(q, k, v, normalize=normalize, output_final_state=True, backend="reference")
    if prefill:
        o_pre, state = linear_attention(q[:, :prefill], k[:, :prefill], v[:, :prefill], normalize=normalize,
                                        output_final_state=True, backend="torch")
    else:
        state = empty_linear_state(B, Hk, K, V)
    outs = []
    out = torch.full((B, H, V), float("nan"))
    for t in range(prefill, T):
        o = linear_attention_step(q[:, t], k[:, t], v[:, t], state, normalize=normalize, out=out if t % 2 else None)
        outs.append(o.clone())
    assert rel_err(torch.stack(outs, 1), o_full[:, prefill:]) < 1e-5
    assert rel_err(state[0], st_full[0]) < 1e-5 and rel_err(state[1], st_full[1]) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefill,W", [(0, 8), (5, 8), (8, 8), (37, 8), (70, 64), (3, 64)])
def test_window_step_matches_forward(prefill, W, dtype):
    B, T, H, Hk, D, K, V = 2, 85, 4, 2, 16, 8, 8
    inp = window_inputs(B, T, H, Hk, D, K, V, dtype=dtype)
    names = ("q", "k", "fq", "fk", "v")
    q, k, fq, fk, v = (inp[n] for n in names)
    wf = inp["window_factor"]
    o_full, st_full = window_linear_attention(q, k, fq, fk, v, wf, window=W, output_final_state=True, backend="reference")
    if prefill:
        _, st = window_linear_attention(*(x[:, :prefill] for x in (q, k, fq, fk, v)), wf, window=W,
                                        output_final_state=True, backend="torch")
        state = window_state_from_prefill(k[:, :prefill], fk[:, :prefill], v[:, :prefill], st, W)
    else:
        state = empty_window_state(B, Hk, D, K, V, W, dtype=dtype)
    out = torch.full((B, H, V), float("nan"), dtype=dtype)
    outs = []
    for t in range(prefill, T):
        o = window_linear_attention_step(q[:, t], k[:, t], fq[:, t], fk[:, t], v[:, t], wf, state,
                                         out=out if t % 2 else None)
        outs.append(o.clone())
    assert int(state.seen) == T
    tol = TOL[dtype]
    assert rel_err(torch.stack(outs, 1), o_full[:, prefill:]) < tol
    assert rel_err(state.S, st_full[0]) < 1e-5 and rel_err(state.z, st_full[1]) < 1e-5


# ---------------------------------------------------------------------------
# padding (key_mask)


@pytest.mark.parametrize("kind", ["linear", "window"])
@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("T,pad,W,steps", [(40, 13, 8, 12), (12, 7, 8, 2), (12, 7, 8, 9), (40, 13, 64, 5)],
                         ids=["ring-real", "ring-padded", "padding-leaves-ring", "W64"])
def test_left_padding_equals_unpadded(kind, backend, T, pad, W, steps):
    """A left-padded row (NaN inputs at the padding) gets its unpadded sequence's outputs and state, in the
    forward and in the decode steps after it, also while the window ring still holds padding."""
    check_left_padding(kind, backend, T=T, pad=pad, W=W, steps=steps)


def test_left_padding_bf16():
    check_left_padding("window", "torch", dtype=torch.bfloat16)


@pytest.mark.parametrize("B,T,W,state", [(2, 150, 8, True), (2, 63, 64, False), (1, 1, 64, False), (2, 200, 64, True)])
def test_window_key_mask_torch_vs_reference(B, T, W, state):
    """Any padding pattern (a third of the keys, a masked leading run): the chunked path matches the reference
    on outputs, final state and every gradient."""
    check_window("torch", B, T, 4, 2, 16, 8, 8, W, torch.float32, state=state, masked=True)


def test_key_mask_must_be_bool_b_by_t():
    inp = window_inputs(2, 10, 2, 2, 8, 8, 8)
    args = [inp[n] for n in ("q", "k", "fq", "fk", "v", "window_factor")]
    with pytest.raises(ValueError, match="key_mask"):
        window_linear_attention(*args, window=4, key_mask=torch.ones(2, 10))
    with pytest.raises(ValueError, match="key_mask"):
        linear_attention(inp["fq"], inp["fk"], inp["v"], key_mask=torch.ones(2, 9, dtype=torch.bool))


# ---------------------------------------------------------------------------
# dispatcher


def test_dispatch_errors():
    inp = linear_inputs(1, 4, 3, 2, 4, 4)
    with pytest.raises(ValueError, match="multiple"):
        linear_attention(inp["q"], inp["k"], inp["v"])
    inp = linear_inputs(1, 4, 2, 2, 4, 4)
    with pytest.raises(ValueError, match="backend"):
        linear_attention(inp["q"], inp["k"], inp["v"], backend="cuda")
    o, st = linear_attention(inp["q"], inp["k"], inp["v"])
    assert st is None and o.shape == (1, 4, 2, 4)


def test_partial_rotary_matches_transformers():
    """Rotary tables narrower than the heads (Phi-4-mini rotates 3/4 of each head) rotate the first dims only, as
    transformers' Phi-3 attention does."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    from linearize.kernels import rotary_embedding

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 7, 4, 16, generator=g), torch.randn(2, 7, 2, 16, generator=g)
    angles = torch.randn(2, 7, 6, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [B, T, 12] of 16
    ours = rotary_embedding(q, k, cos, sin, backend="torch")
    theirs = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b.transpose(1, 2))
    assert torch.equal(ours[0][..., 12:], q[..., 12:])


def test_launch_retries_unpipelined_once_and_keeps_nothing_alive(monkeypatch):
    """A launch that runs out of shared memory is retried with one stage, and that configuration starts with one
    stage from then on. Triton raises the error from a frame that keeps it (a reference cycle through the
    traceback); the failed launch's arguments must still be freed at once, not when the garbage collector runs
    (a Gemma 3 hybrid's prefill on an H200 kept every linear layer's tensors alive that way)."""
    import gc
    import weakref

    triton_common = pytest.importorskip("linearize.kernels.triton_common")
    from triton.runtime.errors import OutOfResources

    stages = []

    class Kernel:  # stands in for a JITFunction: kernel[grid](*args, **kw)
        def __getitem__(self, grid):
            def run(*args, num_stages=3, **kw):
                stages.append(num_stages)
                if num_stages > 1:
                    def raise_(err):  # as triton's CompiledKernel._init_handles raises it
                        raise err
                    raise_(OutOfResources(327680, 232448, "shared memory"))
                return "ran"
            return run

    monkeypatch.setattr(triton_common, "UNPIPELINED", {})
    kernel = Kernel()
    x = torch.zeros(1000)
    alive = weakref.ref(x)
    gc.disable()
    try:
        assert triton_common.launch(kernel, (1,), x, 7, BLOCK=64, num_warps=4) == "ran"
        del x
        assert alive() is None, "the failed launch's arguments outlived it"
        assert triton_common.launch(kernel, (1,), torch.zeros(3), 9, BLOCK=64, num_warps=4) == "ran"
        assert triton_common.launch(kernel, (1,), torch.zeros(3), 9, BLOCK=128, num_warps=4) == "ran"
    finally:
        gc.enable()
    assert stages == [3, 1, 1, 3, 1]  # remembered per configuration

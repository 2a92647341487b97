"""The gated delta rule on the PyTorch paths: the reference against explicit transition matrices and the rule's
defining behaviour (a key written twice keeps the second value), the chunked path against the float64 reference
(outputs, final state, gradients of q, k, v, beta, log_decay and the initial state), continuation, decode steps
against one forward, the backend choice and the argument checks."""

from __future__ import annotations

import pytest
import torch

from linearize.kernels.delta import gated_delta_rule, gated_delta_rule_step
from linearize.kernels.delta_chunked import gated_delta_rule_chunked
from linearize.kernels.delta_reference import gated_delta_rule_reference
from linearize.kernels.delta_testing import F64, NAMES, TOL, backend_fn, check, compare, delta_inputs, run
from linearize.kernels.testing import rel_err

# ---------------------------------------------------------------------------
# the reference is the spec


def test_reference_is_the_transition_matrices():
    """S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T with the [K, K] matrices written out, per batch
    row and KV head; o_t = S_t^T (scale q_t) for each query head of the group."""
    B, T, H, Hk, K, V = 2, 9, 4, 2, 5, 3
    inp = delta_inputs(B, T, H, Hk, K, V, dtype=F64, seed=3)
    q, k, v, beta, ld = (inp[n].double() for n in NAMES)
    S0 = inp["initial_state"].double()
    scale = 0.7
    o, S = gated_delta_rule_reference(q, k, v, beta, ld, scale=scale, initial_state=S0, output_final_state=True)
    for b in range(B):
        for hk in range(Hk):
            St = S0[b, hk].clone()
            for t in range(T):
                kt = k[b, t, hk]
                trans = torch.exp(ld[b, t, hk]) * (torch.eye(K, dtype=F64) - beta[b, t, hk] * torch.outer(kt, kt))
                St = trans @ St + beta[b, t, hk] * torch.outer(kt, v[b, t, hk])
                for h in range(hk * (H // Hk), (hk + 1) * (H // Hk)):
                    torch.testing.assert_close(o[b, t, h], St.T @ (scale * q[b, t, h]))
            torch.testing.assert_close(S[b, hk], St)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_a_key_written_twice_keeps_the_second_value(backend):
    """The delta rule replaces: with beta = 1 and no decay, writing v1 then v2 under the same unit key leaves v2
    under it (linear attention would return v1 + v2), and an orthogonal key's value is untouched."""
    K = V = 4
    e = torch.eye(K, dtype=F64)
    k = torch.stack([e[0], e[1], e[0]]).view(1, 3, 1, K)  # keys e0, e1, e0
    v = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [-1.0, 0.5, 0.0, 2.0]], dtype=F64).view(1, 3, 1, V)
    q = torch.stack([e[1], e[0], e[0]]).view(1, 3, 1, K)  # read e1 after the first token, then e0
    ones = torch.ones(1, 3, 1, dtype=F64)
    o, S = gated_delta_rule(q, k, v, ones, None, scale=1.0, output_final_state=True, backend=backend)
    torch.testing.assert_close(o[0, :, 0], torch.stack([torch.zeros(V, dtype=F64), v[0, 0, 0], v[0, 2, 0]]))
    torch.testing.assert_close(S[0, 0], torch.outer(e[1], v[0, 1, 0]) + torch.outer(e[0], v[0, 2, 0]))


# ---------------------------------------------------------------------------
# the chunked PyTorch path vs the float64 reference: outputs, final state, every gradient

SHAPES = [
    # B, T, H, Hk, K, V
    (2, 1, 2, 2, 16, 16),
    (1, 37, 4, 2, 16, 8),  # GQA, K != V
    (1, 64, 2, 2, 32, 32),  # one whole chunk
    (2, 130, 4, 1, 8, 16),  # three chunks, the last one partial, groups of 4
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}Hk{}K{}V{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_vs_reference(shape, dtype):
    check("torch", *shape, dtype, state=shape[1] % 2 == 1)


def test_chunked_fp32_queries_and_keys_with_bf16_values():
    """As the layer calls it: q and k normalised in fp32, v and beta in the model's bf16 (outputs in bf16)."""
    check("torch", 1, 70, 4, 2, 16, 8, torch.bfloat16, qk_dtype=torch.float32)


@pytest.mark.parametrize("decay", ["strong", "zero"])
def test_chunked_decays(decay):
    """log_decay ~ -5 (the state forgets within a few tokens) over several chunks stays finite and exact; zero
    decay is the plain delta rule."""
    check("torch", 1, 150, 4, 2, 16, 16, torch.float32, decay=decay)


def test_no_decay_is_zero_decay():
    inp = delta_inputs(2, 70, 4, 2, 16, 8, decay="zero")
    args = [inp[n] for n in NAMES[:4]]
    for backend in ("torch", "reference"):
        a = gated_delta_rule(*args, None, initial_state=inp["initial_state"], output_final_state=True,
                             backend=backend)
        b = gated_delta_rule(*args, inp["log_decay"], initial_state=inp["initial_state"], output_final_state=True,
                             backend=backend)
        assert rel_err(a[0], b[0]) < 1e-6 and rel_err(a[1], b[1]) < 1e-6


def test_chunk_size_is_a_detail():
    inp = delta_inputs(1, 100, 2, 1, 16, 16)
    args = [inp[n] for n in NAMES]
    outs = [gated_delta_rule_chunked(*args, initial_state=inp["initial_state"], output_final_state=True,
                                     chunk_size=c) for c in (16, 64, 128)]
    for o, S in outs[1:]:
        assert rel_err(o, outs[0][0]) < 1e-5 and rel_err(S, outs[0][1]) < 1e-5


def test_scale_is_applied_to_q():
    inp = delta_inputs(1, 20, 2, 2, 16, 8, seed=4)
    args = [inp[n] for n in NAMES]
    o1, _ = gated_delta_rule(*args, scale=0.3, backend="torch")
    o2, _ = gated_delta_rule(inp["q"] * 0.3 / 16 ** -0.5, *args[1:], backend="torch")  # default scale K^-1/2
    assert rel_err(o1, o2) < 1e-6


# ---------------------------------------------------------------------------
# continuation and decode


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("split", [37, 64])
def test_continuation_two_halves(backend, split):
    inp = delta_inputs(2, 100, 4, 2, 16, 8, seed=5)
    xs = [inp[n] for n in NAMES]

    def call(sl, state):
        return gated_delta_rule(*(x[:, sl] for x in xs), initial_state=state, output_final_state=True,
                                backend=backend)

    o, S = call(slice(None), inp["initial_state"])
    o1, S1 = call(slice(0, split), inp["initial_state"])
    o2, S2 = call(slice(split, None), S1)
    assert rel_err(torch.cat([o1, o2], 1), o) < 1e-5 and rel_err(S2, S) < 1e-5


@pytest.mark.parametrize("prefill", [0, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_matches_forward(prefill, dtype):
    """Decode steps (state in place, output into ``out`` every other step) after a prefill equal one forward."""
    B, T, H, Hk, K, V = 2, 60, 4, 2, 16, 8
    inp = delta_inputs(B, T, H, Hk, K, V, dtype=dtype, seed=6, state=False)
    q, k, v, beta, ld = (inp[n] for n in NAMES)
    ref, ref_S = gated_delta_rule(*(x.double() for x in (q, k, v, beta)), ld.double(), output_final_state=True,
                                  backend="reference")
    if prefill:
        _, state = gated_delta_rule(*(x[:, :prefill] for x in (q, k, v, beta, ld)), output_final_state=True,
                                    backend="torch")
    else:
        state = torch.zeros(B, Hk, K, V)
    out = torch.full((B, H, V), float("nan"), dtype=dtype)
    outs = [gated_delta_rule_step(q[:, t], k[:, t], v[:, t], beta[:, t], ld[:, t], state,
                                  out=out if t % 2 else None).clone() for t in range(prefill, T)]
    assert outs[0].dtype == dtype
    assert rel_err(torch.stack(outs, 1), ref[:, prefill:]) < TOL[dtype]
    assert rel_err(state, ref_S) < 1e-5


def test_step_without_decay():
    inp = delta_inputs(1, 10, 2, 1, 8, 8, state=False, decay="zero")
    q, k, v, beta = (inp[n] for n in NAMES[:4])
    ref, _ = gated_delta_rule(q, k, v, beta, None, backend="reference")
    state = torch.zeros(1, 1, 8, 8)
    outs = [gated_delta_rule_step(q[:, t], k[:, t], v[:, t], beta[:, t], None, state) for t in range(10)]
    assert rel_err(torch.stack(outs, 1), ref) < 1e-5


# ---------------------------------------------------------------------------
# backend choice and argument checks


def test_backends():
    inp = delta_inputs(1, 5, 2, 1, 8, 8)
    args = [inp[n] for n in NAMES]
    ref, _ = gated_delta_rule(*args, backend="reference")
    assert rel_err(gated_delta_rule(*args)[0], ref) < 1e-5  # None on CPU: the chunked path
    with pytest.raises(ValueError, match="backend must be one of"):
        gated_delta_rule(*args, backend="cuda")
    if not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            gated_delta_rule(*args, backend="triton")


def test_argument_checks():
    inp = delta_inputs(2, 10, 4, 2, 8, 6)
    q, k, v, beta, ld = (inp[n] for n in NAMES)
    with pytest.raises(ValueError, match=r"beta must be a floating-point tensor of shape \[2, 10, 2\]"):
        gated_delta_rule(q, k, v, beta[..., :1], ld)
    with pytest.raises(ValueError, match=r"log_decay must be a floating-point tensor of shape \[2, 10, 2\]"):
        gated_delta_rule(q, k, v, beta, ld.unsqueeze(-1))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        gated_delta_rule(q[:, :, :3], k, v, beta, ld)
    with pytest.raises(ValueError, match="shape mismatch"):
        gated_delta_rule(q, k, v[:, :9], beta, ld)
    with pytest.raises(ValueError, match=r"initial_state must be \[B, Hk, K, V\]=\[2, 2, 8, 6\]"):
        gated_delta_rule(q, k, v, beta, ld, initial_state=torch.zeros(2, 2, 6, 8))
    state = torch.zeros(2, 2, 8, 6)
    with pytest.raises(ValueError, match=r"beta must be a floating-point tensor of shape \[2, 2\]"):
        gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta, ld[:, 0], state)
    with pytest.raises(ValueError, match="contiguous float32"):
        gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], ld[:, 0], state.transpose(-1, -2))
    with pytest.raises(ValueError, match="contiguous float32"):
        gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], ld[:, 0], state.bfloat16())
    # a bf16 log_decay is cast to float32: the result of the float32 values
    a, _ = gated_delta_rule(q, k, v, beta, ld.bfloat16(), backend="torch")
    b, _ = gated_delta_rule(q, k, v, beta, ld.bfloat16().float(), backend="torch")
    assert torch.equal(a, b)


def test_gradient_of_the_initial_state_only():
    """A backward that needs only the initial state's gradient (the other inputs fixed)."""
    inp = delta_inputs(1, 40, 2, 1, 8, 8, seed=7)
    S0 = inp["initial_state"].clone().requires_grad_()
    o, S = gated_delta_rule(*(inp[n] for n in NAMES), initial_state=S0, output_final_state=True, backend="torch")
    (o.sum() + S.sum()).backward()
    S0r = inp["initial_state"].double().requires_grad_()
    o, S = gated_delta_rule(*(inp[n] for n in NAMES), initial_state=S0r, output_final_state=True,
                            backend="reference")
    (o.sum() + S.sum()).backward()
    assert rel_err(S0.grad, S0r.grad) < 1e-5


def test_compare_catches_a_wrong_gradient():
    """The check itself fails on a path whose beta gradient is off."""
    inp = delta_inputs(1, 20, 2, 1, 8, 8)

    def wrong(x):  # beta enters as beta * (1 + 1e-2 (beta - beta.detach())): same values, a 1% larger gradient
        beta = x["beta"] * (1 + 1e-2 * (x["beta"] - x["beta"].detach())) + 1e-2 * (x["beta"] - x["beta"].detach())
        return gated_delta_rule(x["q"], x["k"], x["v"], beta, x["log_decay"], initial_state=x["initial_state"],
                                output_final_state=True, backend="torch")

    with pytest.raises(AssertionError, match="dbeta"):
        compare(run(wrong, inp), run(backend_fn("reference"), inp, dtype=F64), torch.float32)

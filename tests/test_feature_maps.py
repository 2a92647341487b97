"""Tests for linearize.model.feature_maps: shapes, dtypes, positivity, gradients, registry errors."""

from __future__ import annotations

import math

import pytest
import torch

from linearize.model.feature_maps import (
    FEATURE_MAPS,
    FeatureMap,
    build_feature_map,
    feature_map_params,
)

B, T, H, D = 2, 7, 3, 16
ALL = sorted(FEATURE_MAPS)
LEARNABLE = ["hedgehog", "t2r", "taylor"]

EXPECTED_F = {  # default feature dim for head_dim D
    "elu": D,
    "relu": D,
    "hedgehog": 2 * (D // 2),
    "t2r": D,
    "performer": D,
    "taylor": 1 + 16 + 16 * 16,
}


def _x(dtype=torch.float32, seed=0, scale=1.0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, T, H, D, generator=g) * scale).to(dtype)
    return x.requires_grad_(requires_grad)


def test_registry_contents():
    assert set(FEATURE_MAPS) == {"elu", "relu", "hedgehog", "t2r", "performer", "taylor"}
    for name, cls in FEATURE_MAPS.items():
        assert cls.name == name
        assert issubclass(cls, FeatureMap)
        assert cls.__doc__ and "arXiv" in cls.__doc__, f"{name} docstring must cite its source"
        assert cls.learnable == (name in LEARNABLE)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shape_dtype_positive(name, dtype):
    torch.manual_seed(0)
    fm = build_feature_map(name, H, D)
    assert fm.feature_dim == EXPECTED_F[name]
    x = _x(dtype)
    y = fm(x)
    assert y.shape == (B, T, H, fm.feature_dim)
    assert y.dtype == dtype
    assert torch.isfinite(y).all()
    if name == "taylor":
        # features may be negative; inner products 1 + t + t^2/2 >= 1/2 are not
        yf = y.float()
        ip = torch.einsum("bihf,bjhf->bhij", yf, yf)
        assert (ip > 0.49).all()
    else:
        assert (y >= 0).all()


@pytest.mark.parametrize("name", ["elu", "relu", "t2r", "performer", "hedgehog"])
def test_rows_never_all_zero(name):
    """Strongly negative inputs must not produce a zero row (zero normaliser)."""
    torch.manual_seed(0)
    fm = build_feature_map(name, H, D)
    y = fm(-10.0 - _x().abs())
    assert (y.sum(-1) > 0).all()


def test_relu_eps_zero_is_plain_relu():
    fm = build_feature_map("relu", H, D, eps=0.0)
    x = _x()
    assert torch.equal(fm(x), torch.relu(x))


def test_elu_formula():
    x = _x()
    assert torch.allclose(build_feature_map("elu", H, D)(x), torch.nn.functional.elu(x) + 1)


def test_half_input_computed_in_fp32():
    """bf16 output equals the fp32 computation rounded once (not bf16 arithmetic throughout)."""
    torch.manual_seed(0)
    fm = build_feature_map("hedgehog", H, D)
    x = _x(torch.bfloat16, scale=3.0)
    ref = fm(x.float()).to(torch.bfloat16)
    assert torch.equal(fm(x), ref)


@pytest.mark.parametrize("name", ALL)
def test_gradients(name):
    torch.manual_seed(0)
    fm = build_feature_map(name, H, D)
    x = _x(requires_grad=True)
    y = fm(x)
    (y * torch.randn_like(y)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    params = list(fm.parameters())
    if fm.learnable:
        assert params, f"{name} is learnable but has no parameters"
        for p in params:
            assert p.requires_grad
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: no gradient reached a parameter"
    else:
        assert not params, f"{name} is fixed but has trainable parameters"


@pytest.mark.parametrize("name", ALL)
def test_state_dict_round_trip(name):
    torch.manual_seed(1)
    a = build_feature_map(name, H, D)
    with torch.no_grad():  # perturb learnable weights so the copy is not the init by accident
        for p in a.parameters():
            p.add_(0.1 * torch.randn_like(p))
    torch.manual_seed(2)
    b = build_feature_map(name, H, D, **({"seed": 5} if name == "performer" else {}))
    sd = a.state_dict()
    if name == "performer":
        assert "projection" in sd  # fixed random features are saved
    b.load_state_dict(sd)
    x = _x()
    assert torch.equal(a(x), b(x))


def test_performer_seed_deterministic():
    a = build_feature_map("performer", H, D, seed=3)
    b = build_feature_map("performer", H, D, seed=3)
    c = build_feature_map("performer", H, D, seed=4)
    assert torch.equal(a.projection, b.projection)
    assert not torch.equal(a.projection, c.projection)
    assert a.projection.shape == (D, D)  # one [D, m] draw shared by all heads


def test_performer_orthogonal_blocks():
    fm = build_feature_map("performer", 1, D, feature_dim=D)
    w = fm.projection.T.double()  # [m, D] rows
    gram = w @ w.T
    off = gram - torch.diag(torch.diagonal(gram))
    assert off.abs().max() < 1e-4


@pytest.mark.parametrize("scale", [None, 0.125], ids=["1/sqrt(D)", "model-scale"])
def test_performer_approximates_softmax_kernel_better_with_more_features(scale):
    """Mean relative error of phi(q).phi(k) vs exp(s q.k) shrinks as F grows (~1/sqrt(F)); s is the model's
    softmax scale (Granite's attention_multiplier, say), 1/sqrt(D) by default."""
    d = 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 64, 1, d, generator=g) * 0.7
    k = torch.randn(1, 64, 1, d, generator=g) * 0.7
    s = d**-0.5 if scale is None else scale
    exact = torch.exp(torch.einsum("bihd,bjhd->bij", q, k) * s)

    def err(m: int) -> float:
        errs = []
        for seed in range(4):
            fm = build_feature_map("performer", 1, d, feature_dim=m, seed=seed, eps=0.0, softmax_scale=scale)
            approx = torch.einsum("bihf,bjhf->bij", fm(q), fm(k))
            errs.append(((approx - exact).abs() / exact).mean().item())
        return sum(errs) / len(errs)

    e_small, e_mid, e_big = err(8), err(64), err(1024)
    assert e_big < e_mid < e_small
    assert e_big < 0.35 * e_small  # 1/sqrt(F) would give 1/11
    assert e_big < 0.2


@pytest.mark.parametrize("name", ALL)
def test_query_and_key_maps_agree_under_gqa(name):
    """Maps built separately for 6 query heads and 2 key heads start identical head for head,
    so phi_q(q) . phi_k(k) is the intended kernel from step 0 (GQA: q head h uses kv head h // 3)."""
    torch.manual_seed(0)
    fq = build_feature_map(name, 6, D, **({"feature_dim": 24} if name in ("t2r", "hedgehog") else {}))
    torch.manual_seed(1)  # a different global RNG state must not matter
    fk = build_feature_map(name, 2, D, **({"feature_dim": 24} if name in ("t2r", "hedgehog") else {}))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4, 1, D, generator=g)
    yq = fq(x.expand(1, 4, 6, D).contiguous())
    yk = fk(x.expand(1, 4, 2, D).contiguous())
    for h in range(6):
        assert torch.equal(yq[:, :, h], yk[:, :, h // 3])


def test_seed_changes_random_init():
    a = build_feature_map("taylor", H, D, seed=0)
    b = build_feature_map("taylor", H, D, seed=1)
    assert not torch.equal(a.weight, b.weight)
    assert torch.equal(a.weight, build_feature_map("taylor", H, D, seed=0).weight)
    t = build_feature_map("t2r", H, D, feature_dim=D + 4, seed=2)
    assert not torch.equal(t.weight[..., D:], build_feature_map("t2r", H, D, feature_dim=D + 4, seed=3).weight[..., D:])


@pytest.mark.parametrize("scale", [None, 0.05], ids=["1/sqrt(D)", "model-scale"])
def test_taylor_init_approximates_model_kernel(scale):
    """JL init: t = y_q . y_k / sqrt(p) is an unbiased estimate of s q . k (averaged over seeds), s the model's
    softmax scale (1/sqrt(D) by default)."""
    d, p = 16, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 1, d, generator=g)
    k = torch.randn(1, 32, 1, d, generator=g)
    s = torch.einsum("bihd,bjhd->bij", q, k) * (d**-0.5 if scale is None else scale)
    ts = []
    for seed in range(64):
        W = build_feature_map("taylor", 1, d, feature_dim=p, seed=seed, softmax_scale=scale).weight[0]
        ts.append(torch.einsum("bihp,bjhp->bij", q @ W, k @ W) / math.sqrt(p))
    t = torch.stack(ts).mean(0)
    assert (t - s).abs().mean() < 0.25 * s.abs().mean()


def test_hedgehog_identity_init():
    fm = build_feature_map("hedgehog", H, D)  # f = D // 2
    f = D // 2
    assert fm.weight.shape == (H, D, f)
    eye = torch.eye(D)[:, :f]
    for h in range(H):
        assert torch.equal(fm.weight[h], eye)
    # initially: softmax over the first f coordinates of x and of -x
    x = _x()
    y = fm(x)
    xf = x[..., :f]
    expect = torch.cat([torch.softmax(xf, -1), torch.softmax(-xf, -1)], -1)
    assert torch.allclose(y, expect, atol=1e-6)
    # each half is a probability distribution
    assert torch.allclose(y[..., :f].sum(-1), torch.ones(B, T, H), atol=1e-5)


def test_hedgehog_feature_dim_param():
    fm = build_feature_map("hedgehog", H, D, feature_dim=24)  # f > D: extra columns zero
    assert fm.feature_dim == 48
    assert fm(_x()).shape == (B, T, H, 48)
    assert torch.equal(fm.weight[:, :, D:], torch.zeros(H, D, 24 - D))


def test_t2r_init_equals_relu():
    fm = build_feature_map("t2r", H, D, eps=0.0)
    x = _x()
    assert torch.allclose(fm(x), torch.relu(x), atol=1e-6)
    assert build_feature_map("t2r", H, D, feature_dim=40).feature_dim == 40


def test_taylor_inner_product_is_second_order_exp():
    p = 4
    torch.manual_seed(0)
    fm = build_feature_map("taylor", H, D, feature_dim=p)
    assert fm.feature_dim == 1 + p + p * p
    q, k = _x(seed=1), _x(seed=2)
    phq, phk = fm(q), fm(k)
    W = fm.weight  # [H, D, p]
    yq = torch.einsum("bthd,hdp->bthp", q, W)
    yk = torch.einsum("bthd,hdp->bthp", k, W)
    t = torch.einsum("bihp,bjhp->bhij", yq, yk) / math.sqrt(p)
    ip = torch.einsum("bihf,bjhf->bhij", phq, phk)
    assert torch.allclose(ip, 1 + t + t * t / 2, rtol=1e-4, atol=1e-4)


def test_unknown_name():
    with pytest.raises(ValueError) as e:
        build_feature_map("softmax", H, D)
    msg = str(e.value)
    assert "softmax" in msg
    for n in ALL:
        assert n in msg


@pytest.mark.parametrize("name", ALL)
def test_unknown_param(name):
    with pytest.raises(ValueError) as e:
        build_feature_map(name, H, D, bogus_knob=3)
    assert "bogus_knob" in str(e.value) and name in str(e.value)


def test_bad_param_values_and_none_means_default():
    with pytest.raises(ValueError, match="feature_dim"):
        build_feature_map("hedgehog", H, D, feature_dim=0)
    with pytest.raises(ValueError, match="eps"):
        build_feature_map("relu", H, D, eps=-1.0)
    with pytest.raises(ValueError, match="seed"):
        build_feature_map("performer", H, D, seed="x")
    assert build_feature_map("hedgehog", H, D, feature_dim=None).feature_dim == D
    assert feature_map_params("performer") == {"feature_dim": None, "seed": 0, "eps": 1e-6}
    with pytest.raises(ValueError, match="seed"):
        build_feature_map("taylor", H, D, seed=1.5)


def test_wrong_input_shape():
    fm = build_feature_map("elu", H, D)
    with pytest.raises(ValueError, match="expects"):
        fm(torch.randn(B, T, H + 1, D))

"""Feature maps for linear attention.

Linear attention replaces ``exp(q.k / sqrt(D))`` by ``phi(q) . phi(k)`` for a
feature map ``phi``. Every map here is a small ``nn.Module`` with the same
interface:

* input ``x``: ``[B, T, H, D]``, post-rotary queries or keys of ``H`` heads;
* output: ``[B, T, H, F]`` in ``x``'s dtype, computed in fp32 internally when
  ``x`` is bf16/fp16;
* attributes ``feature_dim`` (``F``), ``learnable`` (trained in stage 1 or not)
  and the class attribute ``name`` (its key in :data:`FEATURE_MAPS`).

Outputs are non-negative (so the linear-attention normaliser is positive),
except ``taylor`` whose features can be negative but whose inner products
``phi(q) . phi(k) = 1 + t + t^2/2 >= 1/2`` are always positive.

Queries and keys may get separate map instances (as in LoLCATs), possibly with
different head counts under GQA (query head ``h`` attends with key head
``h // (H / Hk)``). So that ``phi_q(q) . phi_k(k)`` is right from the start,
every map's initial (or fixed random) weights are the same for every head and
depend only on ``head_dim``, the parameters and ``seed``: two instances built
with the same arguments agree head for head whatever their head counts.
Build one with :func:`build_feature_map`; recipe fields become keyword
parameters.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from linearize.kernels.reference import hedgehog_features

__all__ = [
    "FeatureMap",
    "EluFeatureMap",
    "ReluFeatureMap",
    "HedgehogFeatureMap",
    "T2RFeatureMap",
    "PerformerFeatureMap",
    "TaylorFeatureMap",
    "FEATURE_MAPS",
    "build_feature_map",
    "feature_map_params",
]


def _to_compute(x: torch.Tensor) -> torch.Tensor:
    """Upcast half-precision inputs to fp32; leave fp32/fp64 alone."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _check_positive_int(map_name: str, param: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"feature map {map_name!r}: {param}={value!r} is invalid; expected a positive integer"
        )
    return value


def _check_int(map_name: str, param: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"feature map {map_name!r}: {param}={value!r} is invalid; expected an integer")
    return value


def _check_non_negative_float(map_name: str, param: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value >= 0
    ):
        raise ValueError(
            f"feature map {map_name!r}: {param}={value!r} is invalid; expected a finite number >= 0"
        )
    return float(value)


class FeatureMap(nn.Module):
    """Base class: ``[B, T, H, D] -> [B, T, H, F]``.

    Subclasses implement :meth:`_features` on a compute-precision tensor; the
    base :meth:`forward` upcasts half inputs to fp32 and casts the result back.
    """

    name: str = ""
    learnable: bool = False

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = _check_positive_int(self.name, "num_heads", num_heads)
        self.head_dim = _check_positive_int(self.name, "head_dim", head_dim)
        self.feature_dim: int = head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, H, D]
        if x.dim() != 4 or x.shape[-2] != self.num_heads or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"feature map {self.name!r} expects [B, T, H={self.num_heads}, D={self.head_dim}], "
                f"got shape {tuple(x.shape)}"
            )
        out = self._features(_to_compute(x))  # [B, T, H, F], fp32 (or fp64)
        return out.to(x.dtype)

    def _features(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _weight(self, w: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A parameter/buffer in the compute dtype of ``like`` (fp32 when the module is bf16)."""
        return w.to(like.dtype)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, feature_dim={self.feature_dim}"


class EluFeatureMap(FeatureMap):
    """``phi(x) = elu(x) + 1``, F = D; fixed.

    Katharopoulos et al., "Transformers are RNNs" (ICML 2020, arXiv 2006.16236),
    https://github.com/idiap/fast-transformers. Strictly positive.
    """

    name = "elu"
    learnable = False

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, head_dim)
        self.feature_dim = head_dim

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        return F.elu(x) + 1.0  # [B, T, H, D]


class ReluFeatureMap(FeatureMap):
    """``phi(x) = relu(x) + eps``, F = D; fixed.

    As used as a baseline in e.g. Qin et al., "The Devil in Linear Transformer"
    (arXiv 2210.10340) and the fla ``ReLUFeatureMap``. ``relu(q)`` is all zero
    whenever every coordinate of ``q`` is negative, which makes the
    linear-attention normaliser zero; the small ``eps`` (default ``1e-6``)
    keeps every feature strictly positive. ``eps=0`` gives the plain relu map.
    """

    name = "relu"
    learnable = False

    def __init__(self, num_heads: int, head_dim: int, eps: float = 1e-6) -> None:
        super().__init__(num_heads, head_dim)
        self.eps = _check_non_negative_float(self.name, "eps", eps)
        self.feature_dim = head_dim

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x) + self.eps  # [B, T, H, D]


class HedgehogFeatureMap(FeatureMap):
    """Hedgehog / LoLCATs map: ``phi(x) = [softmax(x W), softmax(-x W)]`` over the feature dim.

    Per head, ``W`` is ``[D, f]`` with no bias (``f = feature_dim``, default
    ``D // 2``), so F = 2f. ``W`` starts as the first ``f`` columns of the
    identity (columns beyond ``D`` are zero), so initially the map is a softmax
    over the (first f) coordinates of ``x`` and of ``-x``. Outputs are clamped
    to ``>= eps`` (default ``1e-12``, the LoLCATs value). Learnable.

    Zhang et al., "The Hedgehog & the Porcupine" (ICLR 2024, arXiv 2402.04347);
    Zhang et al., "LoLCATs" (arXiv 2410.10254), https://github.com/HazyResearch/lolcats
    (``FeatureMapMLP`` + ``SoftmaxDim``, "softmax_dim" full-space variant).
    """

    name = "hedgehog"
    learnable = True

    def __init__(
        self, num_heads: int, head_dim: int, feature_dim: int | None = None, eps: float = 1e-12
    ) -> None:
        super().__init__(num_heads, head_dim)
        f = max(head_dim // 2, 1) if feature_dim is None else feature_dim
        f = _check_positive_int(self.name, "feature_dim", f)
        self.eps = _check_non_negative_float(self.name, "eps", eps)
        self.proj_dim = f
        self.feature_dim = 2 * f
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim, f))  # [H, D, f]
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Identity-like init: ``W[h] = I[:, :f]`` (zero columns past D)."""
        self.weight.zero_()
        n = min(self.head_dim, self.proj_dim)
        idx = torch.arange(n)
        self.weight[:, idx, idx] = 1.0

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        return hedgehog_features(x, self._weight(self.weight, x), self.eps)  # [B, T, H, 2f]


class T2RFeatureMap(FeatureMap):
    """T2R map: ``phi(x) = relu(x W + b)``, per-head ``W: [D, f]``, ``b: [f]``; F = f (default D).

    Kasai et al., "Finetuning Pretrained Transformers into RNNs" (EMNLP 2021,
    arXiv 2103.13076), https://github.com/jungokasai/T2R. The paper uses a
    randomly initialised MLP; here ``W`` starts as the identity (first ``f``
    columns; columns past ``D`` are uniform(+-1/sqrt(D)) random from ``seed``,
    default 0, the same for every head) and ``b = 0`` so the untrained map
    equals ``relu``.
    Outputs get ``+ eps`` (default ``1e-6``) so a row is never all zero.
    Learnable.
    """

    name = "t2r"
    learnable = True

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        feature_dim: int | None = None,
        eps: float = 1e-6,
        seed: int = 0,
    ) -> None:
        super().__init__(num_heads, head_dim)
        f = head_dim if feature_dim is None else feature_dim
        f = _check_positive_int(self.name, "feature_dim", f)
        self.eps = _check_non_negative_float(self.name, "eps", eps)
        self.seed = _check_int(self.name, "seed", seed)
        self.feature_dim = f
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim, f))  # [H, D, f]
        self.bias = nn.Parameter(torch.empty(num_heads, f))  # [H, f]
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``W[h] = I[:, :f]`` (seeded random columns past D, same for every head), ``b = 0``."""
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        bound = 1.0 / math.sqrt(self.head_dim)
        w = (torch.rand(self.head_dim, self.feature_dim, generator=gen, device="cpu") * 2 - 1) * bound  # [D, f]
        n = min(self.head_dim, self.feature_dim)
        w[:, :n] = torch.eye(self.head_dim, device="cpu")[:, :n]
        self.weight.copy_(w.expand_as(self.weight))
        self.bias.zero_()

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        u = torch.einsum("bthd,hdf->bthf", x, self._weight(self.weight, x))  # [B, T, H, f]
        u = u + self._weight(self.bias, x)  # bias [H, f] broadcasts over B, T
        return F.relu(u) + self.eps  # [B, T, H, f]


def _orthogonal_gaussian(rows: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """``[rows, dim]``: blocks of orthogonal rows, each row rescaled to a chi(dim) norm.

    Choromanski et al. (Performer), "orthogonal random features" with the
    ``scaling=0`` convention: marginally every row is N(0, I), rows within a
    block are exactly orthogonal.
    """
    blocks = []
    for _ in range(math.ceil(rows / dim)):
        g = torch.randn(dim, dim, generator=gen, dtype=torch.float64, device="cpu")
        q, r = torch.linalg.qr(g)
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)  # unique (Haar) orthogonal
        blocks.append(q.T)  # rows orthonormal
    w = torch.cat(blocks, dim=0)[:rows]  # [rows, dim]
    norms = torch.randn(rows, dim, generator=gen, dtype=torch.float64, device="cpu").norm(dim=-1)  # chi(dim)
    return (w * norms.unsqueeze(-1)).float()


class PerformerFeatureMap(FeatureMap):
    """Performer FAVOR+ positive orthogonal random features; fixed.

    With ``x' = x * s^(1/2)`` (``s``: the model's softmax scale, ``softmax_scale``, by default
    ``D^(-1/2)``) and random rows ``w_1..w_m ~ N(0, I_D)`` (orthogonal
    within blocks of D), ``phi(x) = (exp(w_i . x' - |x'|^2 / 2) + eps) / sqrt(m)``,
    so ``E[phi(q) . phi(k)] = exp(q' . k') = exp(s q . k)`` (up to ``eps``,
    default ``1e-6``, which keeps rows from underflowing to zero; the exponent is
    clamped at 80 so very large heads cannot overflow fp32). F = m =
    ``feature_dim`` (default D). The projection is one buffer ``[D, m]`` shared
    by all heads (as in the Performer code; it also makes the query and key
    maps agree under GQA), generated from ``seed`` (default 0): it is not
    trained but is saved in the state dict, so a checkpoint reproduces it.

    Choromanski et al., "Rethinking Attention with Performers" (ICLR 2021,
    arXiv 2009.14794), https://github.com/google-research/google-research/tree/master/performer
    """

    name = "performer"
    learnable = False

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        feature_dim: int | None = None,
        seed: int = 0,
        eps: float = 1e-6,
        softmax_scale: float | None = None,
    ) -> None:
        super().__init__(num_heads, head_dim)
        m = head_dim if feature_dim is None else feature_dim
        self.feature_dim = _check_positive_int(self.name, "feature_dim", m)
        self.seed = _check_int(self.name, "seed", seed)
        self.eps = _check_non_negative_float(self.name, "eps", eps)
        self.softmax_scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        proj = _orthogonal_gaussian(self.feature_dim, head_dim, gen).T.contiguous()  # [D, m]
        self.register_buffer("projection", proj, persistent=True)

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        xs = x * self.softmax_scale**0.5  # [B, T, H, D]
        u = xs @ self._weight(self.projection, x)  # [B, T, H, D] @ [D, m] -> [B, T, H, m]
        sq = 0.5 * (xs * xs).sum(-1, keepdim=True)  # [B, T, H, 1]
        # u - |x'|^2/2 <= |w||x'| - |x'|^2/2 <= |w|^2/2 ~ D/2: finite in fp32 for D up to ~160;
        # the clamp only guards larger heads against inf (fp32 exp overflows past ~88.7)
        logits = (u - sq).clamp(max=80.0)
        return (torch.exp(logits) + self.eps) * self.feature_dim ** -0.5  # [B, T, H, m]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", seed={self.seed}"


class TaylorFeatureMap(FeatureMap):
    """Based's 2nd-order Taylor map on a learned per-head projection.

    ``y = x P`` with ``P: [D, p]`` per head (``p = feature_dim``, default 16), then
    ``phi(x) = [1, y / p^(1/4), vec(y y^T) / (sqrt(2) sqrt(p))]``, F = 1 + p + p^2,
    so ``phi(q) . phi(k) = 1 + t + t^2 / 2`` with ``t = y_q . y_k / sqrt(p)``: the
    2nd-order Taylor expansion of ``exp(t)``.

    The features themselves are NOT non-negative, but every inner product is:
    ``1 + t + t^2/2 = ((1 + t)^2 + 1) / 2 >= 1/2``, so the linear-attention
    normaliser is always positive (>= n/2 over n keys).

    ``P`` is learnable and starts as a Johnson-Lindenstrauss random projection
    (entries ``N(0, (pD)^(-1/2))``, drawn from ``seed``, default 0, the same
    matrix for every head) so that initially ``E[t] = q . k / sqrt(D)``, i.e.
    the map approximates the model's own ``exp(q . k / sqrt(D))`` to 2nd order
    in expectation.

    Arora et al., "Simple linear attention language models balance the
    recall-throughput tradeoff" (Based, ICML 2024, arXiv 2402.18668),
    https://github.com/HazyResearch/based (``TaylorExp``). In Based the
    projection to p = 16 is the q/k projection itself; here it is an extra
    per-head map so the pretrained q/k stay intact.
    """

    name = "taylor"
    learnable = True

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int = 16, seed: int = 0,
                 softmax_scale: float | None = None) -> None:
        super().__init__(num_heads, head_dim)
        p = _check_positive_int(self.name, "feature_dim", feature_dim)
        self.seed = _check_int(self.name, "seed", seed)
        self.softmax_scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
        self.proj_dim = p
        self.feature_dim = 1 + p + p * p
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim, p))  # [H, D, p]
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """JL init: ``P ~ N(0, s / sqrt(p))`` (seeded, shared by all heads; ``s`` the softmax scale, by default
        ``D^(-1/2)``), so ``E[t] = s q . k``."""
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        w = torch.randn(self.head_dim, self.proj_dim, generator=gen, device="cpu")  # [D, p]
        self.weight.copy_((w * self.softmax_scale**0.5 * self.proj_dim**-0.25).expand_as(self.weight))

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        p = self.proj_dim
        y = torch.einsum("bthd,hdp->bthp", x, self._weight(self.weight, x))  # [B, T, H, p]
        y2 = (y.unsqueeze(-1) * y.unsqueeze(-2)).flatten(-2)  # [B, T, H, p*p]
        one = torch.ones_like(y[..., :1])  # [B, T, H, 1]
        return torch.cat([one, y * p ** -0.25, y2 * (2.0 * p) ** -0.5], dim=-1)  # [B, T, H, 1+p+p^2]


FEATURE_MAPS: dict[str, type[FeatureMap]] = {
    cls.name: cls
    for cls in (
        EluFeatureMap,
        ReluFeatureMap,
        HedgehogFeatureMap,
        T2RFeatureMap,
        PerformerFeatureMap,
        TaylorFeatureMap,
    )
}
"""Registry: map name -> class. Keys: elu, relu, hedgehog, t2r, performer, taylor."""


def _lookup(name: str) -> type[FeatureMap]:
    try:
        return FEATURE_MAPS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown feature map {name!r}; allowed: {', '.join(sorted(FEATURE_MAPS))}"
        ) from None


def feature_map_params(name: str) -> dict[str, Any]:
    """The tunable parameters of map ``name`` and their defaults (``None`` = derived from D).

    >>> feature_map_params("hedgehog")
    {'feature_dim': None, 'eps': 1e-12}
    """
    sig = inspect.signature(_lookup(name).__init__)
    return {
        k: p.default
        for k, p in sig.parameters.items()
        if k not in ("self", "num_heads", "head_dim", "softmax_scale")  # softmax_scale comes from the model
    }


def build_feature_map(name: str, num_heads: int, head_dim: int, *, softmax_scale: float | None = None,
                      **params: Any) -> FeatureMap:
    """Build feature map ``name`` for ``num_heads`` heads of size ``head_dim``.

    ``softmax_scale``: the scale of the attention being replaced (default ``head_dim ** -0.5``), for the maps
    that approximate ``exp(scale q . k)`` from the start (performer, taylor).

    ``params`` are the recipe's feature-map fields (e.g. ``feature_dim``, ``eps``,
    ``seed``); a value of ``None`` means "use the default". Unknown names and
    unknown or invalid parameters raise ``ValueError`` naming what is allowed.
    """
    cls = _lookup(name)
    allowed = feature_map_params(name)
    for key in params:
        if key not in allowed:
            hint = ", ".join(allowed) if allowed else "none"
            raise ValueError(
                f"feature map {name!r} has no parameter {key!r}; allowed parameters: {hint}"
            )
    kwargs = {k: v for k, v in params.items() if v is not None}
    if softmax_scale is not None and "softmax_scale" in inspect.signature(cls.__init__).parameters:
        kwargs["softmax_scale"] = softmax_scale
    return cls(num_heads, head_dim, **kwargs)

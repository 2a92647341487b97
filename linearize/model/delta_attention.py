"""The gated delta rule layer (Gated DeltaNet, arXiv 2412.06464) that replaces a softmax attention layer.

Per key/value head the layer keeps a state ``S`` ``[K, V]`` and, for each token,

    S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        o_t = S_t^T (s_h q_t)

(:func:`linearize.kernels.delta.gated_delta_rule`; query head ``h`` reads the state of its KV head, so GQA keeps
one state per KV head as the original keeps one cache). What it is built from:

- ``q``, ``k``, ``v`` and ``o_proj``: the original module's projections, adopted under their own names (no copy),
  with the family's q/k norms and **its rotary embedding**, exactly as the original computes them
  (:meth:`LinearAttention.project <linearize.model.attention.LinearAttention.project>`). Gated DeltaNet as
  trained from scratch has no rotary and short causal convolutions instead; a model converted from a rotary one
  keeps its rotary: a rotation keeps each vector's norm, so ``L2(R_t q) . L2(R_s k)`` is the original's cosine
  between query and key at relative position ``t - s``, the pretrained geometry the delta rule's reads and writes
  start from, with no new parameters and no convolution state in the cache. One projection serves the student and
  the softmax teacher.
- optionally a learned linear map per head on the post-rotary ``q`` and ``k`` (``attention.delta_qk_map``;
  identity at first): the delta layer's feature map, trained in stage 1 as Hedgehog's maps are in the linear
  layers (and, like them, applied after the rotary), while the adopted projections, which also compute the
  teacher, stay the original's.
- ``q`` and ``k`` L2-normalised per head (the kernel's contract: the delta rule's ``I - beta k k^T`` is a
  contraction only for unit keys); ``q`` then scaled by ``q_scale`` ``[H]`` (the kernel runs with scale 1).
- ``beta = sigmoid(x W_beta^T + b_beta)`` ``[B, T, Hk]`` (:class:`BetaGate`): how much of the slot a token's key
  addresses it rewrites.
- ``log a = -softplus(x W^T + b)`` ``[B, T, Hk]``: the linear layers' :class:`~linearize.model.attention.DecayGate`
  (``attention.decay: learned``; ``none`` runs the plain delta rule).
- optionally ``o <- 2 sigmoid(x W_g^T) * o`` per channel (:class:`OutputGate`, ``attention.delta_output_gate``).

New parameters and their initial values (``x`` is the layer input, after the decoder layer's norm):

================  =================  ===========================================================================
parameter         shape              initial value and why
================  =================  ===========================================================================
``beta.weight``   ``[Hk, hidden]``   0: every token writes with the same strength at first; stage 1 learns which
                                     tokens matter (its gradient is not 0: it is the data-dependent one)
``beta.bias``     ``[Hk]``           ``logit(delta_beta_init)``: the recipe's write strength
``decay.weight``  ``[Hk, hidden]``   0 (DecayGate)
``decay.bias``    ``[Hk]``           the recipe's ``decay_half_life`` (DecayGate): close to no forgetting
``q_scale``       ``[H]``            ``delta_q_scale``: the read-out's temperature; with unit keys and queries a
                                     query equal to a stored key reads ``q_scale`` times its value
``q_map``         ``[H, D, D]``      the identity (``delta_qk_map``): the untrained layer reads the original's
``k_map``         ``[Hk, D, D]``     cosines between queries and keys
``gate.weight``   ``[H*D, hidden]``  0, so ``2 sigmoid(0) = 1``: the untrained gate passes the output unchanged
================  =================  ===========================================================================

All of them are kept in fp32 and are what stage 1 trains (:meth:`GatedDeltaAttention.learned_parameters`); the
adopted projections stay the original's in stage 1 (they also compute the teacher) and get LoRA adapters in
stage 2. Modes as for the linear layers: ``linear``, ``softmax`` (the original attention), ``distill`` (both;
``distill_pair`` holds the per-head outputs before ``o_proj``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.delta import gated_delta_rule, gated_delta_rule_step
from .architectures import ArchSpec
from .attention import DECAY_KINDS, DecayGate, LinearAttention, RealTokens, adopt_original
from .cache import HybridCache

#: clamp of the q / k norms in the L2 normalisation (an all-zero row stays zero instead of dividing by zero)
L2_EPS = 1e-6


class BetaGate(nn.Module):
    """The delta rule's write strength ``beta = sigmoid(x W^T + b)`` ``[B, T, Hk]`` fp32 in (0, 1), per token and
    key/value head, from the layer input ``x`` ``[B, T, hidden]``. ``W`` starts at 0, ``b`` at ``logit(init)``."""

    def __init__(self, hidden_size: int, kv_heads: int, init: float):
        super().__init__()
        if not 0.0 < init < 1.0:
            raise ValueError(f"attention.delta_beta_init must be in (0, 1), got {init}")
        self.weight = nn.Parameter(torch.zeros(kv_heads, hidden_size, dtype=torch.float32))  # [Hk, hidden]
        self.bias = nn.Parameter(torch.full((kv_heads,), math.log(init / (1.0 - init)), dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x.float(), self.weight.float(), self.bias.float()))  # [B, T, Hk]


class OutputGate(nn.Module):
    """``2 sigmoid(x W^T)`` ``[B, T, width]`` fp32 in (0, 2), one factor per output channel; ``W = 0`` (exactly 1)
    at first, so the gate can both damp and amplify what the delta rule reads."""

    def __init__(self, hidden_size: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width, hidden_size, dtype=torch.float32))  # [H*D, hidden]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * torch.sigmoid(F.linear(x.float(), self.weight.float()))


class GatedDeltaAttention(nn.Module):
    """A gated delta rule layer built from an original softmax attention module.

    Args:
        original: the softmax attention module being replaced (its projections are adopted).
        config: the base model config (heads, head_dim).
        layer_idx: index of the decoder layer.
        settings: the recipe's ``attention`` section (``delta_beta_init``, ``delta_q_scale``, ``delta_qk_map``,
            ``delta_output_gate``, ``decay``, ``decay_half_life``).
        arch: where the family keeps its projections and norms.
        kernel_options: :data:`~linearize.model.attention.KERNEL_OPTIONS` that differ from the defaults (only
            ``rotary_backend`` applies here).
        masks: the model's :class:`~linearize.model.attention.RealTokens`, shared by its converted layers.
    """

    # The projections (the family's norms, bounds, rotary) and the softmax teacher are the linear layer's own code
    # run on the same attributes (set in __init__): one definition of what the original attention computes.
    project = LinearAttention.project
    _head_norms = LinearAttention._head_norms
    softmax_attention = LinearAttention.softmax_attention
    teacher_sees = LinearAttention.teacher_sees
    teacher_logits = LinearAttention.teacher_logits
    set_kernel_options = LinearAttention.set_kernel_options

    def __init__(self, original: nn.Module, config, layer_idx: int, settings: dict, arch: ArchSpec, *,
                 kernel_options: dict | None = None, masks: RealTokens | None = None):
        super().__init__()
        adopt_original(self, original, config, layer_idx, arch)  # what the original computes (the teacher)
        # the new parameters (see the module docstring for their initial values)
        device = getattr(self, arch.projections[0]).weight.device
        self.beta = BetaGate(config.hidden_size, self.num_kv_heads, float(settings.get("delta_beta_init", 0.5)))
        decay = settings.get("decay", "none") or "none"
        if decay not in DECAY_KINDS:
            raise ValueError(f"attention.decay must be one of {', '.join(DECAY_KINDS)}, got {decay!r}")
        self.decay = (DecayGate(config.hidden_size, self.num_kv_heads, float(settings.get("decay_half_life", 16384)))
                      if decay == "learned" else None)
        q_scale = float(settings.get("delta_q_scale", 1.0))
        if not q_scale > 0:
            raise ValueError(f"attention.delta_q_scale must be > 0, got {q_scale}")
        self.q_scale = nn.Parameter(torch.full((self.num_heads,), q_scale, dtype=torch.float32))  # [H]
        if settings.get("delta_qk_map", False):
            eye = torch.eye(self.head_dim, dtype=torch.float32)
            self.q_map = nn.Parameter(eye.repeat(self.num_heads, 1, 1))  # [H, D, D]
            self.k_map = nn.Parameter(eye.repeat(self.num_kv_heads, 1, 1))  # [Hk, D, D]
        else:
            self.register_parameter("q_map", None)
            self.register_parameter("k_map", None)
        self.gate = (OutputGate(config.hidden_size, self.num_heads * self.head_dim)
                     if settings.get("delta_output_gate", False) else None)
        self.to(device=device)
        self.set_kernel_options(**(kernel_options or {}))
        self.real_tokens = masks if masks is not None else RealTokens()
        self.mode = "linear"
        self.distill_pair: tuple[torch.Tensor, torch.Tensor] | None = None
        self.xent_rows = 0  # the Hedgehog attention-weight loss has no meaning here (the recipe refuses it)
        self.distill_xent: torch.Tensor | None = None

    def learned_parameters(self) -> list[nn.Parameter]:
        """What stage 1 trains in this layer: the write strength, the decay gate, the read-out scale, the q / k maps,
        the gate."""
        params = list(self.beta.parameters()) + [self.q_scale]
        if self.q_map is not None:
            params += [self.q_map, self.k_map]
        if self.decay is not None:
            params += list(self.decay.parameters())
        if self.gate is not None:
            params += list(self.gate.parameters())
        return params

    def delta_inputs(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, real: torch.Tensor | None = None):
        """The kernel's inputs from the layer input ``x`` ``[B, T, hidden]`` and the post-rotary ``q`` ``[B, T, H,
        D]``, ``k`` ``[B, T, Hk, D]``: ``(q, k, beta, log_decay)``, ``q`` and ``k`` mapped (with ``delta_qk_map``)
        and L2-normalised per head (``q`` times ``q_scale``) in ``q``'s dtype, ``beta`` and ``log_decay``
        ``[B, T, Hk]`` fp32 (``log_decay`` None without a decay gate). ``real`` ``[B, T]`` bool marks the tokens that are not padding: a padding token gets
        ``beta = 0`` and ``log_decay = 0``, so the state passes it unchanged."""
        qf, kf = q.float(), k.float()
        if self.q_map is not None:
            qf = torch.einsum("bthd,hde->bthe", qf, self.q_map.float())  # [B, T, H, D]
            kf = torch.einsum("bthd,hde->bthe", kf, self.k_map.float())  # [B, T, Hk, D]
        qn = F.normalize(qf, dim=-1, eps=L2_EPS) * self.q_scale.float()[:, None]  # [B, T, H, D]
        kn = F.normalize(kf, dim=-1, eps=L2_EPS)  # [B, T, Hk, D]
        beta = self.beta(x)
        log_decay = self.decay(x) if self.decay is not None else None
        if real is not None:
            beta = beta * real.unsqueeze(-1)
            log_decay = None if log_decay is None else log_decay * real.unsqueeze(-1)
        return qn.to(q.dtype), kn.to(k.dtype), beta, log_decay

    def delta_attention(self, x, q, k, v, layer_cache=None, real: torch.Tensor | None = None) -> torch.Tensor:
        """The converted attention ``[B, T, H, D]`` over the post-rotary ``q``, ``k``, ``v``, continuing
        ``layer_cache`` (a :class:`~linearize.model.cache.DeltaStateLayer`) if given: one token with a state is a
        decode step (the state updated in place), anything else the chunked kernel from the state it holds."""
        B, T = q.shape[:2]
        qn, kn, beta, log_decay = self.delta_inputs(x, q, k, real)
        if layer_cache is not None and layer_cache.record_past:  # crop() may take these tokens back
            layer_cache.record(kn, v, beta, log_decay)
        state = layer_cache.state if layer_cache is not None else None
        if state is not None and T == 1:
            o = gated_delta_rule_step(qn[:, 0], kn[:, 0], v[:, 0], beta[:, 0],
                                      None if log_decay is None else log_decay[:, 0], state, scale=1.0).unsqueeze(1)
            layer_cache.set_state(state, 1)
        else:
            o, final = gated_delta_rule(qn, kn, v, beta, log_decay, scale=1.0, initial_state=state,
                                        output_final_state=layer_cache is not None)
            if layer_cache is not None:
                layer_cache.set_state(final, T)
        if self.gate is not None:
            o = (o.float() * self.gate(x).view(B, T, self.num_heads, self.head_dim)).to(o.dtype)
        return o

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                cache=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        B, T, _ = hidden_states.shape
        q, k, v = self.project(hidden_states, position_embeddings)
        layer_cache = cache.linear_layer(self.layer_idx) if isinstance(cache, HybridCache) else None
        if self.mode == "softmax":
            if layer_cache is not None:
                raise RuntimeError("softmax (teacher) mode does not support a generation cache")
            o = self.softmax_attention(q, k, v)
        elif self.mode == "distill":
            teacher = self.softmax_attention(q, k, v)
            self.distill_pair = (self.delta_attention(hidden_states, q, k, v), teacher.detach())
            o = teacher
        else:
            o = self.delta_attention(hidden_states, q, k, v, layer_cache, real=self.real_tokens(attention_mask, T))
        o = o.reshape(B, T, self.num_heads * self.head_dim).to(hidden_states.dtype)
        return self.o_proj(o), None

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"decay={'learned' if self.decay is not None else 'none'}, qk_map={self.q_map is not None}, "
                f"output_gate={self.gate is not None}, mode={self.mode}")

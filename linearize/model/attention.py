"""Linear and window-hybrid attention layers that wrap an original softmax attention module.

The wrapper adopts the original module's projections (and Qwen3's q/k norms) under the same
attribute names, so a hybrid checkpoint keeps the base model's parameter names and only adds
``feature_map_q``, ``feature_map_k`` and ``window_logit``. Rotary embeddings arrive from the decoder
layer as ``position_embeddings`` exactly as for the original module.

Modes (``layer.mode``):
- ``"linear"``: the converted layer (default);
- ``"softmax"``: the original attention, computed from the same projections (the teacher);
- ``"distill"``: both; the teacher output flows on and ``layer.distill_pair`` keeps
  ``(linear_output, softmax_output)`` (per-head outputs before ``o_proj``) for attention transfer.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import (BACKENDS, hedgehog_feature_map, linear_attention, linear_attention_hedgehog,
                       linear_attention_step, linear_attention_step_hedgehog, rotary_embedding, window_linear_attention,
                       window_linear_attention_hedgehog, window_linear_attention_step,
                       window_linear_attention_step_hedgehog, window_state_from_prefill)
from ..kernels.sinks import first_tokens, gather_sinks, join_sinks, merge_sinks, sink_visibility
from .architectures import ArchSpec, attention_shape
from .cache import HybridCache, softmax_windows
from .feature_maps import HedgehogFeatureMap, build_feature_map
from .layout import layer_window
from .norms import NORM_BACKENDS

#: Where GPU inference of Hedgehog layers computes the features in Triton kernels instead of the PyTorch map (the
#: ``fused_feature_maps`` kernel option), in increasing order: ``none``; ``decode`` inside the decode-step kernels
#: (the hybrid Llama-3-8B-shaped step at 32K x 8 took 10.27 ms against 11.05 unfused, CUDA graphs, H200,
#: 2026-12-01); ``maps`` (the default) also for prefill, by a standalone feature-map kernel whose output the
#: attention kernels read (13x faster than the PyTorch map on [8, 32K, 32, 128]; the hybrid's 32K x 8 prefill 1.06x
#: faster than with ``decode``, H200, 2026-12-01); ``all`` inside the prefill forwards instead (slower on the H200:
#: kernels/README.md). Training always uses the PyTorch map.
FUSED_FEATURE_MAP_MODES = ("none", "decode", "maps", "all")
#: The kernel options of the converted layers and their defaults (fields of the hybrid's config, which passes them
#: to its layers): ``fused_feature_maps``, one of :data:`FUSED_FEATURE_MAP_MODES`; ``rotary_backend``, the backend
#: of the layers' rotary embedding (:func:`linearize.kernels.rotary_embedding`): None = one Triton kernel for
#: queries and keys on a GPU (ten PyTorch kernels otherwise), ``"torch"`` for comparisons; ``norm_backend``, the
#: model's RMS norms at inference (:mod:`linearize.model.norms`): None = one Triton kernel per norm on a GPU where its
#: form is measured (a 32K x 8 decode step of the Llama-3-8B-shaped hybrid 12.31 -> 11.11 ms, CUDA graphs, H100,
#: 2026-12-06), ``"torch"`` the family's own modules
KERNEL_OPTIONS = {"fused_feature_maps": "maps", "rotary_backend": None, "norm_backend": None}


def merge_kernel_options(current: dict, options: dict) -> dict:
    """``current`` kernel options with ``options`` applied: a ``TypeError`` for an unknown option, a ``ValueError``
    naming the accepted values for a value of another kind."""
    unknown = sorted(set(options) - set(KERNEL_OPTIONS))
    if unknown:
        raise TypeError(f"unknown kernel option {unknown[0]!r} (known: {', '.join(KERNEL_OPTIONS)})")
    merged = {**current, **options}
    if merged["fused_feature_maps"] not in FUSED_FEATURE_MAP_MODES:
        raise ValueError(f"fused_feature_maps={merged['fused_feature_maps']!r}: expected one of "
                         f"{', '.join(FUSED_FEATURE_MAP_MODES)}")
    if merged["rotary_backend"] not in BACKENDS:
        raise ValueError(f"rotary_backend={merged['rotary_backend']!r}: expected one of "
                         f"{', '.join(map(repr, BACKENDS))}")
    if merged["norm_backend"] not in NORM_BACKENDS:
        raise ValueError(f"norm_backend={merged['norm_backend']!r}: expected one of "
                         f"{', '.join(map(repr, NORM_BACKENDS))}")
    return merged


#: fp32 scores per block of query rows in the soft-capped teacher (Gemma 2), which SDPA cannot compute
TEACHER_BLOCK_SCORES = 1 << 26


def _evens_first(x: torch.Tensor, rotary: int) -> torch.Tensor:
    """``x [..., D]`` with its first ``rotary`` channels reordered as the even ones, then the odd ones."""
    parts = [x[..., 0:rotary:2], x[..., 1:rotary:2]] + ([x[..., rotary:]] if rotary < x.shape[-1] else [])
    return torch.cat(parts, dim=-1)


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter, or -1 for an inference tensor (made under ``torch.inference_mode``, which
    keeps none: generate() under inference mode builds its masks so)."""
    return -1 if t.is_inference() else t._version


def real_tokens(attention_mask, T: int) -> torch.Tensor | None:
    """``[B, T]`` bool: which of a forward's ``T`` (> 1) tokens are not padding, read from the attention mask the
    decoder layer passes on (the 2-D padding mask of flash attention, or the 4-D mask of SDPA / eager attention,
    where a padding query attends to nothing, not even itself); None when every token is real, for a single
    decode token (generation appends real tokens only) and for masks of another kind."""
    if T < 2 or not torch.is_tensor(attention_mask):
        return None
    if attention_mask.dim() == 2:
        real = attention_mask[:, -T:].bool()
    elif attention_mask.dim() == 4 and attention_mask.shape[-2] == T:
        diag = attention_mask[:, 0].diagonal(offset=attention_mask.shape[-1] - T, dim1=-2, dim2=-1)  # [B, T]
        real = diag if diag.dtype == torch.bool else diag > torch.finfo(diag.dtype).min / 2
    else:
        return None
    return None if bool(real.all()) else real


#: ``attention.decay``: ``none`` (the state sums every token alike) or ``learned`` (:class:`DecayGate`)
DECAY_KINDS = ("none", "learned")


class DecayGate(nn.Module):
    """How fast a gated linear layer forgets: ``log_decay = -softplus(x W^T + b)`` ``[B, T, Hk]`` fp32, <= 0, per
    token and key/value head, from the layer's input ``x`` ``[B, T, hidden]``.

    ``W`` starts at zero and ``b`` at ``softplus^-1(ln 2 / half_life)``: the untrained gate forgets every token with
    a half-life of ``half_life`` tokens (e^-0.087 = 0.92 across 2,048 tokens at the default 16,384), close to the
    ungated layer; stage 1 trains ``W`` and ``b`` against the original attention. Kept in fp32."""

    def __init__(self, hidden_size: int, kv_heads: int, half_life: float):
        super().__init__()
        if not half_life > 0:
            raise ValueError(f"attention.decay_half_life must be > 0, got {half_life}")
        rate = math.log(2.0) / half_life
        self.weight = nn.Parameter(torch.zeros(kv_heads, hidden_size))  # [Hk, hidden]
        self.bias = nn.Parameter(torch.full((kv_heads,), math.log(math.expm1(rate))))  # [Hk]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -F.softplus(F.linear(x.float(), self.weight.float(), self.bias.float()))  # [B, T, Hk]


class RealTokens:
    """:func:`real_tokens`, read once per mask (and in-place version) instead of once per layer: the converted layers
    of one model share one, and every decoder layer of a forward passes the same mask."""

    def __init__(self):
        self._last: tuple = (None, None, None)  # (weak reference to the mask, (its version, T), the answer)

    def __getstate__(self) -> dict:  # copies and pickles start empty (a weak reference does not pickle)
        return {"_last": (None, None, None)}

    def __call__(self, attention_mask, T: int) -> torch.Tensor | None:
        if T < 2 or not torch.is_tensor(attention_mask):  # no padding to find (decode steps: no memo to touch)
            return None
        ref, key, real = self._last
        if ref is None or ref() is not attention_mask or key != (tensor_version(attention_mask), T):
            real = real_tokens(attention_mask, T)
            self._last = (weakref.ref(attention_mask), (tensor_version(attention_mask), T), real)
        return real


def adopt_original(layer: nn.Module, original: nn.Module, config, layer_idx: int, arch: ArchSpec) -> None:
    """Give a converted ``layer`` what the original attention computes with (the teacher): its shape, softmax scale,
    projections, q/k norms, rotary settings, and its reach and logit cap (a sliding window: Gemma 2 / 3, Mistral;
    Gemma 2's soft-cap c, scores -> c tanh(scores / c))."""
    layer.layer_idx = layer_idx
    layer.num_heads, layer.num_kv_heads, layer.head_dim = attention_shape(config)
    layer.scaling = float(getattr(original, "scaling", None) or layer.head_dim**-0.5)  # softmax scale of q.k
    layer.teacher_window = softmax_windows(config)[layer_idx]
    layer.softcap = getattr(original, "attn_logit_softcapping", None)
    for name in arch.projections:
        setattr(layer, name, getattr(original, name))
    layer.qkv = arch.qkv
    layer.q_norm = getattr(original, arch.q_norm, None) if arch.q_norm else None
    layer.k_norm = getattr(original, arch.k_norm, None) if arch.k_norm else None
    layer.qk_norm_over = arch.qk_norm_over
    layer.clip_qkv = getattr(config, arch.clip_qkv, None) if arch.clip_qkv else None
    layer.rope = arch.uses_rope is None or bool(arch.uses_rope(original))
    layer.qk_norm_after_rope = arch.qk_norm_after_rope
    layer.rope_interleaved = arch.rope_interleaved


class LinearAttention(nn.Module):
    """A linear (optionally sliding-window hybrid) attention layer built from an original module.

    Args:
        original: the softmax attention module being replaced (its projections are adopted).
        config: the base model config (heads, head_dim).
        layer_idx: index of the decoder layer.
        settings: the recipe's ``attention`` section (feature_map, feature_dim, window, window_init, eps).
        arch: where the family keeps its projections and norms.
        kernel_options: :data:`KERNEL_OPTIONS` that differ from the defaults (the hybrid's config passes its own).
        masks: the model's :class:`RealTokens`, shared by its converted layers (None: the layer's own).
    """

    def __init__(self, original: nn.Module, config, layer_idx: int, settings: dict, arch: ArchSpec, *,
                 kernel_options: dict | None = None, masks: RealTokens | None = None):
        super().__init__()
        adopt_original(self, original, config, layer_idx, arch)
        self.window = layer_window(settings, layer_idx)
        self.eps = float(settings.get("eps", 1e-6))
        self.sinks = int(settings.get("sinks") or 0)  # first tokens kept in the exact-softmax part (kernels/sinks.py)
        if self.sinks and not self.window:
            raise ValueError("attention.sinks needs a sliding window (attention.window > 0)")
        fm_params = {}
        if settings.get("feature_dim") is not None:
            fm_params["feature_dim"] = settings["feature_dim"]
        name = settings.get("feature_map", "hedgehog")
        self.feature_map_q = build_feature_map(name, self.num_heads, self.head_dim, softmax_scale=self.scaling,
                                               **fm_params)
        self.feature_map_k = build_feature_map(name, self.num_kv_heads, self.head_dim, softmax_scale=self.scaling,
                                               **fm_params)
        if self.window > 0:
            init = float(settings.get("window_init", 0.1))
            logit = math.log(init / (1.0 - init))
            self.window_logit = nn.Parameter(torch.full((self.num_heads,), logit))
        else:
            self.register_parameter("window_logit", None)
        ref = getattr(self, arch.projections[0]).weight
        self.feature_map_q.to(device=ref.device, dtype=ref.dtype)
        self.feature_map_k.to(device=ref.device, dtype=ref.dtype)
        if self.window_logit is not None:
            self.window_logit.data = self.window_logit.data.to(device=ref.device, dtype=torch.float32)
        decay = settings.get("decay", "none") or "none"
        if decay not in DECAY_KINDS:
            raise ValueError(f"attention.decay must be one of {', '.join(DECAY_KINDS)}, got {decay!r}")
        self.decay = (DecayGate(config.hidden_size, self.num_kv_heads, float(settings.get("decay_half_life", 16384)))
                      .to(device=ref.device) if decay == "learned" else None)
        self.set_kernel_options(**(kernel_options or {}))
        self.real_tokens = masks if masks is not None else RealTokens()
        self.mode = "linear"
        self.distill_pair: tuple[torch.Tensor, torch.Tensor] | None = None
        self.xent_rows = 0  # > 0: in distill mode also compute Hedgehog's attention-weight cross-entropy
        self.distill_xent: torch.Tensor | None = None

    # -- projections -------------------------------------------------------------------------
    def project(self, hidden_states: torch.Tensor, position_embeddings):
        """Post-rotary ``q [B,T,H,D]``, ``k [B,T,Hk,D]`` and ``v [B,T,Hk,D]``."""
        B, T, _ = hidden_states.shape
        if self.qkv is not None:  # one fused projection, [q | k | v] along the last dim
            kv_width = self.num_kv_heads * self.head_dim
            q, k, v = getattr(self, self.qkv)(hidden_states).split(
                [self.num_heads * self.head_dim, kv_width, kv_width], dim=-1)
        else:
            q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        if self.clip_qkv is not None:
            c = float(self.clip_qkv)
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        if self.q_norm is not None and self.qk_norm_over == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(B, T, self.num_heads, self.head_dim)
        k = k.reshape(B, T, self.num_kv_heads, self.head_dim)
        v = v.reshape(B, T, self.num_kv_heads, self.head_dim)
        if not self.qk_norm_after_rope:
            q, k = self._head_norms(q, k)
        if self.rope:
            cos, sin = position_embeddings
            if self.rope_interleaved:
                q, k = _evens_first(q, cos.shape[-1]), _evens_first(k, cos.shape[-1])
            if self.rope_interleaved == "tables":  # [f0, f0, f1, f1, ...] -> [f0, f1, ..., f0, f1, ...]
                cos, sin = (torch.cat([t[..., 0::2]] * 2, dim=-1) for t in (cos, sin))
            q, k = rotary_embedding(q, k, cos, sin, backend=self.rotary_backend)
        if self.qk_norm_after_rope:
            q, k = self._head_norms(q, k)
        return q, k, v

    def _head_norms(self, q, k):
        """The per-head q/k norms (``[B, T, H, D]`` in and out), if the family has them."""
        if self.q_norm is not None and self.qk_norm_over == "head":
            return self.q_norm(q), self.k_norm(k)
        if self.q_norm is not None and self.qk_norm_over == "heads_first":
            return self.q_norm(q.transpose(1, 2)).transpose(1, 2), self.k_norm(k.transpose(1, 2)).transpose(1, 2)
        return q, k

    # -- the two attentions --------------------------------------------------------------------
    def softmax_attention(self, q, k, v, attention_mask=None) -> torch.Tensor:
        """The original causal softmax attention (the teacher), ``[B, T, H, D]``, within the base layer's sliding
        window and with its logit soft-cap where it has them."""
        B, T = q.shape[:2]
        if self.softcap:  # SDPA has no soft-cap: fp32 scores, in blocks of query rows (~256 MB of scores each)
            vh = v.transpose(1, 2).float()
            if self.num_kv_heads != self.num_heads:
                vh = vh.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)  # [B, H, T, D]
            rows = max(1, TEACHER_BLOCK_SCORES // (B * self.num_heads * T))
            blocks = [self.teacher_logits(q[:, i:i + rows], k[:, :i + rows]).softmax(-1) @ vh[:, :, :i + rows]
                      for i in range(0, T, rows)]  # queries i .. i+rows-1 see keys up to i+rows-1
            return torch.cat(blocks, dim=2).transpose(1, 2).to(v.dtype)
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
        mask = self.teacher_sees(0, T, q.device) if self.teacher_window and T > self.teacher_window else None
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None and T > 1,
                                           scale=self.scaling)
        return o.transpose(1, 2)

    def teacher_sees(self, first: int, T: int, device) -> torch.Tensor:
        """``[T - first, T]`` bool: which keys the original attention of queries ``first .. T-1`` looks at (the
        earlier tokens and the query itself, within the base layer's sliding window)."""
        i = torch.arange(first, T, device=device).unsqueeze(1)
        j = torch.arange(T, device=device).unsqueeze(0)
        sees = j <= i
        if self.teacher_window:
            sees = sees & (i - j < self.teacher_window)
        return sees

    def teacher_logits(self, q, k) -> torch.Tensor:
        """fp32 ``[B, H, r, T]``: the original attention's logits (scale, soft-cap) of the last ``r`` queries ``q``
        ``[B, r, H, D]`` over the keys ``k`` ``[B, T, Hk, D]``; ``-inf`` where the original does not look."""
        T, r = k.shape[1], q.shape[1]
        qs, kh = q.transpose(1, 2).float(), k.transpose(1, 2).float()
        if self.num_kv_heads != self.num_heads:
            kh = kh.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        scores = (qs @ kh.transpose(-1, -2)) * self.scaling
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        return scores.masked_fill(~self.teacher_sees(T - r, T, q.device), float("-inf"))

    def attention_xent(self, q, k, rows: int) -> torch.Tensor:
        """Hedgehog's loss: cross-entropy of the linear attention weights against the softmax weights.

        Computed on the last ``rows`` query positions (they see every key), ``[B, H, rows, T]`` in fp32.
        """
        T = q.shape[1]
        r = min(rows, T)
        fq = self.feature_map_q(q[:, T - r :]).transpose(1, 2).float()  # [B, H, r, F]
        fk = self.feature_map_k(k).transpose(1, 2).float()  # [B, Hk, T, F]
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            fk = fk.repeat_interleave(rep, dim=1)
        causal = torch.arange(T, device=q.device).unsqueeze(0) <= torch.arange(T - r, T, device=q.device).unsqueeze(1)
        p_true = torch.softmax(self.teacher_logits(q[:, T - r :], k), dim=-1)  # [B, H, r, T]
        lin = (fq @ fk.transpose(-1, -2)).masked_fill(~causal, 0.0)
        a_pred = lin / lin.sum(-1, keepdim=True).clamp_min(1e-12)
        return -(p_true * torch.log(a_pred.clamp_min(1e-12))).sum(-1).mean()

    def set_kernel_options(self, **options) -> None:
        """Change kernel options (:data:`KERNEL_OPTIONS`); the others stay. Results change by rounding only."""
        current = {name: getattr(self, name, default) for name, default in KERNEL_OPTIONS.items()}
        for name, value in merge_kernel_options(current, options).items():
            setattr(self, name, value)

    def learned_parameters(self) -> list[nn.Parameter]:
        """What stage 1 trains in this layer: the learnable feature maps, the window mix, the decay gate."""
        params = []
        for fm in (self.feature_map_q, self.feature_map_k):
            if fm.learnable:
                params += list(fm.parameters())
        if self.window_logit is not None:
            params.append(self.window_logit)
        if self.decay is not None:
            params += list(self.decay.parameters())
        return params

    @property
    def window_factor(self) -> torch.Tensor | None:
        return None if self.window_logit is None else torch.sigmoid(self.window_logit)

    def fused_features(self, q, k, decode: bool) -> bool:
        """Whether the kernel computes this layer's Hedgehog features itself: inference on a GPU (no gradient
        needed), Hedgehog maps on both sides, and ``fused_feature_maps`` covering this call (decode step or not)."""
        mode = self.fused_feature_maps
        if not (mode == "all" or (mode != "none" and decode)) or not q.is_cuda:
            return False
        if not (isinstance(self.feature_map_q, HedgehogFeatureMap) and isinstance(self.feature_map_k, HedgehogFeatureMap)):
            return False
        grads = (q, k, self.feature_map_q.weight, self.feature_map_k.weight, self.window_logit)
        return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in grads))

    def features(self, feature_map, x: torch.Tensor) -> torch.Tensor:
        """``feature_map(x)``, by the standalone Triton kernel where :meth:`map_in_kernel` says so
        (:func:`linearize.kernels.hedgehog_feature_map`, which leaves gradients to the PyTorch map)."""
        if self.map_in_kernel(feature_map, x):
            return hedgehog_feature_map(x, feature_map.weight, eps=feature_map.eps, backend="triton")
        return feature_map(x)

    def map_in_kernel(self, feature_map, x: torch.Tensor) -> bool:
        """Hedgehog maps on a GPU with ``fused_feature_maps`` ``maps`` or ``all``."""
        return self.fused_feature_maps in ("maps", "all") and x.is_cuda and isinstance(feature_map, HedgehogFeatureMap)

    def signed_feature_weights(self, dtype: torch.dtype):
        """``([Wq, -Wq], [Wk, -Wk])`` of the Hedgehog maps in ``dtype``, kept between decode steps (remade when
        a weight changes: a new tensor or an in-place update)."""
        # optional: Triton, only where the GPU kernels run
        from ..kernels.triton_common import signed_projections

        wq, wk = self.feature_map_q.weight, self.feature_map_k.weight
        key = (wq.data_ptr(), wk.data_ptr(), tensor_version(wq), tensor_version(wk), dtype)
        cached = getattr(self, "_signed_weights", None)
        if cached is None or cached[0] != key:
            cached = (key, signed_projections(wq.detach(), wk.detach(), dtype))
            self._signed_weights = cached
        return cached[1]

    def linear_attention(self, q, k, v, layer_cache=None, real: torch.Tensor | None = None,
                         log_decay: torch.Tensor | None = None) -> torch.Tensor:
        """The converted attention over ``[B, T, *, D]`` inputs, continuing ``layer_cache`` if given. ``real``
        ``[B, T]`` bool marks the tokens that are not padding (None: all are); padding keys are left out of every
        sum, state and window, so a left-padded row computes what its unpadded sequence computes. ``log_decay``
        ``[B, T, Hk]``: the gate's per-token forgetting (gated layers; None otherwise)."""
        T = q.shape[1]
        state = layer_cache.state if layer_cache is not None else None
        want_state = layer_cache is not None
        decode = state is not None and T == 1
        if state is not None and self.window > 0 and not decode and real is None and not bool(state.keep.all()):
            real = q.new_ones(q.shape[:2], dtype=torch.bool)  # the ring holds padding: mask it in the continuation
        recording = layer_cache is not None and layer_cache.record_past  # crop() may take these tokens back
        # features inside the kernels (the fused kernels take no decay, and sinks need the key features zeroed:
        # a decode step once every row has its sinks is fused again)
        sinks_full = decode and layer_cache.sinks_full
        fused = (real is None and not recording and log_decay is None and (not self.sinks or sinks_full)
                 and self.fused_features(q, k, decode))
        fq = None if fused else self.features(self.feature_map_q, q)
        # key features stay in memory without fusion, and for a window layer's prefill into a cache (its ring)
        fk = (None if (fused and (decode or self.window == 0 or (state is None and not want_state)))
              else self.features(self.feature_map_k, k))
        sinks = None
        if sinks_full:  # no new sink
            sinks = layer_cache.sinks
        elif self.sinks:  # which tokens are sinks: their key features are zeroed (no linear sum holds them)
            fk, sinks = self.take_sinks(k, fk, v, layer_cache, real, decode)
        if recording:
            layer_cache.record(k, fk, v, real, self.window, log_decay)
        if self.window == 0:
            if decode:
                if fused:
                    o = linear_attention_step_hedgehog(
                        q[:, 0], k[:, 0], v[:, 0], self.feature_map_q.weight, self.feature_map_k.weight, state,
                        eps=self.eps, feature_eps=self.feature_map_q.eps, signed=self.signed_feature_weights(q.dtype))
                else:
                    o = linear_attention_step(fq[:, 0], fk[:, 0], v[:, 0], state, eps=self.eps,
                                              log_decay=None if log_decay is None else log_decay[:, 0])
                layer_cache.set_state(state, 1)
                return o.unsqueeze(1)
            if fused:
                o, new_state = linear_attention_hedgehog(q, k, v, self.feature_map_q.weight, self.feature_map_k.weight,
                                                         eps=self.eps, feature_eps=self.feature_map_q.eps,
                                                         initial_state=state, output_final_state=want_state)
            else:
                o, new_state = linear_attention(fq, fk, v, eps=self.eps, initial_state=state,
                                                output_final_state=want_state, key_mask=real, log_decay=log_decay)
            if want_state:
                layer_cache.set_state(new_state, T)
            return o
        wf = self.window_factor
        if decode:  # the sinks out of the window join the step's softmax part
            if fused:
                o = window_linear_attention_step_hedgehog(
                    q[:, 0], k[:, 0], v[:, 0], wf, self.feature_map_q.weight, self.feature_map_k.weight, state,
                    scale=self.scaling, eps=self.eps, feature_eps=self.feature_map_q.eps,
                    signed=self.signed_feature_weights(q.dtype), sinks=sinks)
            else:
                o = window_linear_attention_step(q[:, 0], k[:, 0], fq[:, 0], fk[:, 0], v[:, 0], wf, state,
                                                 scale=self.scaling, eps=self.eps,
                                                 log_decay=None if log_decay is None else log_decay[:, 0], sinks=sinks)
            layer_cache.set_state(state, 1)
            return o.unsqueeze(1)
        n_prev = 0
        init = None
        if state is not None:  # a multi-token continuation: prepend the window ring in temporal order
            n_prev = min(int(state.seen.item()), self.window)
            order = (torch.arange(int(state.seen.item()) - n_prev, int(state.seen.item()), device=q.device)
                     % self.window)
            k = torch.cat([state.k_ring[:, :, order].transpose(1, 2).to(k.dtype), k], dim=1)
            fk = torch.cat([state.fk_ring[:, :, order].transpose(1, 2).to(fk.dtype), fk], dim=1)
            v = torch.cat([state.v_ring[:, :, order].transpose(1, 2).to(v.dtype), v], dim=1)
            q = torch.cat([q.new_zeros(q.shape[0], n_prev, *q.shape[2:]), q], dim=1)
            if fq is not None:
                fq = torch.cat([fq.new_zeros(fq.shape[0], n_prev, *fq.shape[2:]), fq], dim=1)
            if real is not None:
                real = torch.cat([state.keep[:, order], real], dim=1)
            if log_decay is not None:  # the ring's tokens decay again as they are replayed: [B, n_prev + T, Hk]
                log_decay = torch.cat([state.ld_ring[:, :, order].transpose(1, 2).to(log_decay.dtype), log_decay], 1)
            init = (state.S, state.z)
        if fused:  # the prepended zero queries get features too; their outputs are dropped below
            o, final = window_linear_attention_hedgehog(
                q, k, v, wf, self.feature_map_q.weight, self.feature_map_k.weight, fk=fk, window=self.window,
                scale=self.scaling, eps=self.eps, feature_eps=self.feature_map_q.eps, initial_state=init,
                output_final_state=want_state)
        else:
            o, final, *lse = window_linear_attention(q, k, fq, fk, v, wf, window=self.window, scale=self.scaling,
                                                     eps=self.eps, initial_state=init, output_final_state=want_state,
                                                     key_mask=real, log_decay=log_decay, return_lse=bool(self.sinks))
            if sinks is not None:  # the sinks out of each query's window; stream positions of the rows of q
                first = (int(state.seen.item()) - n_prev) if state is not None else 0
                visible = sink_visibility(sinks, torch.arange(first, first + q.shape[1], device=q.device), self.window)
                o, _ = merge_sinks(o, lse[0], q, sinks, visible, wf, self.scaling)
        if want_state:
            seen_before = int(state.seen.item()) - n_prev if state is not None else 0
            new_state = window_state_from_prefill(k, fk, v, final, self.window, offset=seen_before, key_mask=real,
                                                  log_decay=log_decay)
            layer_cache.state = None
            layer_cache.set_state(new_state, T)
        return o[:, n_prev:]

    def take_sinks(self, k, fk, v, layer_cache, real, decode: bool):
        """The attention sinks of this call: ``(fk with the sinks' rows zeroed, every sink so far)``. The first
        ``self.sinks`` real tokens of a sequence are sinks; a cache keeps them (:class:`~linearize.kernels.sinks.Sinks`)
        for later calls. Branch-free for a decode step (no read back to the host: CUDA graphs)."""
        B, T = k.shape[:2]
        kept = layer_cache.sinks if layer_cache is not None else None
        before = kept.valid.sum(1) if kept is not None else None  # [B]
        is_sink = first_tokens(self.sinks, B, T, k.device, key_mask=real, before=before)
        fk = fk.masked_fill(is_sink.view(B, T, 1, 1), 0.0)
        start = layer_cache.seen if layer_cache is not None else 0  # the call's first stream position
        if decode and kept is not None:
            start = layer_cache.state.seen  # [1] on the device
        new = gather_sinks(is_sink, self.sinks, k.detach() if layer_cache is not None else k,
                           v.detach() if layer_cache is not None else v, offset=start)
        sinks = new if kept is None else join_sinks(kept, new)
        if layer_cache is not None:
            layer_cache.sinks = sinks
            if not decode:  # read once per prefill: later steps skip the bookkeeping once every row has its sinks
                layer_cache.sinks_full = bool(sinks.valid.all())
        return fk, sinks

    # -- forward -------------------------------------------------------------------------------
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                cache=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        B, T, _ = hidden_states.shape
        q, k, v = self.project(hidden_states, position_embeddings)
        layer_cache = cache.linear_layer(self.layer_idx) if isinstance(cache, HybridCache) else None
        log_decay = self.decay(hidden_states) if self.decay is not None and self.mode != "softmax" else None
        if self.mode == "softmax":
            if layer_cache is not None:
                raise RuntimeError("softmax (teacher) mode does not support a generation cache")
            o = self.softmax_attention(q, k, v)
        elif self.mode == "distill":
            teacher = self.softmax_attention(q, k, v)
            student = self.linear_attention(q, k, v, log_decay=log_decay)
            self.distill_pair = (student, teacher.detach())
            self.distill_xent = self.attention_xent(q, k, self.xent_rows) if self.xent_rows > 0 else None
            o = teacher
        else:
            o = self.linear_attention(q, k, v, layer_cache, real=self.real_tokens(attention_mask, T), log_decay=log_decay)
        o = o.reshape(B, T, self.num_heads * self.head_dim).to(hidden_states.dtype)
        return self.o_proj(o), None

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"window={self.window}, decay={'learned' if self.decay is not None else 'none'}, mode={self.mode}")

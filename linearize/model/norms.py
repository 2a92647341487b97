"""The base family's RMS norms on one Triton kernel at inference (the kernel option ``norm_backend``).

A decoder layer normalises its hidden states two to four times, each with the family's own module: seven PyTorch
kernels on a few rows at a decode step. :func:`set_norm_backend` gives every RMS-norm module of a model a forward
that, when no gradient is wanted and the backend is Triton, runs :func:`linearize.kernels.rms_norm` instead, and
otherwise the module's own code. Parameter names, state dicts and training are unchanged.

Which rounding order a module follows (:data:`~linearize.kernels.RMS_NORM_FORMS`) is measured, not listed per
family: :func:`norm_form` runs the module's own forward on a probe row with a probe weight and keeps the form
whose reference gives the same bits. A module that matches none (another formula, another epsilon attribute)
keeps its own forward.
"""

from __future__ import annotations

import os
import types

import torch
from torch import nn

from ..kernels import RMS_NORM_FORMS, needs_grad, rms_norm, rms_norm_reference

#: norm backends: None (Triton on CUDA), "triton" (also CPU under TRITON_INTERPRET=1), "torch" (the modules' own)
NORM_BACKENDS = (None, "triton", "torch")
#: attributes that hold a norm module's epsilon, in the order they are tried
_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")
#: the form measured for each norm class (None: none matched)
_FORMS: dict[tuple[type, str], str | None] = {}


def _eps_name(module: nn.Module) -> str | None:
    """The attribute that holds ``module``'s epsilon (a float), or None."""
    return next((name for name in _EPS_NAMES if isinstance(getattr(module, name, None), float)), None)


def _eps(module: nn.Module) -> float:
    return getattr(module, _eps_name(module))


def norm_form(module: nn.Module) -> str | None:
    """The form of :data:`~linearize.kernels.RMS_NORM_FORMS` that ``module``'s forward computes bit for bit, or
    None. Candidates are modules with one 1-D ``weight`` parameter, no buffers and a float epsilon attribute; the
    probe (bf16 rows and a weight near one, on the CPU) runs the module's own forward through
    ``torch.func.functional_call``, so its weights, wherever they live, are not touched. Measured once per class
    and epsilon attribute."""
    weight = getattr(module, "weight", None)
    eps_name = _eps_name(module)
    if (not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps_name is None or list(module.buffers())
            or [n for n, _ in module.named_parameters()] != ["weight"]):
        return None
    key = (type(module), eps_name)
    if key not in _FORMS:
        g = torch.Generator().manual_seed(0)
        n = weight.numel()
        # on the CPU explicitly: from_pretrained builds the model under a meta-device context
        x = (torch.randn(3, n, generator=g, device="cpu") * 3).to(torch.bfloat16)
        w = (1 + 0.25 * torch.randn(n, generator=g, device="cpu")).to(torch.bfloat16)
        try:
            with torch.no_grad():
                out = torch.func.functional_call(module, {"weight": w}, (x,))
        except Exception:  # a module that does not take one tensor: not a plain RMS norm
            out = None
        _FORMS[key] = next((f for f in RMS_NORM_FORMS if torch.is_tensor(out) and _same(out, rms_norm_reference(
            x, w, getattr(module, eps_name), f))), None)
    return _FORMS[key]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


def _fused_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The norm on :func:`~linearize.kernels.rms_norm`'s Triton path; under autograd, with extra arguments, or on a
    device the backend does not run on, the module's own forward."""
    if args or kwargs or not (hidden_states.is_cuda or self._linearize_norm_on_cpu) or needs_grad(
            hidden_states, self.weight):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    return rms_norm(hidden_states, self.weight, self._linearize_norm_eps, form=self._linearize_norm_form,
                    backend="triton")


#: what a patched module carries (set once, so the forward reads no attribute names or environment)
_PATCH_ATTRS = ("_linearize_norm_form", "_linearize_norm_eps", "_linearize_norm_on_cpu")


def set_norm_backend(model: nn.Module, backend: str | None) -> int:
    """Give every RMS-norm module of ``model`` whose form :func:`norm_form` measures the Triton forward
    (``backend`` None or ``"triton"``), or its own forward back (``"torch"``); returns how many modules run the
    kernel. Idempotent."""
    if backend not in NORM_BACKENDS:
        raise ValueError(f"norm_backend={backend!r}: expected one of {', '.join(map(repr, NORM_BACKENDS))}")
    fused = 0
    for module in model.modules():
        # a module under an accelerate hook (device_map offloading) keeps the hook: its wrapped forward is swapped
        slot = "_old_forward" if hasattr(module, "_hf_hook") and "_old_forward" in vars(module) else "forward"
        if backend == "torch":
            if "_linearize_norm_form" in vars(module):
                for name in _PATCH_ATTRS:
                    delattr(module, name)
                if slot == "forward":
                    del module.forward
                else:
                    module._old_forward = types.MethodType(type(module).forward, module)
            continue
        form = norm_form(module)
        if form is None:
            continue
        on_cpu = backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter runs it there
        for name, value in zip(_PATCH_ATTRS, (form, _eps(module), on_cpu)):
            setattr(module, name, value)
        setattr(module, slot, types.MethodType(_fused_forward, module))
        fused += 1
    return fused

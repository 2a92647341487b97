"""The model's RMS norms on one Triton kernel (kernel option ``norm_backend``, :mod:`linearize.model.norms`): which
form each family's module computes is measured bit for bit, the patched forward falls back to the module's own
code where the kernel does not apply, and the option lives in the hybrid's config. The kernel itself is checked
against the reference in ``test_kernels_triton.py`` (interpreter / GPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import FAMILIES, tiny_model
from linearize.kernels import RMS_NORM_FORMS, rms_norm, rms_norm_reference
from linearize.model import norms
from linearize.model.norms import norm_form, set_norm_backend

#: forms measured on transformers' modules (the LayerNorm families have none)
EXPECTED = {"LlamaRMSNorm": "llama", "Qwen3RMSNorm": "llama", "GemmaRMSNorm": "gemma", "Gemma2RMSNorm": "gemma",
            "Gemma3RMSNorm": "gemma", "Olmo2RMSNorm": "olmo2", "LayerNorm": None, "CohereLayerNorm": None}


@pytest.mark.parametrize("family", FAMILIES)
def test_measured_form_is_the_module_bit_for_bit(family):
    """Every module given a form computes that form's reference exactly, with its own weight, in bf16 and fp32 (the
    probe uses another weight); the families checked by name get the form of their source."""
    model = tiny_model(family, layers=2)
    found = {}
    for module in model.modules():
        form = norm_form(module)
        found.setdefault(type(module).__name__, set()).add(form)
        if form is None:
            continue
        with torch.no_grad():
            module.weight.add_(0.1 * torch.randn_like(module.weight))
            for dtype in (torch.bfloat16, torch.float32):
                m = copy.deepcopy(module).to(dtype)
                x = (torch.randn(2, 3, m.weight.numel()) * 2).to(dtype)
                assert torch.equal(m(x), rms_norm_reference(x, m.weight, norms._eps(m), form)), (family, dtype)
    for name, form in EXPECTED.items():
        if name in found:
            assert found[name] == {form}, (family, name, found[name])
    rms = [n for n in found if n.endswith("RMSNorm")]
    assert all(found[n] != {None} for n in rms), (family, found)  # every RMS norm of the suite's families matches


def test_norm_form_skips_what_is_not_a_plain_rms_norm():
    assert norm_form(torch.nn.LayerNorm(8)) is None  # a bias parameter
    assert norm_form(torch.nn.LayerNorm(8, bias=False)) is None  # subtracts the mean: no form matches
    assert norm_form(torch.nn.Linear(8, 8)) is None
    rms = torch.nn.RMSNorm(8, eps=1e-5)  # torch's own: the product in fp32 before the cast, as OLMo-2's
    assert norm_form(rms) == "olmo2"


def test_backend_patches_and_restores(monkeypatch):
    """None / "triton" give every measured norm the fused forward, "torch" takes it back; on a CPU without the
    interpreter, under autograd, or with extra arguments the module's own forward runs (same bits)."""
    model = tiny_model("qwen3", layers=2)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        before = model(torch.arange(10).view(2, 5)).logits
    assert set_norm_backend(model, None) == 2 * 2 + 1 + 2 * 2  # two per layer, the final one, q and k norms
    calls = []
    monkeypatch.setattr(norms, "rms_norm", lambda *a, **k: calls.append(k) or rms_norm(*a, **{**k, "backend": "torch"}))
    with torch.no_grad():
        assert torch.equal(model(torch.arange(10).view(2, 5)).logits, before)
    assert not calls  # CPU tensors, backend None: the modules' own code
    norm = model.model.norm
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    set_norm_backend(model, "triton")
    with torch.no_grad():
        assert torch.equal(norm(x), rms_norm_reference(x, norm.weight, norm.variance_epsilon, "llama"))
    assert calls and calls[-1]["form"] == "llama" and calls[-1]["backend"] == "triton"
    n = len(calls)
    norm(x.requires_grad_()).sum().backward()  # training: autograd through the module's own forward
    assert len(calls) == n and norm.weight.grad is not None
    twin = copy.deepcopy(model)  # the patched forward follows the copy
    assert twin.model.norm.forward.__self__ is twin.model.norm
    set_norm_backend(model, "torch")
    assert not [m for m in model.modules() if "forward" in vars(m)]
    with pytest.raises(ValueError, match="norm_backend='gpu'"):
        set_norm_backend(model, "gpu")


def test_an_accelerate_hook_stays(monkeypatch):
    """Under device_map offloading accelerate wraps a module's forward (keeping the old one as ``_old_forward``);
    switching the backend afterwards swaps the wrapped forward and leaves the hook in place."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    seen = []

    class Spy(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen.append(type(module).__name__)
            return args, kwargs

    model = tiny_model("llama", layers=2)
    norm = model.model.norm
    add_hook_to_module(norm, Spy())
    hooked = norm.forward
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    monkeypatch.setattr(norms, "rms_norm", lambda *a, **k: calls.append(k) or rms_norm(*a, **{**k, "backend": "torch"}))
    set_norm_backend(model, "triton")
    x = torch.randn(2, 64)
    with torch.no_grad():
        norm(x)
    assert norm.forward is hooked and seen == ["LlamaRMSNorm"] and len(calls) == 1
    set_norm_backend(model, "torch")
    with torch.no_grad():
        norm(x)
    assert norm.forward is hooked and seen == ["LlamaRMSNorm"] * 2 and len(calls) == 1


def test_norm_backend_lives_in_the_hybrid_config(tmp_path):
    """The option is a config field: None by default (every norm patched, the kernel used on a GPU), saved with the
    checkpoint, overridable at load and by set_kernel_options."""
    from linearize import recipe as R
    from linearize.convert.selection import select_layout
    from linearize.convert.surgery import linearize_model
    from linearize.model.modeling import LinearizeForCausalLM

    hybrid = linearize_model(tiny_model("gemma"), select_layout(4, ratio="1:1"), R.load("lolcats"))
    patched = lambda m: sum("_linearize_norm_form" in vars(x) for x in m.modules())  # noqa: E731
    assert hybrid.config.norm_backend is None and patched(hybrid) == 2 * 4 + 1  # Gemma 1: two per layer, the final
    hybrid.set_kernel_options(norm_backend="torch")
    assert patched(hybrid) == 0
    hybrid.save_pretrained(tmp_path)
    loaded = LinearizeForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.norm_backend == "torch" and patched(loaded) == 0
    assert patched(LinearizeForCausalLM.from_pretrained(tmp_path, norm_backend=None)) == 2 * 4 + 1


@pytest.mark.parametrize("form", RMS_NORM_FORMS)
def test_reference_forms(form):
    """The three forms in float64 against the formula written out; the output dtype follows the modules."""
    x, w = torch.randn(3, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    normed = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    want = normed * (1 + w) if form == "gemma" else normed * w
    assert torch.allclose(rms_norm_reference(x, w, 1e-6, form), want)
    xb, wf = x.to(torch.bfloat16), w.float()
    assert rms_norm_reference(xb, wf, 1e-6, form).dtype == (torch.float32 if form == "llama" else torch.bfloat16)
    with pytest.raises(ValueError, match="form must be one of"):
        rms_norm(x, w, 1e-6, form="t5")

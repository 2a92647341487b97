"""Every family of the test suite at head_dim 64 on a GPU (the Triton kernels: rotary with partial and evens-first
channels, window forward, decode steps), fp32 with TF32 off, norm weights and biases randomised: max abs logit
difference of softmax mode vs the original model, of prefill 150 + 50 decode steps vs one forward (``lolcats``,
64-token window) and of the Triton path vs the chunked PyTorch path. Run from a checkout (it reads the tiny
family table of ``tests/conftest.py``; pytest must be installed):

    python kernels/family_checks.py [FAMILY ...] [--device cpu]
"""
import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import _TINY_FAMILIES  # noqa: E402
from linearize import kernels, recipe as R  # noqa: E402
from linearize.convert.selection import select_layout  # noqa: E402
from linearize.convert.surgery import linearize_model  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("families", nargs="*", default=sorted(_TINY_FAMILIES))
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = ap.parse_args()
dev = args.device
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
resolve = kernels._resolve_backend


def model_of(fam: str):
    """The family's tiny test model widened to head_dim 64 (the Llama head size / 2), norms and biases randomised."""
    cls_cfg, extra = _TINY_FAMILIES[fam]
    kw = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, vocab_size=256, max_position_embeddings=2048, tie_word_embeddings=False) | extra
    if "moe_intermediate_size" in kw:
        kw["moe_intermediate_size"] = 64
    if kw.get("intermediate_size") == 32:  # the tiny MoE families' experts
        kw["intermediate_size"] = 64
    cfg = getattr(transformers, cls_cfg)(**kw)
    torch.manual_seed(0)
    cls = "Gemma3ForCausalLM" if cls_cfg == "Gemma3TextConfig" else cls_cfg.replace("Config", "ForCausalLM")
    m = getattr(transformers, cls)(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
    return m.to(dev)


gpu = torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu"
print(f"torch {torch.__version__} transformers {transformers.__version__} {gpu}")
print(f"{'family':18s} {'softmax-mode':>12s} {'decode':>10s} {'triton-vs-torch':>15s} {'s':>6s}")
for fam in args.families:
    t0 = time.time()
    try:
        base = model_of(fam)
        ids = torch.randint(0, 256, (2, 200), device=dev)
        with torch.no_grad():
            ref = base(ids).logits
            h = linearize_model(copy.deepcopy(base), select_layout(4, ratio="1:0"), R.load("elu"))
            h.set_attention_mode("softmax")
            d_soft = (h(ids, use_cache=False).logits - ref).abs().max().item()
            h = linearize_model(copy.deepcopy(base), select_layout(4, ratio="1:1"),
                                R.load("lolcats", {"attention.window": 64}))
            full = h(ids, use_cache=False).logits
            out = h(ids[:, :150], use_cache=True)
            cache, lg = out.past_key_values, [out.logits]
            for t in range(150, 200):
                out = h(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
                lg.append(out.logits)
            d_dec = (torch.cat(lg, 1) - full).abs().max().item()
            kernels._resolve_backend = lambda b, x: resolve("torch" if b is None else b, x)
            try:
                d_bk = (h(ids, use_cache=False).logits - full).abs().max().item()
            finally:
                kernels._resolve_backend = resolve
        print(f"{fam:18s} {d_soft:12.2e} {d_dec:10.2e} {d_bk:15.2e} {time.time() - t0:6.1f}", flush=True)
    except Exception as e:
        print(f"{fam:18s} ERROR {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)

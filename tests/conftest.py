"""Shared fixtures: tiny random models of each supported family and the real embedded model."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Keep derived files (de-quantized GGUF, tokenized corpus) in one place for the whole run.
os.environ.setdefault("LINEARIZE_CACHE", str(Path.home() / ".cache" / "linearize"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "granite", "gemma", "gemma2", "gemma3_text", "olmo2", "phi3",
            "mixtral", "qwen2_moe", "qwen3_moe", "arcee", "seed_oss", "starcoder2", "ministral", "nemotron", "olmo",
            "olmo3", "apertus", "stablelm", "granitemoe", "phimoe", "glm4_moe", "smollm3", "exaone4", "hunyuan_v1_dense",
            "hunyuan_v1_moe", "glm", "glm4", "helium", "ernie4_5", "ernie4_5_moe", "cohere", "cohere2"]
#: configuration class of each family, and what its tiny model needs beyond the shared sizes
_TINY_FAMILIES = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {"attention_bias": True}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True}),
    # a softmax scale that is not 1/sqrt(head_dim), and scaled embeddings, residuals and logits
    "granite": ("GraniteConfig", {"attention_multiplier": 0.5, "embedding_multiplier": 4.0,
                                  "residual_multiplier": 0.5, "logits_scaling": 2.0}),
    "gemma": ("GemmaConfig", {"tie_word_embeddings": True}),
    # sliding-window layers shorter than the tests' sequences: Gemma 2's alternate (softmax layers of 3:1 and 1:1 are
    # global), a soft-cap that bites on random scores; a 4-layer Gemma 3 slides in every layer (pattern 6)
    "gemma2": ("Gemma2Config", {"sliding_window": 16, "attn_logit_softcapping": 2.0, "tie_word_embeddings": True}),
    "gemma3_text": ("Gemma3TextConfig", {"sliding_window": 16, "tie_word_embeddings": True}),
    "olmo2": ("Olmo2Config", {"pad_token_id": 1}),  # q/k norms over the whole projection
    # one fused qkv_proj, and rotary over half of each head (Phi-4-mini rotates 3/4)
    "phi3": ("Phi3Config", {"partial_rotary_factor": 0.5, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 32, "qkv_bias": True}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "tie_word_embeddings": True}),
    # Llama-shaped attention under other names: biases, sliding windows, partial rotary, q/k norms, a q/k/v bound
    "arcee": ("ArceeConfig", {}),
    "seed_oss": ("SeedOssConfig", {"attention_bias": True}),
    "starcoder2": ("Starcoder2Config", {"sliding_window": 16, "use_bias": True}),
    "ministral": ("MinistralConfig", {"sliding_window": 16}),
    "nemotron": ("NemotronConfig", {"partial_rotary_factor": 0.5}),
    "olmo": ("OlmoConfig", {"clip_qkv": 0.1, "pad_token_id": 1}),  # the bound bites on random projections
    "olmo3": ("Olmo3Config", {"sliding_window": 16, "pad_token_id": 1}),
    "apertus": ("ApertusConfig", {}),
    "stablelm": ("StableLmConfig", {"qk_layernorm": True, "use_qkv_bias": True}),  # one LayerNorm per head
    "granitemoe": ("GraniteMoeConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                                        "attention_multiplier": 0.5}),
    "phimoe": ("PhimoeConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}),
    "glm4_moe": ("Glm4MoeConfig", {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                   "first_k_dense_replace": 1, "use_qk_norm": True}),
    # layers without rotary: SmolLM3's every fourth (layer 3), EXAONE 4's global ones (1 and 3 at pattern 2)
    "smollm3": ("SmolLM3Config", {"pad_token_id": 1}),
    "exaone4": ("Exaone4Config", {"sliding_window": 16, "sliding_window_pattern": 2}),
    # q/k norms after rotary
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", {}),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", {"num_experts": 4, "moe_topk": 2, "moe_intermediate_size": 32,
                                             "intermediate_size": 32}),
    # rotary over interleaved pairs: GLM's partial (half of each head), Helium's and ERNIE's whole; Cohere's with
    # interleaved tables, q/k LayerNorms and a logit scale, Command R7B's (cohere2) only in its sliding layers
    "glm": ("GlmConfig", {"pad_token_id": 1}),
    "glm4": ("Glm4Config", {"pad_token_id": 1}),
    "helium": ("HeliumConfig", {}),
    "ernie4_5": ("Ernie4_5Config", {}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32}),
    "cohere": ("CohereConfig", {"use_qk_norm": True, "logit_scale": 0.5}),
    "cohere2": ("Cohere2Config", {"sliding_window": 16}),
}


def char_tokenizer(alphabet: str = "abcdefghijklmnopqrstuvwxyz .,", lowercase: bool = False):
    """A one-character-per-token fast tokenizer (``[UNK]`` for anything else, ``.`` ends a sequence)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["[UNK]"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token=".")


def tiny_model(family: str, layers: int = 4, seed: int = 0):
    """A 2-4 layer, hidden-64 random causal LM of ``family`` (GQA: 4 heads, 2 KV heads, head_dim 16; the MoE
    families with 4 experts, 2 per token)."""
    import transformers

    cls_cfg, extra = _TINY_FAMILIES[family]
    cls_lm = "Gemma3ForCausalLM" if cls_cfg == "Gemma3TextConfig" else cls_cfg.replace("Config", "ForCausalLM")
    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=1024,
                  tie_word_embeddings=False) | extra
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls_cfg)(**kwargs)
    model = getattr(transformers, cls_lm)(cfg).eval()
    return model


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    """The embedded SmolLM2-135M, de-quantized once into an HF directory."""
    from linearize.io.sources import local_dir

    return local_dir("smollm2-135m")


#: the installed ``linearize`` console script (what users run; it imports transformers' model code only for the
#: commands that need it), else the module (``python -m linearize.cli``, as under torchrun)
CONSOLE_SCRIPT = Path(sys.executable).with_name("linearize")
CLI = [str(CONSOLE_SCRIPT)] if CONSOLE_SCRIPT.is_file() else [sys.executable, "-m", "linearize.cli"]


def run_under_interpreter(module: Path, keyword: str | None = None) -> int:
    """Run ``module``'s tests (those matching ``-k keyword``) under Triton's CPU interpreter and assert they all pass;
    returns how many ran. ``TRITON_INTERPRET=1`` only takes effect if set before ``triton`` is first imported, so
    they run in fresh interpreters; the interpreter runs on one core, so the collected tests are split into one
    shard per core (every n-th test), run side by side."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    where = [str(module)] + (["-k", keyword] if keyword else [])
    root = Path(__file__).resolve().parents[1]
    listed = subprocess.run([*base, "--collect-only", *where], capture_output=True, text=True, env=env, cwd=root,
                            timeout=300)
    ids = [ln.strip() for ln in listed.stdout.splitlines() if "::" in ln]
    assert listed.returncode == 0 and ids, (listed.stdout + listed.stderr)[-3000:]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    n = max(1, min(4, cores, len(ids)))
    procs = [subprocess.Popen([*base, "-x", *ids[i::n]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=root) for i in range(n)]
    ran = 0
    for p in procs:
        out = p.communicate(timeout=1800)[0]
        tail, last = out[-6000:], (out.strip().splitlines() or [""])[-1]
        assert p.returncode == 0, tail
        assert " passed" in last and not any(w in last for w in ("skipped", "failed", "error")), tail
        ran += int(last.split(" passed")[0].split()[-1])
    assert ran == len(ids)
    return ran


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``linearize ARGS`` in a fresh process; capture output."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"})


def tiny_workspace(root: Path, tokenizer, layers: int) -> Path:
    """``root/tiny``: a tiny llama (vocab 64) with ``tokenizer``; ``root/corpus.txt``: 300 short documents."""
    import random

    model = tiny_model("llama", layers=layers)
    model.resize_token_embeddings(64)
    model.save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "north"]
    (root / "corpus.txt").write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(60)) for _ in range(300)))
    return root


def stir_decay_gates(hybrid, seed: int):
    """Give every decay gate of ``hybrid``'s linear layers random input weights (``0.3 N(0, 1)``, from ``seed``):
    each token then gets its own decay, so a decay applied to the wrong token shows. Returns ``hybrid``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in hybrid.linear_modules():
            if m.decay is not None:
                m.decay.weight.copy_(torch.randn(m.decay.weight.shape, generator=g) * 0.3)
    return hybrid


@contextlib.contextmanager
def recorded_crops():
    """While active, yield a list that records how many tokens each take-back of a recurrent layer's state removes
    (``LinearStateLayer.crop`` and ``DeltaStateLayer.crop``, what assisted and prompt-lookup decoding call for
    rejected drafts)."""
    from linearize.model.cache import DeltaStateLayer, LinearStateLayer

    taken_back: list[int] = []
    real = {cls: cls.crop for cls in (LinearStateLayer, DeltaStateLayer)}

    def spy(crop):
        def recorded(self, tokens_to_remove):
            taken_back.append(-tokens_to_remove)
            return crop(self, tokens_to_remove)
        return recorded

    for cls, crop in real.items():
        cls.crop = spy(crop)
    try:
        yield taken_back
    finally:
        for cls, crop in real.items():
            cls.crop = crop


def spy_micro_shapes(monkeypatch, stage_cls) -> list:
    """The shapes of the ``ids`` every ``stage_cls.micro`` pass gets (a training stage of linearize.train), in
    order, as a list filled while the stage runs."""
    shapes = []
    real = stage_cls.micro

    def spy(self, ids, parts):
        shapes.append(tuple(ids.shape))
        return real(self, ids, parts)

    monkeypatch.setattr(stage_cls, "micro", spy)
    return shapes


def check_checkpoint_round_trip(hybrid, recipe, out: Path, layer_check) -> None:
    """``hybrid`` saved to ``out`` loads with the package's class and with the bundled code (``trust_remote_code``);
    each loaded model's converted layers pass ``layer_check`` and it gives ``hybrid``'s logits and greedy tokens."""
    from transformers import AutoModelForCausalLM

    from linearize.io.checkpoint import save_checkpoint
    from linearize.model.modeling import LinearizeForCausalLM

    save_checkpoint(hybrid, char_tokenizer(), out, base="tiny", recipe=recipe)
    ids = torch.randint(0, 128, (1, 14))
    with torch.no_grad():
        want = hybrid.generate(ids, max_new_tokens=6, do_sample=False)
        for loaded in (LinearizeForCausalLM.from_pretrained(out).eval(),
                       AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()):
            assert layer_check(loaded.linear_modules())
            torch.testing.assert_close(loaded(ids).logits, hybrid(ids).logits)
            assert torch.equal(loaded.generate(ids, max_new_tokens=6, do_sample=False), want)

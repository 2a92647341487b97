"""The hybrid's softmax layers under SDPA (linearize.model.softmax_attention): a cache's unpadded continuation (the
pieces of a chunked prefill after the first) attends causally aligned to the bottom right without a mask tensor, and
gives the logits of one forward; padding, sliding windows, decode steps, training and the original model keep
transformers' own path."""

import inspect
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import FAMILIES, tiny_model
from torch.nn.attention.bias import CausalBias
from torch.overrides import TorchFunctionMode
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
from transformers.masking_utils import sdpa_mask as transformers_sdpa_mask

from linearize import recipe as R
from linearize.convert.selection import select_layout
from linearize.convert.surgery import linearize_model
from linearize.model import modeling, softmax_attention
from linearize.model.cache import softmax_windows
from linearize.model.layout import FULL

T, CHUNK, ROWS = 50, 13, 2  # pieces of 13, 13, 13, 11 tokens a row (26 over 2 rows): three continue a cache
CONTINUED = 3


class SDPACalls(TorchFunctionMode):
    """Records every ``scaled_dot_product_attention`` call as ``(queries, keys, mask, is_causal)``, the mask as
    ``"none"``, ``"bias"`` (torch's causal bias, no tensor) or ``"dense"``."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            kind = "none" if mask is None else "bias" if isinstance(mask, CausalBias) else "dense"
            self.calls.append((args[0].shape[2], args[1].shape[2], kind, bool(kwargs.get("is_causal", False))))
        return func(*args, **kwargs)

    def kinds(self, *, continued: bool) -> list[str]:
        """The masks of the calls whose queries continue a cache (fewer queries than keys, more than one)."""
        return [kind for q, kv, kind, _ in self.calls if (1 < q < kv) == continued]


def _hybrid(family="llama", ratio="1:1"):
    return linearize_model(tiny_model(family), select_layout(4, ratio=ratio),
                           R.load("lolcats", {"attention.window": 8}))


def _cache(out):
    return out.cache if getattr(out, "cache", None) is not None else getattr(out, "past_key_values", None)


def _close(got, want, what=""):
    """Equal within fp32 rounding: 1e-4 of the reference's largest magnitude."""
    assert got.shape == want.shape, what
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * max(1.0, want.abs().max().item()), (what, err)


def _softmax_layers(hybrid) -> tuple[int, int]:
    """How many of the hybrid's softmax layers run the mask-free path (SDPA, no sliding window, no logit soft-cap)
    and how many keep transformers' dense mask under SDPA (a sliding window; a soft-cap, which transformers 5.17's SDPA
    takes, 5.25's refuses)."""
    full = [i for i, t in enumerate(hybrid.config.hybrid_layer_types) if t == FULL]
    windows = softmax_windows(hybrid.config)
    if modeling._base_attention(hybrid.model.config, hybrid.config._attn_implementation) != softmax_attention.SDPA:
        return 0, 0  # eager families (Gemma 2 under transformers 5.25)
    if getattr(hybrid.model.config, "attn_logit_softcapping", None) is not None:
        return 0, len(full)
    return sum(windows[i] is None for i in full), sum(windows[i] is not None for i in full)


@pytest.mark.parametrize("family", FAMILIES)
def test_unpadded_pieces_run_without_a_mask(family):
    """Every family: a chunked prefill without padding (no mask, or a mask of ones) gives the logits of one forward
    and decodes on as after it; each piece after the first reaches SDPA with torch's causal bias and no mask tensor
    in every softmax layer without a sliding window, with transformers' dense mask in the sliding ones."""
    hybrid = _hybrid(family)
    ids = torch.randint(1, 128, (2, T), generator=torch.Generator().manual_seed(0))
    nxt = torch.randint(1, 128, (2, 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = hybrid(ids, use_cache=True, prefill_chunk_tokens=0)
        after_whole = hybrid(nxt, cache=_cache(whole)).logits
        plain, sliding = _softmax_layers(hybrid)
        for mask in (None, torch.ones_like(ids)):
            with SDPACalls() as spy:
                out = hybrid(ids, attention_mask=mask, use_cache=True, prefill_chunk_tokens=ROWS * CHUNK)
            _close(out.logits, whole.logits, (family, mask is None))
            assert sorted(spy.kinds(continued=True)) == ["bias"] * (CONTINUED * plain) + ["dense"] * (CONTINUED * sliding)
            step_mask = None if mask is None else torch.ones(2, T + 1, dtype=torch.long)
            _close(hybrid(nxt, attention_mask=step_mask, cache=_cache(out)).logits, after_whole, family)


def test_families_exercise_the_path():
    """The sweep above is not vacuous: the Llama-shaped hybrid runs its softmax layers mask-free, Gemma 3's (a
    sliding window in every layer of 4) and Gemma 2's (soft-capped) keep their own."""
    assert _softmax_layers(_hybrid("llama")) == (2, 0)
    assert _softmax_layers(_hybrid("gemma3_text")) == (0, 2)
    assert _softmax_layers(_hybrid("gemma2"))[0] == 0


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "cohere2"])
def test_left_padded_pieces_keep_the_dense_mask(family):
    """A left-padded batch: every piece after the first gets transformers' dense mask, and the logits of one
    forward at the real tokens."""
    hybrid = _hybrid(family)
    ids = torch.randint(1, 128, (2, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        whole = hybrid(ids, attention_mask=mask, position_ids=pos, prefill_chunk_tokens=0).logits
        with SDPACalls() as spy:
            out = hybrid(ids, attention_mask=mask, position_ids=pos, prefill_chunk_tokens=ROWS * CHUNK).logits
    _close(out[mask.bool()], whole[mask.bool()], family)
    plain, sliding = _softmax_layers(hybrid)
    assert spy.kinds(continued=True) == ["dense"] * (CONTINUED * (plain + sliding))


def test_decode_and_training_keep_transformers_path():
    """A decode step (one query) attends without a mask and without is_causal, as before; a training forward (the
    whole sequence, no cache, gradients) with is_causal and no mask, as before."""
    hybrid = _hybrid()
    ids = torch.randint(1, 128, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = _cache(hybrid(ids[:, :-1], use_cache=True))
        with SDPACalls() as spy:
            hybrid(ids[:, -1:], cache=cache)
    assert spy.calls == [(1, T, "none", False)] * 2
    hybrid.train()
    with SDPACalls() as spy:
        hybrid(ids, labels=ids, use_cache=False).loss.backward()
    assert spy.calls == [(T, T, "none", True)] * 2


def test_generate_is_unchanged(monkeypatch):
    """generate() over an unpadded batch, prefilled in pieces, gives the tokens and scores of transformers' own
    SDPA path (the hybrid's softmax layers under plain ``sdpa``)."""
    hybrid = _hybrid(ratio="3:1")
    hybrid.config.prefill_chunk_tokens = 21  # three rows: 7 tokens each
    ids = torch.randint(1, 128, (3, T), generator=torch.Generator().manual_seed(2))

    def run():
        with SDPACalls() as spy:
            out = hybrid.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                  return_dict_in_generate=True, output_logits=True)
        return out.sequences, torch.stack(out.logits, 1), spy

    tokens, logits, spy = run()
    assert spy.kinds(continued=True) == ["bias"] * 6  # one softmax layer; pieces 2 .. 7 of 7 tokens (the 8th is 1)
    monkeypatch.setattr(modeling, "attention_implementation", lambda impl: impl)  # transformers' sdpa, as before
    want_tokens, want_logits, spy = run()
    assert hybrid.model.config._attn_implementation == "sdpa" and spy.kinds(continued=True) == ["dense"] * 6
    assert torch.equal(tokens, want_tokens)
    _close(logits, want_logits)


def test_the_original_model_is_untouched():
    """Registering the hybrid's implementation changes nothing for a plain model under ``sdpa``: a continuation of
    its cache still gets transformers' dense mask."""
    _hybrid()(torch.ones(1, 4, dtype=torch.long))  # registers linearize_sdpa
    model = tiny_model("llama")
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = _cache(model(ids[:, :12], use_cache=True))
        key = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        with SDPACalls() as spy:
            model(ids[:, 12:], **{key: cache})
    assert spy.kinds(continued=True) == ["dense"] * 4


@pytest.mark.parametrize("as_they_are", [True, False])
def test_bottom_right_attention_equals_the_masked_one(as_they_are, monkeypatch):
    """The mask-free path (grouped KV heads as they are, or repeated as for the memory-efficient kernel; a softmax
    scale) equals SDPA with the dense bottom-right mask; with a position bias the dense mask is built and the bias
    added, as transformers adds it."""

    class Layer(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 2

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 12, 8, generator=g), torch.randn(2, 2, 12, 8, generator=g)
    dense = torch.ones(5, 12, dtype=torch.bool).tril(12 - 5)
    # on a CPU neither flash nor the memory-efficient kernel runs: the bias's fallback takes the heads as they are
    assert softmax_attention._heads_as_they_are(q, k, v, 0.0) == softmax_attention._BIAS_TAKES_GQA
    monkeypatch.setattr(softmax_attention, "_heads_as_they_are", lambda *a: as_they_are)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    want = F.scaled_dot_product_attention(q, kr, vr, attn_mask=dense, scale=0.3).transpose(1, 2)
    got, weights = softmax_attention.sdpa_attention(Layer(), q, k, v, None, scaling=0.3)
    _close(got, want)
    assert weights is None and got.shape == (2, 5, 4, 8)
    bias = torch.randn(1, 4, 5, 12, generator=g)
    want = F.scaled_dot_product_attention(q, kr, vr, attn_mask=bias.masked_fill(~dense, float("-inf"))).transpose(1, 2)
    _close(softmax_attention.sdpa_attention(Layer(), q, k, v, None, position_bias=bias)[0], want)


def test_mask_function():
    """No mask only for the plain causal mask over an unpadded continuation whose queries are the last keys;
    otherwise transformers' own mask, never None for 1 < queries < keys (a static cache's empty tail, a sliding
    window shorter than the keys, padding)."""
    kw = dict(batch_size=2, q_length=4, kv_length=10, q_offset=6, kv_offset=0)
    ones = torch.ones(2, 10, dtype=torch.bool)
    assert softmax_attention.sdpa_mask(**kw) is None
    assert softmax_attention.sdpa_mask(**kw, attention_mask=ones) is None
    padded = ones.clone()
    padded[1, 0] = False
    sliding = sliding_window_causal_mask_function(8)
    static = dict(kw, q_offset=0)  # queries at 0 .. 3 of 10 slots: transformers aligns them to the top left
    for args in (dict(kw, attention_mask=padded), dict(kw, mask_function=sliding, local_size=8),
                 dict(static, attention_mask=torch.cat([ones[:, :4], ~ones[:, 4:]], 1)),
                 dict(kw, allow_is_causal_skip=False)):
        got = softmax_attention.sdpa_mask(**args)
        want = transformers_sdpa_mask(**{**args, "allow_is_causal_skip": False})
        assert got is not None and torch.equal(got, want), args
    assert softmax_attention.sdpa_mask(batch_size=1, q_length=5, kv_length=5) is None  # is_causal, as transformers
    assert softmax_attention.sdpa_mask(batch_size=1, q_length=1, kv_length=5, q_offset=4) is None  # one query
    assert causal_mask_function is softmax_attention.causal_mask_function
    assert softmax_attention.attention_implementation("eager") == "eager"
    assert softmax_attention.attention_implementation("sdpa") == softmax_attention.SDPA


_NO_PACKAGE = (  # a process in which `import linearize` (and `import triton`) fail
    "import sys\n"
    "class _Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('linearize', 'triton'):\n"
    "            raise ImportError(name + ' is not installed here')\n"
    "sys.meta_path.insert(0, _Block())\n"
)


@pytest.mark.slow
def test_bundled_runtime_runs_without_a_mask(tmp_path):
    """A checkpoint loaded with trust_remote_code=True, without the package, registers its own copy of the
    implementation and prefills the pieces after the first without a mask, with the package's logits."""
    from conftest import char_tokenizer

    from linearize.io.checkpoint import save_checkpoint

    hybrid = _hybrid()
    save_checkpoint(hybrid, char_tokenizer(), tmp_path / "ckpt", base="tiny",
                    recipe=R.load("lolcats", {"attention.window": 8}))
    ids = torch.randint(1, 128, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hybrid(ids, prefill_chunk_tokens=0).logits
    torch.save({"ids": ids, "want": want}, tmp_path / "want.pt")
    code = _NO_PACKAGE + (
        "import torch\n"
        "import torch.nn.functional as F\n"
        "from torch.nn.attention.bias import CausalBias\n"
        "from torch.overrides import TorchFunctionMode\n"
        "from transformers import AutoModelForCausalLM\n"
        "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS\n"
        "class Spy(TorchFunctionMode):\n"
        "    n = 0\n"
        "    def __torch_function__(self, func, types, args=(), kwargs=None):\n"
        "        if func is F.scaled_dot_product_attention and isinstance((kwargs or {}).get('attn_mask'), CausalBias):\n"
        "            Spy.n += 1\n"
        "        return func(*args, **(kwargs or {}))\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'ckpt')!r}, trust_remote_code=True, "
        f"prefill_chunk_tokens={ROWS * CHUNK})\n"
        f"d = torch.load({str(tmp_path / 'want.pt')!r})\n"
        "with torch.no_grad(), Spy():\n"
        "    diff = (m(d['ids']).logits - d['want']).abs().max().item()\n"
        "fn = ALL_ATTENTION_FUNCTIONS[m.model.config._attn_implementation]\n"
        "print(m.model.config._attn_implementation, fn.__module__.rsplit('.', 1)[-1], Spy.n, diff)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    impl, module, calls, diff = res.stdout.split()[-4:]
    assert (impl, module, int(calls)) == (softmax_attention.SDPA, "linearize_softmax_attention", CONTINUED * 2)
    assert float(diff) <= 1e-5

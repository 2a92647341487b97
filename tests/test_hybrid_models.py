"""Surgery, hybrid forward, generation cache and checkpoints on tiny models of every family."""

import copy
import json
import subprocess
import sys

import pytest
import torch

from conftest import FAMILIES, char_tokenizer, recorded_crops, run_cli, stir_decay_gates, tiny_model
from test_distill import corpus  # noqa: F401 - the fixture is used by name
from linearize import recipe as R
from linearize.io.checkpoint import save_checkpoint, verify_checkpoint
from linearize.errors import OutputError
from linearize.convert.selection import select_layout
from linearize.convert.surgery import linearize_model

RECIPES = {"elu": None, "lolcats": {"attention.window": 8}}
# taking tokens back: the recipes above, their gated forms (a strong decay, half-life 4 tokens, so a decay
# replayed wrongly shows) and gated delta layers
GATED = {"attention.decay": "learned", "attention.decay_half_life": 4.0}
CROP_CASES = {name: (name, over) for name, over in RECIPES.items()} | {
    "elu-gated": ("elu", GATED), "lolcats-gated": ("lolcats", {**RECIPES["lolcats"], **GATED}), "gdn": ("gdn", None)}


def _crop_case(case: str, model, ratio: str):
    """``model`` converted per ``CROP_CASES[case]``; a gate gets input-dependent weights (each token its own decay)."""
    return stir_decay_gates(linearize_model(model, select_layout(4, ratio=ratio), R.load(*CROP_CASES[case])), 7)


def _cache(out):
    return out.cache if hasattr(out, "cache") and out.cache is not None else out.past_key_values


@pytest.mark.parametrize("family", FAMILIES)
def test_all_softmax_conversion_is_exact(family):
    model = tiny_model(family)
    ids = torch.randint(0, 128, (2, 40))
    ref = model(ids).logits
    hybrid = linearize_model(model, select_layout(4, ratio="0:1"), R.load("lolcats"))
    assert (hybrid(ids).logits - ref).abs().max().item() == 0.0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_prefill_then_decode_equals_full_forward(family, recipe):
    model = tiny_model(family)
    hybrid = linearize_model(model, select_layout(4, ratio="1:1"), R.load(recipe, RECIPES[recipe]))
    ids = torch.randint(0, 128, (2, 60))
    with torch.no_grad():
        full = hybrid(ids, use_cache=False).logits
        out = hybrid(ids[:, :40], use_cache=True)
        cache, logits = _cache(out), [out.logits]
        for t in range(40, 60):
            out = hybrid(ids[:, t : t + 1], cache=cache, use_cache=True)
            logits.append(out.logits)
        assert (torch.cat(logits, 1) - full).abs().max().item() <= 1e-4
        # a multi-token continuation (chunked prefill) matches too
        out = hybrid(ids[:, :25], use_cache=True)
        out2 = hybrid(ids[:, 25:], cache=_cache(out), use_cache=True)
        assert (torch.cat([out.logits, out2.logits], 1) - full).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_linear_layers_differ_from_softmax_and_modes(family):
    model = tiny_model(family)
    with torch.no_grad():  # norm weights and biases away from their initial values, so a misplaced norm shows
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    ids = torch.randint(0, 128, (1, 50))
    ref = model(ids).logits
    hybrid = linearize_model(model, select_layout(4, ratio="1:0"), R.load("elu"))
    assert (hybrid(ids).logits - ref).abs().max().item() > 1e-3
    hybrid.set_attention_mode("softmax")
    assert (hybrid(ids, use_cache=False).logits - ref).abs().max().item() <= 1e-5
    hybrid.set_attention_mode("distill")
    hybrid(ids, use_cache=False)
    pairs = [m.distill_pair for m in hybrid.linear_modules()]
    assert all(p is not None and p[0].shape == p[1].shape == (1, 50, 4, 16) for p in pairs)
    with pytest.raises(ValueError):
        hybrid.set_attention_mode("bogus")


@pytest.mark.parametrize("family", FAMILIES)
def test_generate(family):
    hybrid = linearize_model(tiny_model(family), select_layout(4, ratio="3:1"), R.load("lolcats", RECIPES["lolcats"]))
    ids = torch.randint(0, 128, (1, 12))
    out = hybrid.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 18)
    # greedy generation with the cache equals greedy decoding without it
    seq = ids
    for _ in range(6):
        nxt = hybrid(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)


def _generate(hybrid, ids, mask, **kw):
    out = hybrid.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0, return_dict_in_generate=True,
                          output_logits=True, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


@pytest.mark.parametrize("family", ["llama", "qwen3", "granite", "mixtral"])
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_batched_generation_with_left_padding(family, recipe, attn):
    """A left-padded batch generates what each prompt generates alone: the 5-token prompt's window ring (W = 8)
    holds padding for its first decode steps, the linear states must not see the padding at all."""
    hybrid = linearize_model(tiny_model(family), select_layout(4, ratio="3:1"), R.load(recipe, RECIPES[recipe]))
    hybrid.config._attn_implementation = attn
    torch.manual_seed(1)
    prompts = [torch.randint(1, 128, (1, n)) for n in (30, 5, 17)]
    alone = [_generate(hybrid, p, torch.ones_like(p), do_sample=False) for p in prompts]
    ids = torch.zeros(3, 30, dtype=torch.long)
    mask = torch.zeros(3, 30, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 30 - p.shape[1]:], mask[i, 30 - p.shape[1]:] = p[0], 1
    tokens, logits = _generate(hybrid, ids, mask, do_sample=False)
    for i, (tok, lg) in enumerate(alone):
        assert torch.equal(tokens[i], tok[0]), i
        assert (logits[i] - lg[0]).abs().max().item() <= 1e-4, i
    # beam search reorders the padded rows' states with the rest of the cache
    beams = [hybrid.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=6, num_beams=3, do_sample=False,
                             pad_token_id=0)[0, p.shape[1]:] for p in prompts]
    batched = hybrid.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    for i, b in enumerate(beams):
        assert torch.equal(batched[i, 30:], b), i


def test_left_padding_under_inference_mode():
    """Masks made under torch.inference_mode (pipelines, lm-eval, prompt-lookup drafts inside `linearize generate`)
    are inference tensors without a version counter: the padding is read from them all the same."""
    hybrid = linearize_model(tiny_model("llama"), select_layout(4, ratio="3:1"), R.load("lolcats", RECIPES["lolcats"]))
    torch.manual_seed(3)
    ids = torch.randint(1, 128, (2, 20))
    with torch.inference_mode():
        mask = torch.ones_like(ids)
        mask[1, :7] = 0
        tokens, logits = _generate(hybrid, ids, mask, do_sample=False)
    ref_tokens, ref_logits = _generate(hybrid, ids, mask.clone(), do_sample=False)
    assert torch.equal(tokens, ref_tokens) and (logits - ref_logits).abs().max().item() == 0.0


def test_padded_prefill_in_two_chunks():
    """A left-padded prompt fed to the cache in two pieces (the ring of the first still holding padding) gives the
    logits of its unpadded prompt in one piece."""
    hybrid = linearize_model(tiny_model("llama"), select_layout(4, ratio="1:0"), R.load("lolcats", RECIPES["lolcats"]))
    torch.manual_seed(2)
    prompt = torch.randint(1, 128, (1, 14))
    with torch.no_grad():
        ref = hybrid(prompt, use_cache=False).logits
        ids = torch.cat([torch.zeros(1, 6, dtype=torch.long), prompt], 1)
        mask = torch.cat([torch.zeros(1, 6, dtype=torch.long), torch.ones_like(prompt)], 1)
        pos = (mask.cumsum(1) - 1).clamp_min(0)  # what generate() passes: positions count real tokens only
        first = hybrid(ids[:, :10], attention_mask=mask[:, :10], position_ids=pos[:, :10], use_cache=True)
        second = hybrid(ids[:, 10:], attention_mask=mask, position_ids=pos[:, 10:], cache=_cache(first), use_cache=True)
    assert (torch.cat([first.logits[:, 6:], second.logits], 1) - ref).abs().max().item() <= 1e-4


def _recorded_run(hybrid, ids, mask, pieces):
    """Feed ``ids[:, :sum(pieces)]`` to a fresh recording cache in pieces of these lengths; return the cache."""
    cache = hybrid.new_cache()
    cache.activate_past_recording()
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    at = 0
    with torch.no_grad():
        for n in pieces:
            hybrid(ids[:, at:at + n], attention_mask=mask[:, :at + n], position_ids=pos[:, at:at + n], cache=cache,
                   use_cache=True)
            at += n
    return cache


@pytest.mark.parametrize("case", list(CROP_CASES))
@pytest.mark.parametrize("remove", [1, 4, 9, 13])
def test_crop_takes_tokens_back(case, remove):
    """crop(-r) after a padded prefill of 18, 9 single steps and a 4-token forward (31 tokens): the cache then
    continues exactly as one that never saw the last r tokens, also when they span several forwards and the
    window (W = 8) must be rebuilt from before them."""
    torch.manual_seed(3)
    hybrid = _crop_case(case, tiny_model("llama").double(), "1:1")
    ids = torch.randint(1, 128, (2, 34))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # row 1 is left-padded: its ring holds padding early on
    pieces = [18] + [1] * 9 + [4]
    cache = _recorded_run(hybrid, ids, mask, pieces)
    cache.crop(-remove)
    assert cache.get_seq_length() == 31 - remove
    kept = 31 - remove
    ref_pieces, left = [], kept
    for n in pieces:
        if left > 0:
            ref_pieces.append(min(n, left))
            left -= n
    ref = _recorded_run(hybrid, ids, mask, ref_pieces)
    new = torch.randint(1, 128, (2, 3))  # a different continuation than the tokens taken back
    m = torch.cat([mask[:, :kept], torch.ones_like(new)], 1)
    pos = (m.cumsum(1) - 1).clamp_min(0)[:, kept:]
    with torch.no_grad():
        a = hybrid(new, attention_mask=m, position_ids=pos, cache=cache, use_cache=True).logits
        b = hybrid(new, attention_mask=m, position_ids=pos, cache=ref, use_cache=True).logits
    assert (a - b).abs().max().item() <= (1e-9 if case in RECIPES else 1e-6)  # float32 log decays and betas


def test_crop_needs_recording_and_history():
    hybrid = linearize_model(tiny_model("llama"), select_layout(4, ratio="1:1"), R.load("lolcats", RECIPES["lolcats"]))
    ids = torch.randint(1, 128, (1, 12))
    with torch.no_grad():
        out = hybrid(ids, use_cache=True)
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        _cache(out).crop(-2)
    from linearize.model.cache import CROP_TOKENS

    cache = _recorded_run(hybrid, torch.randint(1, 128, (1, CROP_TOKENS + 40)), torch.ones(1, CROP_TOKENS + 40,
                                                                                            dtype=torch.long),
                          [CROP_TOKENS + 40])
    for layer in cache.layers:  # the history holds its last window + CROP_TOKENS tokens, not views of the prompt
        for t in getattr(layer, "history", None) or ():
            assert t.shape[1] == 8 + CROP_TOKENS and t.untyped_storage().nbytes() == t.nbytes
    cache.crop(-CROP_TOKENS)  # as far back as the history reaches
    with pytest.raises(RuntimeError, match=f"at most its last {CROP_TOKENS} tokens"):
        cache.crop(-30)


@pytest.mark.parametrize("case", list(CROP_CASES))
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_assisted_and_prompt_lookup_decoding_equal_greedy(case, family):
    """Speculative decoding through generate(): drafts from a prompt lookup (whose rejected drafts are taken back
    from the hybrid's cache, 3 and 6 tokens at a time) and from a hybrid assistant model give greedy's tokens; with
    Gemma 3 the softmax layer slides (16 tokens, here passed), so its own cache is cropped too."""
    main = _crop_case(case, tiny_model(family, seed=0).double(), "3:1")
    helper = _crop_case(case, tiny_model(family, seed=1).double(), "1:0")
    torch.manual_seed(0)
    ids = torch.randint(1, 128, (1, 20))
    greedy = main.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    g = greedy[0, -1].item()  # the token this random model repeats: a bait for the prompt lookup
    prompt = torch.cat([ids, torch.tensor([[g, g, g, 5, 6, 7, 8, 9, 10, 11]]), ids[:, :5]], 1)
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False)
    want = main.generate(prompt, **kw)
    with recorded_crops() as taken_back:
        assert torch.equal(main.generate(prompt, prompt_lookup_num_tokens=6, **kw), want)
        assert torch.equal(main.generate(prompt, assistant_model=helper, **kw), want)
    assert max(taken_back) >= 3


def test_real_tokens_from_attention_masks():
    from linearize.model.attention import real_tokens

    pad = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert real_tokens(None, 4) is None and real_tokens(pad, 1) is None
    assert torch.equal(real_tokens(pad, 4), pad.bool())
    assert real_tokens(pad, 2) is None  # the last two tokens are real in both rows
    causal = torch.ones(4, 6, dtype=torch.bool).tril(2)  # 2 cached tokens, 4 new ones
    four_d = causal.expand(2, 1, 4, 6).clone()
    four_d[0, 0, :, :3] = False  # row 0: the first cached token and the first new one are padding
    four_d[0, 0, 0] = False
    assert torch.equal(real_tokens(four_d, 4), torch.tensor([[False, True, True, True], [True, True, True, True]]))
    additive = torch.zeros(2, 1, 4, 6).masked_fill(~four_d, torch.finfo(torch.float32).min)
    assert torch.equal(real_tokens(additive, 4), real_tokens(four_d, 4))
    assert real_tokens(causal.expand(2, 1, 4, 6), 4) is None


def test_padding_is_read_once_per_mask_and_model(monkeypatch):
    """The converted layers of one model share one reader of the padding mask: the first layer of a forward reads
    it, the others reuse the answer until the mask (or its in-place version) changes; two models share nothing."""
    from linearize.model import attention

    reads = []
    real = attention.real_tokens
    monkeypatch.setattr(attention, "real_tokens", lambda mask, T: reads.append(T) or real(mask, T))
    a, b = (linearize_model(tiny_model("llama"), select_layout(4, ratio="1:0"), R.load("elu")) for _ in range(2))
    readers = {id(m.real_tokens) for m in a.linear_modules()}
    assert len(readers) == 1 and not readers & {id(m.real_tokens) for m in b.linear_modules()}
    ids = torch.randint(1, 128, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    with torch.no_grad():
        want = a(ids, attention_mask=mask).logits
        assert len(reads) == 1  # four linear layers, one read
        b(ids, attention_mask=mask)
        assert len(reads) == 2
    padded = a.model.layers[0].self_attn.real_tokens
    m4 = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    first = padded(m4, 6)
    m4[0, 0, 1] = False  # in place: the answer is read again
    assert first is None and torch.equal(padded(m4, 6)[0], torch.tensor([True, False, True, True, True, True]))
    assert len(reads) == 4
    twin = copy.deepcopy(a)  # its layers share one reader of their own, which starts with no answer
    assert len({id(m.real_tokens) for m in twin.linear_modules()}) == 1 and padded._last[0] is not None
    assert twin.model.layers[0].self_attn.real_tokens._last == (None, None, None)
    with torch.no_grad():
        assert torch.equal(twin(ids, attention_mask=mask).logits, want)
    assert len(reads) == 5


def _tiny_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(127)}
    vocab["[UNK]"] = 127
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="w0")


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_checkpoint_round_trip(tmp_path, family):
    from linearize.model.modeling import LinearizeForCausalLM

    hybrid = linearize_model(tiny_model(family), select_layout(4, ratio="3:1"), R.load("lolcats", RECIPES["lolcats"]))
    with torch.no_grad():  # make the learned parts non-trivial so the round trip is checked
        for m in hybrid.linear_modules():
            for p in list(m.feature_map_q.parameters()) + [m.window_logit]:
                p.add_(0.1 * torch.randn_like(p))
    out = tmp_path / "ckpt"
    save_checkpoint(hybrid, _tiny_tokenizer(tmp_path), out, base="tiny", recipe=R.load("lolcats", RECIPES["lolcats"]),
                    max_shard_bytes=200_000)
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 1 and all(n.startswith("model-") and f"-of-{len(shards):05d}" in n for n in shards)
    for required in ("config.json", "model.safetensors.index.json", "tokenizer.json", "generation_config.json",
                     "linearize_recipe.yaml", "README.md", "report.json", "report.md", "modeling_linearize.py",
                     "configuration_linearize.py"):
        assert required in names
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == cfg["base_model_type"] == family  # the tokenizer loads as the original's
    assert cfg["architectures"] == ["LinearizeForCausalLM"]
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_linearize.LinearizeForCausalLM"
    assert not any(p.name.startswith(".ckpt") for p in tmp_path.iterdir())  # no temporary left behind
    verify_checkpoint(out, hashes=True)
    loaded = LinearizeForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 128, (1, 30))
    with torch.no_grad():
        assert (loaded(ids).logits - hybrid(ids).logits).abs().max().item() <= 1e-6
    with pytest.raises(OutputError, match="already exists"):
        save_checkpoint(hybrid, _tiny_tokenizer(tmp_path), out, base="tiny", recipe=R.load("elu"))
    # a truncated shard is named
    shard = out / shards[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(OutputError, match=shards[0]):
        verify_checkpoint(out)
    from linearize.io.sources import load_model

    with pytest.raises(OutputError, match="truncated or edited"):
        load_model(str(out), device="cpu")


# a fresh interpreter in which `import linearize` (and `import triton`) fail, as on a CPU-only machine without
# the package
_NO_PACKAGE = (
    "import sys\n"
    "class _Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('linearize', 'triton'):\n"
    "            raise ImportError(name + ' is not installed here')\n"
    "sys.meta_path.insert(0, _Block())\n"
)


@pytest.mark.parametrize("family,recipe", [("llama", "elu"), ("qwen3", "lolcats"), ("qwen2", "hedgehog")])
def test_trust_remote_code_without_the_package(tmp_path, family, recipe):
    """The checkpoint carries its modeling code: a process that cannot import linearize (nor triton) loads it with
    trust_remote_code=True and computes the same logits (prefill and cached decode) as the package's class."""
    rec = R.load(recipe, {"attention.window": 4} if recipe == "lolcats" else {})
    hybrid = linearize_model(tiny_model(family), select_layout(4, ratio="1:1"), rec)
    out = tmp_path / "ckpt"
    save_checkpoint(hybrid, _tiny_tokenizer(tmp_path), out, base="tiny", recipe=rec)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hybrid(ids).logits
        greedy = hybrid.generate(ids[:, :6], max_new_tokens=6, do_sample=False)
    torch.save({"ids": ids, "want": want, "greedy": greedy}, tmp_path / "want.pt")
    code = _NO_PACKAGE + (
        "import torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
        f"d = torch.load({str(tmp_path / 'want.pt')!r})\n"
        "with torch.no_grad():\n"
        "    diff = (m(d['ids']).logits - d['want']).abs().max().item()\n"
        "    same = torch.equal(m.generate(d['ids'][:, :6], max_new_tokens=6, do_sample=False), d['greedy'])\n"
        "print(type(m).__module__.split('.')[0], type(m).__name__, diff, same, 'linearize' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    where, name, diff, same, imported = res.stdout.split()[-5:]
    assert (where, name, same, imported) == ("transformers_modules", "LinearizeForCausalLM", "True", "False")
    assert float(diff) <= 1e-5


@pytest.mark.parametrize("mode,expect", [("decode", (False, True)), ("maps", (False, True)), ("all", (True, True)),
                                         ("none", (False, False))])
def test_fused_feature_maps_setting(mode, expect):
    """The kernel option fused_feature_maps: which calls of a Hedgehog layer (prefill, decode step) compute the
    features in the kernel on a GPU; never with gradients, on CPU tensors, or for elu layers."""
    from types import SimpleNamespace

    hybrid = linearize_model(tiny_model("llama"), select_layout(4, ratio="1:1"), R.load("lolcats"))
    hybrid.set_kernel_options(fused_feature_maps=mode)
    assert hybrid.config.fused_feature_maps == mode
    layer = next(iter(hybrid.linear_modules()))
    on_gpu = SimpleNamespace(is_cuda=True, requires_grad=False)
    with torch.no_grad():
        assert (layer.fused_features(on_gpu, on_gpu, False), layer.fused_features(on_gpu, on_gpu, True)) == expect
        assert not layer.fused_features(torch.zeros(1), torch.zeros(1), True)
    assert not layer.fused_features(on_gpu, on_gpu, True)  # gradients enabled: the maps are trainable
    # the standalone map kernel for prefill features: "maps" and "all", Hedgehog maps on a GPU only
    assert layer.map_in_kernel(layer.feature_map_q, on_gpu) == (mode in ("maps", "all"))
    assert not layer.map_in_kernel(layer.feature_map_q, torch.zeros(1))
    elu = next(iter(linearize_model(tiny_model("llama"), select_layout(4, ratio="1:1"), R.load("elu")).linear_modules()))
    with torch.no_grad():
        assert not elu.fused_features(on_gpu, on_gpu, True)
    assert not elu.map_in_kernel(elu.feature_map_q, on_gpu)


def test_kernel_options_live_in_the_config(tmp_path, monkeypatch):
    """fused_feature_maps and rotary_backend are config fields passed to the layers when the model is built (saved
    with the checkpoint, overridable at load); the environment variable that used to set the first changes
    nothing; unknown values and names are refused."""
    from linearize.model.modeling import LinearizeConfig, LinearizeForCausalLM

    monkeypatch.setenv("LINEARIZE_FUSED_FEATURE_MAPS", "none")
    hybrid = linearize_model(tiny_model("llama"), select_layout(4, ratio="1:1"), R.load("lolcats"))
    assert hybrid.kernel_options() == {"fused_feature_maps": "maps", "rotary_backend": None, "norm_backend": None}
    assert {(m.fused_feature_maps, m.rotary_backend) for m in hybrid.linear_modules()} == {("maps", None)}
    hybrid.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["fused_feature_maps"], saved["rotary_backend"]) == ("maps", None)
    assert "fused_feature_maps" not in hybrid.config.base_config().to_dict()
    loaded = LinearizeForCausalLM.from_pretrained(tmp_path, fused_feature_maps="decode", rotary_backend="torch")
    assert {(m.fused_feature_maps, m.rotary_backend) for m in loaded.linear_modules()} == {("decode", "torch")}
    with pytest.raises(ValueError, match="fused_feature_maps='1': expected one of none, decode, maps, all"):
        LinearizeConfig(fused_feature_maps="1")
    with pytest.raises(ValueError, match="rotary_backend='cuda'"):
        hybrid.set_kernel_options(rotary_backend="cuda")
    with pytest.raises(TypeError, match="unknown kernel option 'fused'"):
        hybrid.set_kernel_options(fused="all")
    with pytest.raises(ValueError, match="norm_backend='fused'"):
        hybrid.set_kernel_options(norm_backend="fused")
    assert hybrid.kernel_options() == {"fused_feature_maps": "maps", "rotary_backend": None,
                                       "norm_backend": None}  # nothing half-applied
    assert {(m.fused_feature_maps, m.rotary_backend) for m in hybrid.linear_modules()} == {("maps", None)}


def test_bundled_remote_code_is_complete():
    """Every bundled file compiles and imports only bundled files or the standard stack; an import of a module
    that is not bundled is refused when the checkpoint is written, not when a user loads it."""
    import ast

    from linearize import bundle

    files = bundle.remote_code_files()
    assert {"configuration_linearize.py", "modeling_linearize.py"} <= set(files)
    for name, text in files.items():
        for node in ast.walk(ast.parse(text, name)):
            if isinstance(node, ast.ImportFrom) and node.level:
                targets = [node.module] if node.module else [a.name for a in node.names]
                assert all(f"{t}.py" in files for t in targets), (name, targets)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                assert not any(m.split(".")[0] == "linearize" for m in mods), (name, mods)
    with pytest.raises(RuntimeError, match="surgery"):
        bundle._rewrite("linearize.model.attention", "from .surgery import linearize_model\n")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_families_train_both_stages(family, corpus, monkeypatch, tmp_path):
    """Attention transfer then LoRA on a mixture-of-experts model: held-out MSE and perplexity fall, and only the
    attention side learns (experts, routers and everything else outside attention stay bit for bit)."""
    from linearize.train import distill as D
    from linearize.train import finetune as FT

    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    model = tiny_model(family, layers=2)
    model.resize_token_embeddings(64)
    both = {"data": corpus, "seq_len": 64, "batch_size": 2, "tokens": 64 * 2 * 20, "warmup_steps": 1, "eval_seqs": 4}
    over = {f"{stage}.{k}": v for stage in ("distill", "finetune") for k, v in both.items()}
    rec = R.load("lolcats", {**over, "attention.window": 8, "distill.lr": 3e-2, "finetune.lr": 1e-2,
                             "finetune.loss": "xent"})
    hybrid = linearize_model(model, select_layout(2, ratio="1:0"), rec)
    untouched = {n: p.detach().clone() for n, p in hybrid.named_parameters() if ".self_attn." not in n}
    assert any(".experts." in n for n in untouched) and any(".gate." in n for n in untouched)
    quiet = dict(progress=False, log=lambda m: None)
    rep = D.distill(hybrid, char_tokenizer(), rec, **quiet)
    assert rep["heldout_mse_end_mean"] < rep["heldout_mse_start_mean"]
    out, rep = FT.finetune(hybrid, char_tokenizer(), rec, loss="xent", **quiet)
    assert rep["heldout_ppl_end"] < rep["heldout_ppl_start"]
    after = dict(out.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in untouched.items())


@pytest.mark.parametrize("recipe", ["performer", "taylor"])
def test_feature_maps_start_from_the_models_softmax_scale(recipe):
    """Granite's softmax scale (attention_multiplier 0.5 in the tiny model, not 1/sqrt(16)) reaches the maps that
    approximate exp(s q.k) from the start; it is not a recipe field."""
    hybrid = linearize_model(tiny_model("granite"), select_layout(4, ratio="1:0"), R.load(recipe))
    for m in hybrid.linear_modules():
        assert m.scaling == 0.5 and m.feature_map_q.softmax_scale == m.feature_map_k.softmax_scale == 0.5
    assert "softmax_scale" not in R.load(recipe)["attention"]


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "phi3", "olmo", "stablelm", "starcoder2", "glm4_moe",
                                    "smollm3", "glm4", "cohere"])
def test_newer_families_train_both_stages(family, corpus, monkeypatch, tmp_path):
    """Attention transfer (with Hedgehog's attention loss, on the teacher's windowed, soft-capped weights) then
    LoRA on 64-token rows, longer than the tiny Gemmas' (and Starcoder2's) 16-token sliding windows: held-out MSE
    and perplexity fall. Phi-3's LoRA goes on its fused qkv_proj and o_proj (finetune checks what peft wrapped);
    OLMo's q/k/v bound, StableLM's per-head LayerNorms, GLM-4.5's q/k norms, SmolLM3's layers without rotary and
    GLM-4's and Cohere's interleaved rotary are in the layers that train."""
    from linearize.train import distill as D
    from linearize.train import finetune as FT

    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    model = tiny_model(family, layers=2)
    model.resize_token_embeddings(64)
    both = {"data": corpus, "seq_len": 64, "batch_size": 2, "tokens": 64 * 2 * 20, "warmup_steps": 1, "eval_seqs": 4}
    over = {f"{stage}.{k}": v for stage in ("distill", "finetune") for k, v in both.items()}
    rec = R.load("hedgehog", {**over, "distill.lr": 3e-2, "finetune.lr": 1e-2, "finetune.loss": "xent"})
    assert rec["distill"]["xent_weight"] > 0
    hybrid = linearize_model(model, select_layout(2, ratio="1:0"), rec)
    quiet = dict(progress=False, log=lambda m: None)
    rep = D.distill(hybrid, char_tokenizer(), rec, **quiet)
    assert rep["heldout_mse_end_mean"] < rep["heldout_mse_start_mean"]
    _, rep = FT.finetune(hybrid, char_tokenizer(), rec, loss="xent", **quiet)
    assert rep["heldout_ppl_end"] < rep["heldout_ppl_start"]


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_teacher_keeps_sliding_window_and_softcap(family, monkeypatch):
    """The teacher's logits (Hedgehog's loss, the retrieval probe) give the teacher's output, which equals the
    original layer's (test_linear_layers_differ_from_softmax_and_modes): the base layer's sliding window (16
    tokens here, shorter than the 40-token input) and Gemma 2's soft-cap are in both."""
    hybrid = linearize_model(tiny_model(family), select_layout(4, ratio="1:0"), R.load("elu"))
    ids = torch.randint(0, 128, (2, 40))
    seen = {}

    def grab(module, args, kwargs):
        seen[module.layer_idx] = module.project(kwargs["hidden_states"], kwargs["position_embeddings"])

    handles = [m.register_forward_pre_hook(grab, with_kwargs=True) for m in hybrid.linear_modules()]
    hybrid.set_attention_mode("softmax")
    with torch.no_grad():
        hybrid(ids, use_cache=False)
    for h in handles:
        h.remove()
    windows = [m.teacher_window for m in hybrid.linear_modules()]
    assert windows == ([16, None, 16, None] if family == "gemma2" else [16] * 4)
    for m in hybrid.linear_modules():
        q, k, v = seen[m.layer_idx]
        weights = m.teacher_logits(q, k).softmax(-1)  # [B, H, T, T]
        if m.teacher_window:  # query 30 looks at keys 15 .. 30 only
            assert weights[:, :, 30, :15].abs().max().item() == 0.0 < weights[:, :, 30, 15].min().item()
        vh = v.transpose(1, 2).repeat_interleave(2, dim=1)
        via_logits = (weights @ vh).transpose(1, 2)
        assert (via_logits - m.softmax_attention(q, k, v)).abs().max().item() <= 1e-5
    if family == "gemma2":  # the soft-capped teacher in blocks of query rows equals it in one block
        from linearize.model import attention

        whole = [m.softmax_attention(*seen[m.layer_idx]) for m in hybrid.linear_modules()]
        monkeypatch.setattr(attention, "TEACHER_BLOCK_SCORES", 2 * 4 * 40 * 7)  # 7 query rows per block
        for m, w in zip(hybrid.linear_modules(), whole):
            assert (m.softmax_attention(*seen[m.layer_idx]) - w).abs().max().item() <= 1e-6


def test_sliding_softmax_layers_keep_only_their_window():
    """A softmax layer that slides in the base model (every layer of a 4-layer Gemma 3) caches only its window, as
    the original's cache does, and the cache-size formula counts it so."""
    from linearize.bench.costs import cache_bytes

    hybrid = linearize_model(tiny_model("gemma3_text"), select_layout(4, ratio="1:1"), R.load("elu"))
    ids = torch.randint(0, 128, (1, 50))
    with torch.no_grad():
        cache = _cache(hybrid(ids, use_cache=True))
    kv = [layer for layer in cache.layers if type(layer).__name__ == "DynamicSlidingWindowLayer"]
    assert len(kv) == 2 and all(layer.keys.shape[2] < 50 for layer in kv)
    per_layer = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head_dim 16, fp32
    sizes, one_token = cache_bytes(hybrid.config, 4096, dtype_bytes=4), cache_bytes(hybrid.config, 1, dtype_bytes=4)
    states = one_token["hybrid"] - 2 * per_layer  # the two linear layers' states do not grow
    assert sizes["original"] == 4 * 16 * per_layer
    assert sizes["hybrid"] == 2 * 16 * per_layer + states


def _tiny_vision_language_model(family: str, root, seed: int = 0):
    """A tiny random Gemma 3 or Mistral 3 vision-language model saved in ``root`` with a character tokenizer
    (text decoder: 4 layers as :func:`tiny_model`; a one-layer vision tower)."""
    import transformers

    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    if family == "gemma3":  # every text layer but the sixth slides (over 16 tokens here)
        cfg = transformers.Gemma3Config(text_config=dict(text, sliding_window=16), vision_config=vision,
                                        mm_tokens_per_image=4, image_token_index=127, boi_token_index=125,
                                        eoi_token_index=126)
        cls = transformers.Gemma3ForConditionalGeneration
    else:  # Mistral 3 ties the word embeddings through its outer config (its text config says untied)
        cfg = transformers.Mistral3Config(text_config=dict(text, model_type="mistral"),
                                          vision_config=dict(vision, model_type="pixtral", head_dim=16),
                                          image_token_index=127)
        cls = transformers.Mistral3ForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.save_pretrained(root)
    char_tokenizer().save_pretrained(root)
    return model


@pytest.mark.parametrize("family", ["gemma3", "mistral3"])
def test_vision_language_models_convert_their_text_decoder(family, tmp_path):
    """Gemma 3 from 4B up and Mistral 3 load as their text causal LM (the vision tower is not loaded), whose
    logits on text equal the vision-language model's; the conversion, its plan and a hybrid round trip work on
    it, and a checkpoint lacking a text weight is one line naming it."""
    import safetensors.torch
    from transformers import AutoModelForCausalLM

    from linearize.errors import SpecError
    from linearize.bench.info import model_info
    from linearize.io.sources import load_model
    from linearize.convert.surgery import check_config_supported

    vlm = _tiny_vision_language_model(family, tmp_path / "vlm")
    ids = torch.randint(0, 120, (2, 40))
    with torch.no_grad():
        expected = vlm(input_ids=ids).logits
    text_type = {"gemma3": "gemma3_text", "mistral3": "mistral"}[family]
    assert check_config_supported(vlm.config, "vlm") == text_type
    model, _ = load_model(str(tmp_path / "vlm"), device="cpu", dtype="float32")
    assert model.config.model_type == text_type and not any("vision" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max().item() <= 1e-5
    plan = model_info(str(tmp_path / "vlm"), ratio="1:1")
    assert plan["model_type"] == text_type and plan["num_layers"] == 4
    note = f"{family} is a vision-language model: its text decoder is loaded and converted"
    assert plan["note"].startswith(note)
    proc = run_cli("convert", str(tmp_path / "vlm"), "--ratio", "0:1", "--no-train", "--dtype", "float32", "-o",
                   str(tmp_path / "out"))
    assert proc.returncode == 0 and note in proc.stdout + proc.stderr, proc.stderr[-2000:]
    hybrid = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    assert hybrid.config.base_model_type == text_type
    with torch.no_grad():
        assert (hybrid(ids).logits - expected).abs().max().item() <= 1e-5
    # a text weight missing from the checkpoint
    shard = tmp_path / "vlm" / "model.safetensors"
    weights = safetensors.torch.load_file(shard)
    name = next(k for k in weights if k.endswith("model.norm.weight") and "vision" not in k)
    del weights[name]
    safetensors.torch.save_file(weights, shard, metadata={"format": "pt"})
    with pytest.raises(SpecError) as err:
        load_model(str(tmp_path / "vlm"), device="cpu")
    assert "lacks 1 weights of its text decoder (first: model.norm.weight)" in str(err.value)


@pytest.mark.parametrize("model_type,why", [("gpt_oss", "sinks"), ("minimax_m2", None)])
def test_unsupported_families_are_refused_in_one_line(model_type, why):
    """Families whose attention the converted layers do not compute are refused before any weight is read, saying
    why where that is known; the supported ones are listed."""
    from transformers import AutoConfig

    from linearize.errors import UnsupportedModelError
    from linearize.convert.surgery import check_config_supported

    config = AutoConfig.for_model(model_type)
    with pytest.raises(UnsupportedModelError) as err:
        check_config_supported(config, "m")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"m: model type '{model_type}'") and "olmo3" in msg
    assert (why in msg) if why else ("is not supported (supported:" in msg)

"""Chunked prefill (linearize.model.prefill): a long inference forward as consecutive cached forwards of
``prefill_chunk_tokens`` tokens gives the logits and the cache of one whole forward, for every family."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import FAMILIES, tiny_model

from linearize import recipe as R
from linearize.convert.selection import select_layout
from linearize.convert.surgery import linearize_model
from linearize.model import modeling
from linearize.model.prefill import PREFILL_CHUNK_TOKENS, kept_positions, row_chunk

#: linear layers without a window (elu) and window-hybrid layers over 8 tokens (lolcats)
RECIPES = {"elu": None, "lolcats": {"attention.window": 8}}
T = 50


def _hybrid(family="llama", recipe="lolcats", ratio="1:1", seed=0):
    rec = R.load(recipe, RECIPES[recipe])
    return linearize_model(tiny_model(family, seed=seed), select_layout(4, ratio=ratio), rec)


def _cache(out):
    return out.cache if getattr(out, "cache", None) is not None else getattr(out, "past_key_values", None)


def _close(got, want, what=""):
    """Equal within fp32 rounding: 1e-4 of the reference's largest magnitude."""
    assert got.shape == want.shape, what
    err = (got - want).abs().max().item() if want.numel() else 0.0
    assert err <= 1e-4 * max(1.0, want.abs().max().item() if want.numel() else 0.0), (what, err)


def _padded(n_rows=2, pad=9, seed=1):
    """``T`` token ids, the last row left-padded by ``pad`` tokens; the mask and the positions generate() passes."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (n_rows, T), generator=gen)
    mask = torch.ones_like(ids)
    mask[-1, :pad] = 0
    ids[-1, :pad] = 0
    return ids, mask, (mask.cumsum(1) - 1).clamp_min(0)


@pytest.fixture
def count_chunked(monkeypatch):
    """A list that records the chunk size of every chunked forward while the test runs."""
    seen = []
    real = modeling.chunked_forward

    def spy(step, chunk, **kw):
        seen.append(chunk)
        return real(step, chunk, **kw)

    monkeypatch.setattr(modeling, "chunked_forward", spy)
    return seen


@pytest.mark.parametrize("family,recipe", [(f, "lolcats") for f in FAMILIES] + [
    (f, "elu") for f in ("llama", "gemma2", "gemma3_text", "phi3", "qwen3_moe", "starcoder2", "cohere2")])
def test_chunked_prefill_equals_one_forward(family, recipe, count_chunked):
    """Odd chunk sizes over a left-padded batch of 50 tokens (GQA, softmax and linear layers, with the window of 8
    in every family and without a window in some, the base layers' sliding windows of 16 crossing chunk
    boundaries): the logits and the cache of one forward; the cache then decodes as the one-forward cache does."""
    hybrid = _hybrid(family, recipe)
    ids, mask, pos = _padded()
    real = mask.bool()
    nxt = torch.randint(1, 128, (2, 1), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = hybrid(ids, attention_mask=mask, position_ids=pos, use_cache=True, prefill_chunk_tokens=0)
        step_mask, step_pos = torch.cat([mask, torch.ones_like(nxt)], 1), pos[:, -1:] + 1
        after_whole = hybrid(nxt, attention_mask=step_mask, position_ids=step_pos, cache=_cache(whole)).logits
        for chunk in (7, 13):  # tokens per row: budgets of 14 and 26 over the two rows
            out = hybrid(ids, attention_mask=mask, position_ids=pos, use_cache=True, prefill_chunk_tokens=2 * chunk)
            _close(out.logits[real], whole.logits[real], (family, chunk))
            assert _cache(out).get_seq_length() == T
            after = hybrid(nxt, attention_mask=step_mask, position_ids=step_pos, cache=_cache(out)).logits
            _close(after, after_whole, (family, chunk, "decode"))
    assert count_chunked == [7, 13]


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa"),
                                         ("gemma3_text", "sdpa"), ("starcoder2", "eager"), ("cohere2", "sdpa")])
def test_chunked_continuation_of_a_cache(family, attn, count_chunked):
    """A cache that already holds 11 tokens continues over 39 more in pieces of 7: the logits of those 39 in one
    forward (sliding softmax windows of Gemma 3, Starcoder 2 and Command R7B included; SDPA's and eager masks)."""
    hybrid = _hybrid(family)
    hybrid.config._attn_implementation = attn
    ids, mask, pos = _padded(pad=4)
    with torch.no_grad():
        whole = hybrid(ids, attention_mask=mask, position_ids=pos, use_cache=False, prefill_chunk_tokens=0).logits
        first = hybrid(ids[:, :11], attention_mask=mask[:, :11], position_ids=pos[:, :11], use_cache=True)
        rest = hybrid(ids[:, 11:], attention_mask=mask, position_ids=pos[:, 11:], cache=_cache(first),
                      use_cache=True, prefill_chunk_tokens=14)  # two rows: 7 tokens each
    _close(rest.logits, whole[:, 11:])
    assert _cache(rest).get_seq_length() == T and count_chunked == [7]


@pytest.mark.parametrize("window", [0, 8])
def test_gated_layers_prefill_in_chunks(window, count_chunked):
    """Gated linear layers (attention.decay: learned, a half-life of 4 tokens so that a decay missed at a chunk
    boundary shows) carry their decayed state across pieces: the logits of one forward, left padding included."""
    rec = R.load("lolcats", {"attention.window": window, "attention.decay": "learned",
                             "attention.decay_half_life": 4.0})
    hybrid = linearize_model(tiny_model("llama"), select_layout(4, ratio="3:1"), rec)
    g = torch.Generator().manual_seed(1)
    for m in hybrid.linear_modules():  # an input-dependent gate
        m.decay.weight.data = torch.randn(m.decay.weight.shape, generator=g) * 0.3
    ids, mask, pos = _padded()
    with torch.no_grad():
        whole = hybrid(ids, attention_mask=mask, position_ids=pos, prefill_chunk_tokens=0).logits
        out = hybrid(ids, attention_mask=mask, position_ids=pos, prefill_chunk_tokens=14).logits  # 7 per row
    _close(out[mask.bool()], whole[mask.bool()])
    assert count_chunked == [7]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_gated_delta_layers_prefill_in_chunks(family, count_chunked):
    """Gated delta rule layers (the gdn recipe) carry their state across pieces: the logits of one forward, left
    padding included."""
    hybrid = linearize_model(tiny_model(family), select_layout(4, ratio="1:1"), R.load("gdn"))
    assert "gated_delta" in hybrid.config.hybrid_layer_types
    ids, mask, pos = _padded()
    with torch.no_grad():
        whole = hybrid(ids, attention_mask=mask, position_ids=pos, prefill_chunk_tokens=0).logits
        out = hybrid(ids, attention_mask=mask, position_ids=pos, prefill_chunk_tokens=14).logits  # 7 per row
    _close(out[mask.bool()], whole[mask.bool()])
    assert count_chunked == [7]


def test_logits_to_keep_and_use_cache():
    """logits_to_keep keeps its meaning over pieces: the last n positions (1: the last piece's last logit only; a
    span across two pieces; 0: all), 1-D tensors of positions (negative ones, any order) and of booleans;
    use_cache=False returns no cache, use_cache=True the filled one; return_dict=False a tuple."""
    hybrid = _hybrid()
    ids = torch.randint(0, 128, (2, T))
    with torch.no_grad():
        full = hybrid(ids, use_cache=False, prefill_chunk_tokens=0).logits
        for keep, want in [(1, full[:, -1:]), (5, full[:, -5:]), (0, full), (T + 3, full),
                           (torch.tensor([3, -1, 20, 7, 3]), full[:, [3, T - 1, 20, 7, 3]]),
                           (torch.arange(T) % 6 == 0, full[:, ::6]), (torch.tensor([], dtype=torch.long), full[:, :0])]:
            out = hybrid(ids, use_cache=False, logits_to_keep=keep, prefill_chunk_tokens=14)  # 7 per row
            _close(out.logits, want, keep)
            assert _cache(out) is None
        out = hybrid(ids, use_cache=True, logits_to_keep=1, prefill_chunk_tokens=26)
        assert out.logits.shape == (2, 1, 128) and _cache(out).get_seq_length() == T
        logits, cache = hybrid(ids, use_cache=True, return_dict=False, prefill_chunk_tokens=13)  # a tuple
        _close(logits, full)
        assert cache.get_seq_length() == T


def test_the_budget_is_shared_by_the_rows(count_chunked):
    """prefill_chunk_tokens counts the batch's rows together: pieces of budget // B tokens per row (at least one),
    so a larger batch runs shorter pieces and a piece's activations stay bounded; a batch whose rows fit runs whole."""
    assert row_chunk(131072, 1) == 131072 and row_chunk(131072, 8) == 16384 and row_chunk(131072, 3) == 43690
    assert row_chunk(5, 8) == 1 and row_chunk(0, 4) == 0
    hybrid = _hybrid()
    with torch.no_grad():
        for rows in (1, 2, 3, 5):  # 50 and 2 x 50 tokens fit in 100: one forward each
            hybrid(torch.randint(0, 128, (rows, T)), prefill_chunk_tokens=100)
    assert count_chunked == [33, 20]


def test_which_pieces_compute_logits():
    """Only the pieces holding asked-for positions compute logits, and only those (an empty index elsewhere)."""
    assert kept_positions(1, 50, 42, 49)[0] is None and kept_positions(1, 50, 49, 50)[0] == 1
    assert kept_positions(5, 50, 42, 49)[0] == 4 and kept_positions(0, 50, 0, 7)[0] == 0
    keep, order = kept_positions(torch.tensor([3, -1, 44]), 50, 42, 49)
    assert keep.tolist() == [2] and order.tolist() == [2]


def test_only_inference_forwards_are_chunked(count_chunked):
    """Training, labels, recorded gradients, the softmax teacher and the distill mode, per-layer outputs, 4-D masks,
    2-D logits_to_keep and inputs no longer than one piece run one forward as before."""
    hybrid = _hybrid()
    ids = torch.randint(0, 128, (1, T))
    hybrid(ids, use_cache=False, prefill_chunk_tokens=7)  # gradients recorded
    with torch.no_grad():
        hybrid(ids, labels=ids, prefill_chunk_tokens=7)
        hybrid(ids, prefill_chunk_tokens=T)
        hybrid(ids, output_hidden_states=True, prefill_chunk_tokens=7)
        hybrid(ids, logits_to_keep=torch.tensor([[1, 2]]), prefill_chunk_tokens=7)
        hybrid(ids, attention_mask=torch.ones(1, 1, T, T, dtype=torch.bool), prefill_chunk_tokens=7)
        for mode in ("softmax", "distill"):
            hybrid.set_attention_mode(mode)
            hybrid(ids, use_cache=False, prefill_chunk_tokens=7)
        hybrid.set_attention_mode("linear")
        hybrid.train()
        hybrid(ids, use_cache=False, prefill_chunk_tokens=7)
        assert count_chunked == []
        hybrid.eval()
        hybrid(ids, prefill_chunk_tokens=7)
    assert count_chunked == [7]


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_moe"])
def test_generate_is_the_same_with_chunked_prefill(family, count_chunked):
    """generate()'s prefill is chunked by the config's prefill_chunk_tokens and gives the tokens and scores of one
    prefill forward, for a left-padded batch too; transformers' own generate(prefill_chunk_size=N), a loop of
    cached forwards of N tokens, composes with it (pieces longer than the config's are cut again)."""
    hybrid = _hybrid(family, ratio="3:1")
    ids, mask, _ = _padded(n_rows=3, pad=13)

    def run(**kw):
        out = hybrid.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                              return_dict_in_generate=True, output_logits=True, **kw)
        return out.sequences, torch.stack(out.logits, 1)

    hybrid.config.prefill_chunk_tokens = 0
    tokens, logits = run()
    assert count_chunked == []
    hybrid.config.prefill_chunk_tokens = 21  # three rows: 7 tokens each
    for kw, pieces in [({}, [7]), ({"prefill_chunk_size": 20}, [7, 7, 7])]:  # 50 tokens: 20 + 20 + 10, then by 7
        count_chunked.clear()
        got_tokens, got_logits = run(**kw)
        assert torch.equal(got_tokens, tokens)
        _close(got_logits, logits)
        assert count_chunked == pieces  # the prefill only: decode steps are single tokens


def test_bench_model_prefill_is_chunked(count_chunked):
    """`linearize bench model`'s prefill (one forward with a fresh cache, logits_to_keep=1, no gradients) runs in
    pieces for the hybrid, and its decode-timing cache steps as after one forward."""
    from linearize.bench import model as bm

    hybrid = _hybrid(ratio="3:1")
    ids = torch.randint(0, 128, (2, T), generator=torch.Generator().manual_seed(0))
    steps = []
    for chunk in (0, 14):  # two rows: 7 tokens each
        hybrid.config.prefill_chunk_tokens = chunk
        dcache = bm.decode_cache(bm.prefill(hybrid, ids), T)
        with torch.no_grad():
            steps.append(hybrid(input_ids=ids[:, -1:], position_ids=torch.full((2, 1), T - 1), use_cache=True,
                                logits_to_keep=1, **bm._cache_kwargs(hybrid, dcache)).logits)
    assert count_chunked == [7]
    _close(steps[1], steps[0])


def test_chunk_size_is_a_config_field(tmp_path):
    """prefill_chunk_tokens is saved in config.json, defaults where a config lacks it (checkpoints written before it
    existed), can be set at load, and is refused in one line unless a whole number >= 0."""
    from linearize.model.modeling import LinearizeConfig, LinearizeForCausalLM

    hybrid = _hybrid()
    assert hybrid.config.prefill_chunk_tokens == PREFILL_CHUNK_TOKENS
    assert "prefill_chunk_tokens" not in hybrid.config.base_config().to_dict()
    hybrid.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["prefill_chunk_tokens"] == PREFILL_CHUNK_TOKENS
    del cfg["prefill_chunk_tokens"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert LinearizeForCausalLM.from_pretrained(tmp_path).config.prefill_chunk_tokens == PREFILL_CHUNK_TOKENS
    assert LinearizeForCausalLM.from_pretrained(tmp_path, prefill_chunk_tokens=512).config.prefill_chunk_tokens == 512
    # not transformers' GenerationConfig.prefill_chunk_size, which generate() would take from the model's config
    loaded = LinearizeForCausalLM.from_pretrained(tmp_path, prefill_chunk_tokens=0)
    assert loaded.generation_config.prefill_chunk_size is None
    with torch.no_grad():
        assert loaded.generate(torch.ones(1, 9, dtype=torch.long), max_new_tokens=2, do_sample=False).shape == (1, 11)
    for bad in (-1, 1.5, True, "8K"):
        with pytest.raises(ValueError, match="prefill_chunk_tokens=.*expected a whole number of tokens >= 0"):
            LinearizeConfig(prefill_chunk_tokens=bad)
    with pytest.raises(ValueError, match="prefill_chunk_tokens=-3"):
        hybrid(torch.zeros(1, 4, dtype=torch.long), prefill_chunk_tokens=-3)


_NO_PACKAGE = (  # a process in which `import linearize` (and `import triton`) fail
    "import sys\n"
    "class _Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('linearize', 'triton'):\n"
    "            raise ImportError(name + ' is not installed here')\n"
    "sys.meta_path.insert(0, _Block())\n"
)


@pytest.mark.slow
def test_bundled_runtime_prefills_in_chunks(tmp_path):
    """A checkpoint loaded with trust_remote_code=True, without the package, prefills in pieces from its own files
    (prefill_chunk_tokens set at load) and computes the package's logits."""
    from conftest import char_tokenizer

    from linearize.io.checkpoint import save_checkpoint

    rec = R.load("lolcats", RECIPES["lolcats"])
    hybrid = _hybrid()
    save_checkpoint(hybrid, char_tokenizer(), tmp_path / "ckpt", base="tiny", recipe=rec)
    ids = torch.randint(0, 128, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hybrid(ids, prefill_chunk_tokens=0).logits
    torch.save({"ids": ids, "want": want}, tmp_path / "want.pt")
    code = _NO_PACKAGE + (
        "import torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'ckpt')!r}, trust_remote_code=True, "
        "prefill_chunk_tokens=14)\n"  # two rows: 7 tokens each
        "pieces = []\n"
        "prefill = sys.modules[type(m).__module__].chunked_forward\n"
        "sys.modules[type(m).__module__].chunked_forward = lambda *a, **k: pieces.append(a[1]) or prefill(*a, **k)\n"
        f"d = torch.load({str(tmp_path / 'want.pt')!r})\n"
        "with torch.no_grad():\n"
        "    diff = (m(d['ids']).logits - d['want']).abs().max().item()\n"
        "print(pieces, diff)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    pieces, diff = res.stdout.strip().rsplit(" ", 1)
    assert pieces == "[7]" and float(diff) <= 1e-5

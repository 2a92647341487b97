"""Prompt-lookup decoding on a hybrid: transformers' assisted decoding calls ``activate_past_recording`` with
arguments newer releases added (5.25: ``recurrent_states_to_keep``) and takes rejected drafts back with ``crop``;
the linear layers' recurrent state must roll back exactly, so greedy text with drafts equals plain greedy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import char_tokenizer, recorded_crops, run_cli, tiny_model
from linearize import recipe as R
from linearize.model.cache import CROP_TOKENS, HybridCache, LinearStateLayer
from linearize.io.checkpoint import save_checkpoint
from linearize.convert.selection import select_layout
from linearize.convert.surgery import linearize_model

WINDOW = {"attention.window": 8}


def _hybrid(family: str = "llama", ratio: str = "1:1", seed: int = 0):
    return linearize_model(tiny_model(family, seed=seed).double(), select_layout(4, ratio=ratio),
                           R.load("lolcats", WINDOW))


def test_activate_past_recording_takes_the_new_arguments():
    """5.25 passes ``recurrent_states_to_keep``; a sliding softmax layer of an older release takes no argument."""
    hybrid = _hybrid("gemma3_text")  # its softmax layers slide: transformers' own layer gets the call too
    cache = hybrid.new_cache()
    assert isinstance(cache, HybridCache)
    cache.activate_past_recording(recurrent_states_to_keep=CROP_TOKENS + 100)
    linear = [layer for layer in cache.layers if isinstance(layer, LinearStateLayer)]
    assert linear and all(layer.record_past and layer.recurrent_states_to_keep == CROP_TOKENS + 100
                          for layer in linear)
    assert cache.is_croppable
    cache.activate_past_recording()  # as older releases call it; keeps the longer history
    assert all(layer.recurrent_states_to_keep == CROP_TOKENS + 100 for layer in linear)


def test_long_take_back_is_exact():
    """With ``recurrent_states_to_keep`` above ``CROP_TOKENS`` a draft that long is taken back exactly: the cache then
    continues like one that never saw those tokens."""
    torch.manual_seed(0)
    hybrid = _hybrid()
    n, remove = CROP_TOKENS + 60, CROP_TOKENS + 40
    ids = torch.randint(1, 128, (1, n + 3))
    with torch.no_grad():
        cache = hybrid.new_cache()
        cache.activate_past_recording(recurrent_states_to_keep=remove)
        hybrid(ids[:, :n], cache=cache, use_cache=True)
        cache.crop(-remove)
        kept = n - remove
        assert cache.get_seq_length() == kept
        ref = hybrid.new_cache()
        hybrid(ids[:, :kept], cache=ref, use_cache=True)
        new = ids[:, n:]  # a continuation other than the tokens taken back
        pos = torch.arange(kept, kept + 3)[None]
        a = hybrid(new, cache=cache, position_ids=pos, use_cache=True).logits
        b = hybrid(new, cache=ref, position_ids=pos, use_cache=True).logits
    assert (a - b).abs().max().item() <= 1e-9


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_prompt_lookup_equals_greedy_with_rejected_drafts(family):
    """generate() with prompt-lookup drafts gives greedy's tokens, and some drafts were rejected (taken back from the
    linear layers' state)."""
    main = _hybrid(family, ratio="3:1")
    torch.manual_seed(0)
    ids = torch.randint(1, 128, (1, 20))
    g = main.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)[0, -1].item()
    prompt = torch.cat([ids, torch.tensor([[g, g, g, 5, 6, 7, 8, 9, 10, 11]]), ids[:, :5], ids, ids[:, :6]], 1)
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False)
    want = main.generate(prompt, **kw)
    with recorded_crops() as taken_back:
        for n in (2, 5):
            assert torch.equal(main.generate(prompt, prompt_lookup_num_tokens=n, **kw), want)
    assert max(taken_back) >= 1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tok = char_tokenizer(lowercase=True)
    base = tiny_model("llama")
    base.resize_token_embeddings(len(tok))
    hybrid = linearize_model(base, select_layout(4, ratio="1:1"), R.load("lolcats", WINDOW))
    with torch.no_grad():  # learned parts that matter, so a wrong rollback would change the text
        for m in hybrid.linear_modules():
            for p in list(m.feature_map_q.parameters()) + [m.window_logit]:
                p.add_(0.1 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("lookup") / "hybrid"
    save_checkpoint(hybrid, tok, out, base="tiny", recipe=R.load("lolcats", WINDOW))
    return out


def test_cli_generate_prompt_lookup_equals_greedy(checkpoint):
    """``linearize generate --prompt-lookup N`` runs (no traceback) and prints greedy's text."""
    prompt = "the stone stays, the river runs north, the stone stays, the river runs"
    args = ["generate", str(checkpoint), prompt, "--max-new-tokens", "24", "--raw", "--dtype", "float32"]
    greedy = run_cli(*args)
    assert greedy.returncode == 0, greedy.stderr
    for n in ("3", "10"):
        out = run_cli(*args, "--prompt-lookup", n)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        assert out.stdout == greedy.stdout

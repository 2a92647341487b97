"""Gated linear layers (``attention.decay: learned``): the decay gate, decode == forward, training, checkpoints."""

import math

import pytest
import torch

from conftest import char_tokenizer, check_checkpoint_round_trip, stir_decay_gates, tiny_model
from test_distill import corpus  # noqa: F401 - the fixture is used by name
from linearize import recipe as R
from linearize.model.attention import DecayGate
from linearize.convert.selection import select_layout
from linearize.convert.surgery import linearize_model


def gated_hybrid(window: int, ratio: str = "3:1", half_life: float = 64.0, seed: int = 0):
    """A 4-layer tiny llama hybrid whose linear layers are gated, the gate given a non-trivial input dependence."""
    rec = R.load("lolcats", {"attention.window": window, "attention.decay": "learned",
                             "attention.decay_half_life": half_life})
    hybrid = linearize_model(tiny_model("llama", layers=4, seed=seed), select_layout(4, ratio=ratio), rec)
    return stir_decay_gates(hybrid, seed + 1).eval()


def test_untrained_gate_forgets_with_the_recipe_half_life():
    gate = DecayGate(hidden_size=8, kv_heads=3, half_life=1000.0)
    ld = gate(torch.randn(2, 5, 8))
    assert ld.shape == (2, 5, 3) and ld.dtype == torch.float32
    torch.testing.assert_close(ld, torch.full_like(ld, -math.log(2) / 1000.0), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="decay_half_life"):
        DecayGate(8, 3, 0.0)


@pytest.mark.parametrize("window", [0, 4])
def test_gate_at_an_endless_half_life_is_the_ungated_layer(window):
    """With W = 0 and a half-life of 1e9 tokens the gated hybrid computes what the ungated one does."""
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 40))
    plain = linearize_model(tiny_model("llama", layers=4), select_layout(4, ratio="3:1"),
                            R.load("lolcats", {"attention.window": window})).eval()
    gated = linearize_model(tiny_model("llama", layers=4), select_layout(4, ratio="3:1"),
                            R.load("lolcats", {"attention.window": window, "attention.decay": "learned",
                                               "attention.decay_half_life": 1e9})).eval()
    missing = gated.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert missing and all(".decay." in k for k in missing)
    with torch.no_grad():
        torch.testing.assert_close(gated(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [0, 4])
def test_decode_equals_forward(window):
    """Prefill, a multi-token continuation and single-token steps through the hybrid cache give the logits of one
    forward over the whole sequence; a strong decay (half-life 4 tokens) makes a missed decay visible."""
    hybrid = gated_hybrid(window, half_life=4.0)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 30))
    with torch.no_grad():
        full = hybrid(ids).logits
        out = hybrid(ids[:, :17], use_cache=True)
        pieces, cache = [out.logits], out.past_key_values
        out = hybrid(ids[:, 17:23], past_key_values=cache, use_cache=True)  # a multi-token continuation
        pieces.append(out.logits)
        for t in range(23, 30):
            out = hybrid(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=2e-4, atol=2e-4)


def test_generate_and_checkpoint_round_trip(tmp_path):
    """The gate's weights and settings survive a checkpoint; the bundled code (trust_remote_code) and the package's
    class load it and generate the same tokens."""
    hybrid = gated_hybrid(4)
    rec = R.load("lolcats", {"attention.window": 4, "attention.decay": "learned", "attention.decay_half_life": 64})
    check_checkpoint_round_trip(hybrid, rec, tmp_path / "gated", lambda layers: all(m.decay is not None for m in layers))


@pytest.mark.parametrize("window", [0, 4])
def test_take_back_after_steps_and_a_long_prompt(window):
    """A gated state taken back over a long recorded prompt and over single steps (the snapshot moved on step by
    step) continues as a cache that never saw those tokens; the strong decay (half-life 4) shows a wrong replay."""
    from linearize.model.cache import CROP_TOKENS

    hybrid = gated_hybrid(window, half_life=4.0).double()
    torch.manual_seed(2)
    n = CROP_TOKENS + 30
    ids = torch.randint(0, 128, (1, n + 12))
    with torch.no_grad():
        cache = hybrid.new_cache()
        cache.activate_past_recording()
        hybrid(ids[:, :n], cache=cache, use_cache=True)
        for t in range(n, n + 8):
            hybrid(ids[:, t:t + 1], cache=cache, use_cache=True)
        cache.crop(-40)  # 8 steps and 32 tokens of the prompt
        kept = n + 8 - 40
        ref = hybrid.new_cache()
        hybrid(ids[:, :kept], cache=ref, use_cache=True)
        new = ids[:, n + 8:]
        pos = torch.arange(kept, kept + 4)[None]
        a = hybrid(new, cache=cache, position_ids=pos, use_cache=True).logits
        b = hybrid(new, cache=ref, position_ids=pos, use_cache=True).logits
    assert (a - b).abs().max().item() <= 1e-6  # float64 model, float32 log decays (the gate's contract)


def test_stage1_trains_the_gate(corpus, monkeypatch, tmp_path):
    """Attention transfer updates the gate (weight and bias) along with the feature maps, and lowers the held-out
    attention error."""
    from linearize.train import distill as D

    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    model = tiny_model("llama", layers=2)
    model.resize_token_embeddings(64)
    rec = R.load("lolcats", {"distill.data": corpus, "distill.seq_len": 64, "distill.batch_size": 2,
                             "distill.tokens": 64 * 2 * 12, "distill.warmup_steps": 1, "distill.eval_seqs": 4,
                             "distill.lr": 3e-2, "attention.window": 8, "attention.decay": "learned"})
    hybrid = linearize_model(model, select_layout(2, ratio="1:0"), rec)
    before = {n: p.detach().clone() for n, p in hybrid.named_parameters() if ".decay." in n}
    assert len(before) == 4
    params = D.trainable_parameters(hybrid)
    assert all(any(p is q for q in params) for m in hybrid.linear_modules() for p in m.decay.parameters())
    rep = D.distill(hybrid, char_tokenizer(), rec, progress=False, log=lambda m: None)
    assert rep["heldout_mse_end_mean"] < rep["heldout_mse_start_mean"]
    after = dict(hybrid.named_parameters())
    assert all(not torch.equal(after[n], p) for n, p in before.items())


def test_recipe_refuses_an_unknown_decay():
    with pytest.raises(R.RecipeError, match="decay"):
        R.load("lolcats", {"attention.decay": "fixed"})

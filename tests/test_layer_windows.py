"""Per-layer sliding windows (``attention.layer_windows``): the recipe field, the layers, the cache, checkpoints and
the cost model."""

import pytest
import torch

from conftest import check_checkpoint_round_trip, tiny_model
from linearize import recipe as R
from linearize.bench.costs import cache_bytes, linear_state_bytes
from linearize.convert.selection import select_layout
from linearize.convert.surgery import linearize_model
from linearize.model.layout import layer_window, parse_layer_windows, widest_window


def hybrid_with(layer_windows: dict, window: int = 4, sinks: int = 0):
    """A 4-layer llama, layers 0-2 linear (3:1), the given windows."""
    rec = R.load("lolcats", {"attention.window": window, "attention.sinks": sinks,
                             "attention.layer_windows": layer_windows})
    return linearize_model(tiny_model("llama", layers=4, seed=0), select_layout(4, ratio="3:1"), rec).eval(), rec


def test_parse_and_resolve():
    assert parse_layer_windows({"0-2": 16, 5: 8, " 7 ": 1}) == {0: 16, 1: 16, 2: 16, 5: 8, 7: 1}
    assert parse_layer_windows({}) == {} and parse_layer_windows(None) == {}
    settings = {"window": 64, "layer_windows": {"0-19": 512, "24": 32}}
    assert [layer_window(settings, i) for i in (0, 19, 20, 24)] == [512, 512, 64, 32]
    assert widest_window(settings) == 512 and widest_window({"window": 64}) == 64 and widest_window({}) == 0
    for bad, needle in [({"a": 4}, "expected a layer"), ({"3-1": 4}, "first no later"), ({"-1": 4}, "expected a layer"),
                        ({"2": 0}, "in \\[1, 4096\\]"), ({"2": 4.5}, "in \\[1, 4096\\]"), ({"0-2": 4, "2": 8}, "twice")]:
        with pytest.raises(ValueError, match=needle):
            parse_layer_windows(bad)


def test_recipe_field():
    rec = R.load("lolcats", {"attention.layer_windows": {"0-19": 512, 24: 32}})
    assert rec["attention"]["layer_windows"] == {"0-19": 512, "24": 32}  # string keys, as config.json holds them
    assert R.load("lolcats")["attention"]["layer_windows"] == {}
    with pytest.raises(R.RecipeError, match="attention.layer_windows"):
        R.load("lolcats", {"attention.layer_windows": {"x": 8}})
    with pytest.raises(R.RecipeError, match="attention.window is 0"):
        R.load("lolcats", {"attention.window": 0, "attention.layer_windows": {"1": 8}})
    with pytest.raises(R.RecipeError, match="draws one width for every layer"):
        R.load("lolcats", {"attention.layer_windows": {"1": 8}, "distill.windows": [8, 16]})
    # the widest window must still leave the training rows a linear part
    with pytest.raises(R.RecipeError, match="attention.window = 512 is not shorter than distill.seq_len = 512"):
        R.check_training(R.load("lolcats-cpu", {"attention.layer_windows": {"0": 512}}), {"distill": None})


def test_a_layer_the_model_does_not_have_is_refused():
    with pytest.raises(R.RecipeError, match="names layer 7, and the model has 4 layers"):
        hybrid_with({"2-7": 8})


def test_layers_take_their_widths_and_decode_equals_forward():
    """Each layer runs at its own width: a prefill, a continuation and single steps give one forward's logits; the
    layer whose width changed changes them; every layer at one width equals the plain window."""
    mixed, _ = hybrid_with({"1": 12, "2": 2}, window=4, sinks=2)
    assert [m.window for m in mixed.linear_modules()] == [4, 12, 2]
    plain, _ = hybrid_with({}, window=4, sinks=2)
    torch.manual_seed(3)
    ids = torch.randint(0, 128, (2, 30))
    with torch.no_grad():
        full = mixed(ids).logits
        assert (full - plain(ids).logits).abs().amax() > 1e-3
        out = mixed(ids[:, :9], use_cache=True)
        pieces, cache = [out.logits], out.past_key_values
        out = mixed(ids[:, 9:15], past_key_values=cache, use_cache=True)
        pieces.append(out.logits)
        for t in range(15, 30):
            out = mixed(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            pieces.append(out.logits)
        torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=2e-4, atol=2e-4)
        same, _ = hybrid_with({"0-2": 4}, window=4, sinks=2)
        torch.testing.assert_close(same(ids).logits, plain(ids).logits, rtol=0, atol=0)


def test_checkpoint_round_trip(tmp_path):
    """The widths survive a checkpoint; the package's class and the bundled code load them and generate alike."""
    hybrid, rec = hybrid_with({"0": 8, "2": 2})
    check_checkpoint_round_trip(hybrid, rec, tmp_path / "lw", lambda layers: [m.window for m in layers] == [8, 4, 2])


def test_a_checkpoint_serves_at_the_width_its_config_says(tmp_path):
    """The serving width is configuration, not weights: a saved hybrid whose config.json is edited to another
    ``linear_attention.window`` loads with every windowed layer at it and computes what the in-memory model
    computes at that width (and not what it computed before)."""
    import json

    from transformers import AutoModelForCausalLM

    from conftest import char_tokenizer
    from linearize.io.checkpoint import save_checkpoint
    from linearize.model.modeling import LinearizeForCausalLM

    hybrid, rec = hybrid_with({}, window=4)
    out = tmp_path / "H"
    save_checkpoint(hybrid, char_tokenizer(), out, base="tiny", recipe=rec)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["linear_attention"]["window"] == 4
    cfg["linear_attention"]["window"] = 12
    (out / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = hybrid(ids).logits
        for m in hybrid.linear_modules():
            m.window = 12
        want, tokens = hybrid(ids).logits, hybrid.generate(ids, max_new_tokens=6, do_sample=False)
        for loaded in (LinearizeForCausalLM.from_pretrained(out).eval(),
                       AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()):
            assert [m.window for m in loaded.linear_modules()] == [12, 12, 12]
            torch.testing.assert_close(loaded(ids).logits, want)
            assert torch.equal(loaded.generate(ids, max_new_tokens=6, do_sample=False), tokens)  # the cache's rings
    assert not torch.allclose(want, before)


def test_cache_bytes_count_each_layers_ring():
    hybrid, _ = hybrid_with({"0": 64, "2": 2})
    cfg = hybrid.config
    la = cfg.linear_attention
    per_layer = [linear_state_bytes(cfg, {**la, "window": w}) for w in (64, 4, 2)]
    full = cache_bytes(cfg, 100)
    plain = cache_bytes(hybrid_with({})[0].config, 100)
    assert full["hybrid"] - plain["hybrid"] == sum(per_layer) - 3 * linear_state_bytes(cfg, {**la, "window": 4})
    assert per_layer[0] > per_layer[1] > per_layer[2]

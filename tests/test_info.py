"""`linearize info`: planning a conversion with --ratio / --softmax-layers (no weights), offline from a shipped
published config, and its one-line errors."""

import pytest

from conftest import char_tokenizer, run_cli, tiny_model
from linearize import recipe as R
from linearize.io.checkpoint import save_checkpoint
from linearize.bench.info import describe_converted, model_info
from linearize.convert.selection import select_layout
from linearize.bench.costs import cache_bytes
from linearize.convert.surgery import linearize_model


def test_plan_from_a_shipped_config_offline():
    """llama-3-8b is not on this machine: its shipped config stands in, and the planned 3:1 hybrid's layout,
    extras, cache and bounds are those of the surgery on the meta device."""
    r = run_cli("info", "llama-3-8b", "--ratio", "3:1")
    assert r.returncode == 0, r.stderr
    assert "published config" in r.stdout and "(24 linear, 8 softmax) (planned, recipe lolcats)" in r.stdout
    assert "prefill bound" in r.stdout and "decode bound" in r.stdout
    data = model_info("llama-3-8b", ratio="3:1")
    assert data["layer_types"] == select_layout(32, ratio="3:1")
    # lolcats: a Hedgehog map [head_dim, head_dim / 2] per query and KV head, and a window logit per query head
    assert data["extra_parameters"] == 24 * ((32 + 8) * 128 * 64 + 32)
    assert data["parameters"] == 8_030_261_248 + data["extra_parameters"]
    assert data["bounds"]["128K"]["prefill"] > data["bounds"]["4K"]["prefill"] > 1.0
    assert data["quality"] == {}


def test_gemma3_plan_counts_its_sliding_layers():
    """Gemma 3 1B slides over 512 tokens in 22 of its 26 layers (every sixth is global): its cache and the attention
    FLOPs of its prefill grow only in the global layers, for the original and for the hybrid's softmax layers."""
    data = model_info("gemma-3-1b", ratio="3:1")
    kv_token = 2 * 1 * 256 * 2  # K and V, one KV head of 256, bf16
    assert data["parameters"] - data["extra_parameters"] == 999_885_952
    assert data["cache_bytes"]["4K"]["original"] == (4 * 4096 + 22 * 512) * kv_token
    softmax = [i for i, t in enumerate(data["layer_types"]) if t == "full_attention"]
    assert softmax == [3, 7, 11, 15, 19, 23]  # 11 and 23 are global
    states = data["cache_bytes"]["4K"]["hybrid"] - (2 * 4096 + 4 * 512) * kv_token
    assert data["cache_bytes"]["128K"]["hybrid"] == (2 * 131072 + 4 * 512) * kv_token + states
    # the original attends at most 512 keys in most layers: the prefill bound at 128K stays far below Llama's
    assert 1.0 < data["bounds"]["128K"]["prefill"] < 1.5
    assert data["sliding"] == "22 of 26 layers slide over 512 tokens in the original; full attention in 5, 11, 17, 23"
    assert model_info("llama-3-8b")["sliding"] is None


def test_plan_matches_the_converted_model(tmp_path):
    """A planned layout reports what the converted checkpoint of the same layout and recipe reports."""
    model = tiny_model("qwen3")
    base = tmp_path / "base"
    model.save_pretrained(base)
    hybrid = linearize_model(tiny_model("qwen3"), select_layout(4, softmax_layers="1"), R.load("elu"))
    save_checkpoint(hybrid, char_tokenizer(), tmp_path / "hybrid", base="tiny", recipe=R.load("elu"))
    planned = model_info(str(base), softmax_layers="1", recipe="elu")
    converted = model_info(str(tmp_path / "hybrid"))
    for key in ("layer_types", "parameters", "extra_parameters", "cache_bytes", "bounds"):
        assert planned[key] == converted[key], key
    assert planned["cache_bytes"]["32K"] == cache_bytes(hybrid.config, 32768)
    assert "(planned, recipe elu)" in planned["layout"] and "planned" not in converted["layout"]
    assert planned["converted"] == converted["converted"] == "linear attention, elu maps"
    assert model_info(str(base))["converted"] is None


def test_converted_layers_are_described():
    """One line on what the converted layers compute: the map, the window (with per-layer widths), sinks, decay."""
    la = {"feature_map": "hedgehog", "window": 64, "layer_windows": {"0-19": 512}, "sinks": 16, "decay": "learned"}
    assert describe_converted(la) == ("linear attention, hedgehog maps, 64-token window (layers 0-19: 512), 16 sinks, "
                                      "learned decay")
    assert describe_converted({"layer_type": "gated_delta"}) == "gated delta rule"
    r = run_cli("info", "llama-3-8b", "--ratio", "3:1")
    assert "converted layers: linear attention, hedgehog maps, 512-token window (trained at 64)" in r.stdout


def test_plan_with_a_wider_window():
    """``--set attention.window=2048`` plans the hybrid with 2048-token windows: bigger rings in the cache (their
    closed form) and lower prefill bounds (the windows' attention counted); only with a planned conversion, only
    attention fields."""
    base = model_info("llama-3-8b", ratio="7:1")
    wide = model_info("llama-3-8b", ratio="7:1", overrides={"attention.window": 2048})
    assert "2048-token window" in wide["converted"] and "512-token window" in base["converted"]
    rings = 28 * 8 * (2048 - 512) * (128 + 128 + 128) * 2 + 28 * (2048 - 512)  # keys, key features, values, flags
    assert wide["cache_bytes"]["32K"]["hybrid"] - base["cache_bytes"]["32K"]["hybrid"] == rings
    for ctx in ("4K", "32K", "128K"):
        assert wide["bounds"][ctx]["prefill"] < base["bounds"][ctx]["prefill"]
    with pytest.raises(R.RecipeError, match="only attention.* fields"):
        model_info("llama-3-8b", ratio="7:1", overrides={"finetune.lr": 1.0})
    with pytest.raises(Exception, match="--set only applies with --ratio"):
        model_info("llama-3-8b", overrides={"attention.window": 2048})


def test_mixture_of_experts_plan():
    data = model_info("qwen3-30b-a3b", ratio="3:1")
    assert data["model_type"] == "qwen3_moe" and data["layout"].startswith("LLLS" * 12)
    assert 2.0 < data["bounds"]["32K"]["prefill"] < 2.3  # the experts a token uses, not all 30B parameters


@pytest.mark.parametrize("args,needle", [
    (["--recipe", "elu"], "--recipe only applies"),
    (["--ratio", "3:1", "--retrieval", "1K"], "does not combine"),
    (["--ratio", "3:0:1"], "--ratio"),
    (["--softmax-layers", "40"], "out of range"),
    (["--ratio", "3:1", "--recipe", "nope"], "unknown recipe"),
], ids=["recipe-alone", "retrieval", "bad-ratio", "layer-range", "recipe"])
def test_plan_errors_are_one_line(args, needle):
    r = run_cli("info", "llama-3-8b", *args)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode != 0 and len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_a_hybrid_cannot_be_planned_again(tmp_path):
    hybrid = linearize_model(tiny_model("llama"), select_layout(4, ratio="3:1"), R.load("elu"))
    save_checkpoint(hybrid, char_tokenizer(), tmp_path / "hybrid", base="tiny", recipe=R.load("elu"))
    r = run_cli("info", str(tmp_path / "hybrid"), "--ratio", "1:1")
    assert r.returncode != 0 and "already a hybrid" in r.stderr and "Traceback" not in r.stderr


def test_a_missing_model_without_a_shipped_config_still_says_how_to_get_it():
    r = run_cli("info", "qwen2.5-0.5b", "--ratio", "3:1")
    assert r.returncode != 0 and "not found" in r.stderr and "huggingface-cli download" in r.stderr


def test_gdn_plan_counts_its_own_parameters_and_state():
    """A gated delta layer adds its write-strength and decay gates, read-out scales and q/k maps, and keeps one fp32
    [K, V] state per KV head (no normalizer, no window ring): counted by hand for Llama-3-8B at 3:1."""
    data = model_info("llama-3-8b", ratio="3:1", recipe="gdn")
    hidden, heads, kv, d = 4096, 32, 8, 128
    per_layer = 2 * (kv * hidden + kv) + heads + (heads + kv) * d * d  # beta, decay; q_scale; q and k maps
    assert data["extra_parameters"] == 24 * per_layer
    kv_token = 2 * kv * d * 2  # K and V, bf16
    assert data["cache_bytes"]["4K"]["hybrid"] == 8 * 4096 * kv_token + 24 * kv * d * d * 4


@pytest.mark.parametrize("recipe,overrides", [("lolcats", {}), ("lolcats", {"attention.decay": "learned"}),
                                              ("elu", {}), ("gdn", {})])
def test_cache_formula_is_what_a_prefill_holds(recipe, overrides):
    """The closed-form cache size (costs.cache_bytes) is exactly the bytes a prefill leaves in the hybrid's cache,
    for every kind of converted layer: window rings with and without log decays, a plain (S, z), a delta state."""
    import torch

    from linearize.bench.model import cache_nbytes

    hybrid = linearize_model(tiny_model("llama"), select_layout(4, softmax_layers="1"), R.load(recipe, overrides))
    with torch.no_grad():
        cache = hybrid(torch.randint(0, 128, (2, 37)), use_cache=True).past_key_values
    assert cache_nbytes(cache) == cache_bytes(hybrid.config, 37, batch=2, dtype_bytes=4)["hybrid"]

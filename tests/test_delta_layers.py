"""Gated delta rule layers (``attention.layer_type: gated_delta``, the ``gdn`` recipe): the layer against the kernel,
cached decoding, chunked prefill, checkpoints, stage 1, the probe and the recipe's checks."""

import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import char_tokenizer, run_cli, tiny_model
from test_distill import corpus  # noqa: F401 - the fixture is used by name
from linearize import recipe as R
from linearize.convert.selection import select_layout
from linearize.convert.surgery import linearize_model
from linearize.io.checkpoint import save_checkpoint
from linearize.kernels.delta import gated_delta_rule
from linearize.model.architectures import arch_spec
from linearize.model.attention import LinearAttention
from linearize.model.cache import DeltaStateLayer, LinearStateLayer
from linearize.model.delta_attention import GatedDeltaAttention
from linearize.model.layout import FULL, GATED_DELTA, LINEAR
from linearize.model.modeling import LinearizeForCausalLM

#: the mixed layout of the tests: a window-hybrid linear layer, two gated delta layers, one softmax layer
MIXED = [LINEAR, GATED_DELTA, FULL, GATED_DELTA]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only add OpenMP barriers on a shared CPU
    yield
    torch.set_num_threads(threads)


def _stir(hybrid, seed: int = 1):
    """Give every gated delta layer's new parameters non-trivial values (input-dependent beta and decay, a strong
    decay, scales and q/k maps away from their starts, an output gate), so a misplaced one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in hybrid.linear_modules():
            if not isinstance(m, GatedDeltaAttention):
                continue
            for p in m.learned_parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            if m.decay is not None:
                m.decay.bias.fill_(math.log(math.expm1(math.log(2) / 4)))  # half-life 4 tokens
    return hybrid


def mixed_hybrid(family: str = "llama", gate: bool = True, seed: int = 0):
    """A 4-layer tiny hybrid of ``family`` (GQA 4 / 2) laid out as :data:`MIXED`: a lolcats layer (window 4, learned
    decay), two gated delta layers (decay, q/k maps, output gate), a softmax layer."""
    rec = R.load("lolcats", {"attention.window": 4, "attention.decay": "learned", "attention.delta_qk_map": True,
                             "attention.delta_output_gate": gate})
    return _stir(linearize_model(tiny_model(family, seed=seed), MIXED, rec)).eval()


def gdn_hybrid(ratio: str = "3:1", family: str = "llama", **overrides):
    rec = R.load("gdn", overrides)
    return linearize_model(tiny_model(family), select_layout(4, ratio=ratio), rec).eval()


def _close(got, want, tol=2e-4):
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), err


# ------------------------------------------------------------------------------------------------ the layer


def test_untrained_layer_is_the_kernel_on_the_projected_inputs():
    """The untrained layer = o_proj(gated_delta_rule(L2(rope(q)), L2(rope(k)), v, beta_init, -ln2/half_life)),
    computed here from the original module's projections and transformers' own rotary."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_model("llama")
    orig = model.model.layers[0].self_attn
    hybrid = linearize_model(model, select_layout(4, ratio="1:0"), R.load("gdn", {"attention.decay_half_life": 8}))
    layer = hybrid.model.layers[0].self_attn
    assert isinstance(layer, GatedDeltaAttention) and layer.q_proj is orig.q_proj and layer.o_proj is orig.o_proj
    torch.manual_seed(0)
    x = torch.randn(2, 37, 64)
    pos = torch.arange(37).expand(2, 37)
    cos, sin = hybrid.model.rotary_emb(x, pos)
    with torch.no_grad():
        got = layer(x, position_embeddings=(cos, sin))[0]
        q = orig.q_proj(x).view(2, 37, 4, 16).transpose(1, 2)
        k = orig.k_proj(x).view(2, 37, 2, 16).transpose(1, 2)
        q, k = (t.transpose(1, 2) for t in apply_rotary_pos_emb(q, k, cos, sin))
        v = orig.v_proj(x).view(2, 37, 2, 16)
        beta = torch.full((2, 37, 2), R.load("gdn")["attention"]["delta_beta_init"])
        ld = torch.full((2, 37, 2), -math.log(2) / 8)
        scale = R.load("gdn")["attention"]["delta_q_scale"]
        o, _ = gated_delta_rule(torch.nn.functional.normalize(q, dim=-1) * scale,
                                torch.nn.functional.normalize(k, dim=-1), v, beta, ld, scale=1.0, backend="reference")
        want = orig.o_proj(o.reshape(2, 37, 64))
    _close(got, want, 1e-5)


@pytest.mark.parametrize("family", ["qwen3", "phi3", "olmo2", "olmo", "stablelm", "hunyuan_v1_dense", "cohere",
                                    "smollm3", "gemma2"])
def test_projections_and_teacher_are_the_linear_layers(family):
    """The gated delta layer borrows LinearAttention's projection and teacher code: built from the same original
    module it sets every attribute that code reads the same way (fused qkv, q/k norms in each place, bounds,
    interleaved and partial rotary, layers without rotary, Gemma 2's soft-cap and sliding window)."""
    model = tiny_model(family)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    spec, cfg = arch_spec(family), model.config
    x = torch.randn(1, 20, 64, generator=torch.Generator().manual_seed(2))
    cos_sin = model.model.rotary_emb(x, torch.arange(20)[None])
    for i, decoder in enumerate(model.model.layers):
        orig = getattr(decoder, spec.attention)
        lin = LinearAttention(orig, cfg, i, {"feature_map": "elu", "window": 0}, spec)
        gdn = GatedDeltaAttention(orig, cfg, i, {}, spec)
        with torch.no_grad():
            a, b = lin.project(x, cos_sin), gdn.project(x, cos_sin)
            assert all(torch.equal(s, t) for s, t in zip(a, b)), (family, i)
            assert torch.equal(lin.softmax_attention(*a), gdn.softmax_attention(*b)), (family, i)


def test_stage1_parameters_and_initial_values():
    hybrid = gdn_hybrid(**{"attention.delta_qk_map": True, "attention.delta_output_gate": True})
    m = hybrid.linear_modules()[0]
    att = R.load("gdn")["attention"]
    names = {n for n, p in m.named_parameters() if any(p is q for q in m.learned_parameters())}
    assert names == {"beta.weight", "beta.bias", "decay.weight", "decay.bias", "q_scale", "q_map", "k_map",
                     "gate.weight"}
    assert all(p.dtype == torch.float32 for p in m.learned_parameters())
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(m.beta(x), torch.full((2, 5, 2), att["delta_beta_init"]))
    assert torch.equal(m.gate(x), torch.ones(2, 5, 64))
    assert torch.equal(m.q_map, torch.eye(16).repeat(4, 1, 1)) and torch.equal(m.k_map, torch.eye(16).repeat(2, 1, 1))
    assert torch.equal(m.q_scale, torch.full((4,), att["delta_q_scale"]))
    plain = gdn_hybrid(**{"attention.delta_qk_map": False}).linear_modules()[0]
    assert plain.q_map is None and plain.gate is None and len(plain.learned_parameters()) == 5


# ------------------------------------------------------------------------------------------- cache and decode


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prefill_and_decode_equal_the_full_forward(family):
    """Softmax, lolcats and gated delta layers in one model (GQA, fp32): a prefill, a multi-token continuation and
    single-token decode steps through the hybrid cache give the logits of one forward over the whole sequence."""
    hybrid = mixed_hybrid(family)
    assert [type(m).__name__ for m in hybrid.linear_modules()] == ["LinearAttention", "GatedDeltaAttention",
                                                                   "GatedDeltaAttention"]
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = hybrid(ids, use_cache=False).logits
        out = hybrid(ids[:, :17], use_cache=True)
        cache, pieces = out.past_key_values, [out.logits]
        assert [type(c) for c in cache.layers[:2]] == [LinearStateLayer, DeltaStateLayer]
        assert cache.layers[1].state.shape == (2, 2, 16, 16) and cache.layers[1].state.dtype == torch.float32
        out = hybrid(ids[:, 17:23], past_key_values=cache, use_cache=True)
        pieces.append(out.logits)
        for t in range(23, 30):
            out = hybrid(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            pieces.append(out.logits)
    _close(torch.cat(pieces, 1), full)
    assert cache.get_seq_length() == 30 and cache.layers[1].seen == 30
    assert cache.layers[1].nbytes == 2 * 2 * 16 * 16 * 4


def test_chunked_prefill_equals_one_forward(monkeypatch):
    """A prefill in pieces of 16 tokens (with a left-padded row) gives one forward's logits and cache."""
    from linearize.model import modeling

    pieces = []
    real = modeling.chunked_forward
    monkeypatch.setattr(modeling, "chunked_forward", lambda step, chunk, **kw: pieces.append(chunk) or
                        real(step, chunk, **kw))
    hybrid = mixed_hybrid()
    ids = torch.randint(1, 128, (2, 50), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :9], ids[1, :9] = 0, 0
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        whole = hybrid(ids, attention_mask=mask, position_ids=pos, use_cache=True, prefill_chunk_tokens=0)
        chunked = hybrid(ids, attention_mask=mask, position_ids=pos, use_cache=True, prefill_chunk_tokens=32)  # 16 a row
        assert pieces == [16]  # the second forward ran as a chunked prefill, the first as one
        _close(chunked.logits[mask.bool()], whole.logits[mask.bool()])
        a, b = whole.past_key_values.layers[1].state, chunked.past_key_values.layers[1].state
        _close(b, a, 1e-5)
        nxt = torch.randint(1, 128, (2, 1))
        step = dict(attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1), position_ids=pos[:, -1:] + 1)
        _close(hybrid(nxt, past_key_values=chunked.past_key_values, **step).logits,
               hybrid(nxt, past_key_values=whole.past_key_values, **step).logits)


def test_left_padded_batch_generates_what_each_prompt_generates_alone():
    """Padding tokens leave a gated delta state unchanged (beta = 0, no decay): greedy and beam search."""
    hybrid = mixed_hybrid()
    prompts = [torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (20, 5)]
    ids, mask = torch.zeros(2, 20, dtype=torch.long), torch.zeros(2, 20, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 20 - p.shape[1]:], mask[i, 20 - p.shape[1]:] = p[0], 1
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for beams in (1, 3):
            alone = [hybrid.generate(p, attention_mask=torch.ones_like(p), num_beams=beams, **kw)[0, p.shape[1]:]
                     for p in prompts]
            batched = hybrid.generate(ids, attention_mask=mask, num_beams=beams, **kw)[:, 20:]
            for i, a in enumerate(alone):
                assert torch.equal(batched[i], a), (beams, i)


def test_taking_tokens_back_replays_from_a_snapshot():
    """A gated delta state takes tokens back only while recording (as generate() asks for speculative decoding);
    then a crop over single steps and part of the prompt continues as a cache that never saw those tokens (a
    lolcats layer, two gated delta layers, a softmax layer)."""
    hybrid = mixed_hybrid()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        cache = hybrid(ids[:, :8], use_cache=True).past_key_values
        with pytest.raises(RuntimeError, match="activate_past_recording"):
            cache.layers[0].crop(-2)
        cache = hybrid.new_cache()
        cache.activate_past_recording()
        hybrid(ids[:, :30], cache=cache, use_cache=True)
        for t in range(30, 34):
            hybrid(ids[:, t:t + 1], cache=cache, use_cache=True)
        cache.crop(-9)  # the 4 steps and 5 prompt tokens
        ref = hybrid.new_cache()
        hybrid(ids[:, :25], cache=ref, use_cache=True)
        pos = torch.arange(25, 31)[None]
        _close(hybrid(ids[:, 34:], cache=cache, position_ids=pos, use_cache=True).logits,
               hybrid(ids[:, 34:], cache=ref, position_ids=pos, use_cache=True).logits, tol=1e-5)


# ------------------------------------------------------------------------------------------------ checkpoints


def test_checkpoint_round_trip_is_bit_identical(tmp_path):
    """config.json spells the layout for transformers (linear_attention) and keeps the hybrid's own types; the
    package's class, the bundled code (trust_remote_code) and load_model all load the same logits, bit for bit."""
    from transformers import AutoModelForCausalLM

    from linearize.io.sources import load_model

    hybrid = mixed_hybrid()
    rec = R.load("lolcats", {"attention.window": 4, "attention.decay": "learned", "attention.delta_qk_map": True,
                             "attention.delta_output_gate": True})
    out = tmp_path / "gdn"
    save_checkpoint(hybrid, char_tokenizer(), out, base="tiny", recipe=rec)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["layer_types"] == [LINEAR, LINEAR, FULL, LINEAR] and cfg["hybrid_layer_types"] == MIXED
    assert (out / "linearize_delta_attention.py").is_file() and (out / "linearize_kernels_delta.py").is_file()
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hybrid(ids).logits
        greedy = hybrid.generate(ids[:, :8], max_new_tokens=6, do_sample=False)
        for loaded in (LinearizeForCausalLM.from_pretrained(out),
                       AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True),
                       load_model(str(out), device="cpu")[0]):
            loaded.eval()
            assert [type(m).__name__ for m in loaded.linear_modules()][1:] == ["GatedDeltaAttention"] * 2
            assert torch.equal(loaded(ids).logits, want)
            assert torch.equal(loaded.generate(ids[:, :8], max_new_tokens=6, do_sample=False), greedy)


def test_config_layout_fields():
    from linearize.model.modeling import LinearizeConfig

    cfg = LinearizeConfig(layer_types=MIXED, num_hidden_layers=4)
    assert cfg.layer_types == [LINEAR, LINEAR, FULL, LINEAR] and cfg.hybrid_layer_types == MIXED
    assert cfg.linear_layers == [0, 1, 3]
    old = LinearizeConfig(layer_types=[LINEAR, FULL], num_hidden_layers=2)  # written before gated delta layers
    assert old.hybrid_layer_types == [LINEAR, FULL]
    with pytest.raises(ValueError, match="does not spell"):
        LinearizeConfig(layer_types=[FULL, LINEAR], hybrid_layer_types=[GATED_DELTA, FULL], num_hidden_layers=2)


@pytest.mark.slow
def test_trust_remote_code_without_the_package(tmp_path):
    """A process that cannot import linearize nor triton loads a gdn checkpoint and computes the same logits
    (prefill, cached greedy decoding)."""
    from test_hybrid_models import _NO_PACKAGE

    hybrid = gdn_hybrid("1:1")
    out = tmp_path / "ckpt"
    save_checkpoint(hybrid, char_tokenizer(), out, base="tiny", recipe=R.load("gdn"))
    ids = torch.randint(0, 28, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.save({"ids": ids, "want": hybrid(ids).logits,
                    "greedy": hybrid.generate(ids[:, :6], max_new_tokens=6, do_sample=False)}, tmp_path / "want.pt")
    code = _NO_PACKAGE + (
        "import torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
        f"d = torch.load({str(tmp_path / 'want.pt')!r})\n"
        "with torch.no_grad():\n"
        "    diff = (m(d['ids']).logits - d['want']).abs().max().item()\n"
        "    same = torch.equal(m.generate(d['ids'][:, :6], max_new_tokens=6, do_sample=False), d['greedy'])\n"
        "print(type(m.model.layers[0].self_attn).__name__, diff, same, 'linearize' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    name, diff, same, imported = res.stdout.split()[-4:]
    assert (name, same, imported) == ("GatedDeltaAttention", "True", "False") and float(diff) <= 1e-5


# ------------------------------------------------------------------------------------------------- training


def test_stage1_trains_the_new_parameters_only(corpus, monkeypatch, tmp_path):
    """Attention transfer moves every new parameter, lowers the held-out attention error, and leaves the adopted
    projections (which compute the teacher) and everything else bit for bit."""
    from linearize.train import distill as D

    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    model = tiny_model("llama", layers=2)
    model.resize_token_embeddings(64)
    rec = R.load("gdn", {"distill.data": corpus, "distill.seq_len": 64, "distill.batch_size": 2,
                         "distill.tokens": 64 * 2 * 12, "distill.warmup_steps": 1, "distill.eval_seqs": 4,
                         "attention.delta_qk_map": True, "attention.delta_output_gate": True})
    hybrid = linearize_model(model, select_layout(2, ratio="1:0"), rec)
    before = {n: p.detach().clone() for n, p in hybrid.named_parameters()}
    rep = D.distill(hybrid, char_tokenizer(), rec, progress=False, log=lambda m: None)
    assert rep["heldout_mse_end_mean"] < rep["heldout_mse_start_mean"]
    learned = {id(p) for m in hybrid.linear_modules() for p in m.learned_parameters()}
    for n, p in hybrid.named_parameters():
        assert torch.equal(p, before[n]) != (id(p) in learned), n


def test_probe_scores_gated_delta_layers(tmp_path, monkeypatch):
    """--select auto's probe converts every layer to the recipe's gated delta layer, trains and scores them, and its
    trained parameters start the real conversion's layers."""
    from conftest import tiny_workspace
    from linearize.convert import probe as P
    from linearize.io.sources import load_model

    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    ws = tiny_workspace(tmp_path, char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 .,?", lowercase=True), 4)
    model, tok = load_model(str(ws / "tiny"), device="cpu")
    rec = R.load("gdn", {"distill.data": str(ws / "corpus.txt"), "distill.seq_len": 64, "distill.batch_size": 2,
                         "distill.eval_seqs": 2, "select.retrieval_length": 400, "select.retrieval_prompts": 2})
    res = P.run_probe(model, tok, rec, probe_tokens=256, progress=False, log=lambda m: None)
    scores = res.scores(P.score_weights(rec))
    assert len(scores) == 4 and sum(scores) == pytest.approx(1.0)
    assert sorted(res.maps) == sorted(f"{i}.{n}" for i in range(4)
                                      for n in ("beta.weight", "beta.bias", "decay.weight", "decay.bias", "q_scale",
                                                "q_map", "k_map"))
    hybrid = linearize_model(model, select_layout(4, ratio="3:1"), rec)
    assert P.apply_feature_maps(hybrid, res.maps) == [0, 1, 2]
    assert torch.equal(hybrid.model.layers[1].self_attn.beta.bias, res.maps["1.beta.bias"])


# ---------------------------------------------------------------------------------------------------- recipe


def test_gdn_recipe_is_shipped_and_valid():
    assert "gdn" in R.available()
    rec = R.load("gdn")
    att = rec["attention"]
    assert att["layer_type"] == GATED_DELTA and att["window"] == 0 and att["decay"] == "learned"
    assert rec["distill"]["xent_weight"] == 0
    assert R.load("lolcats")["attention"]["layer_type"] == LINEAR  # the linear recipes are unchanged


@pytest.mark.parametrize("overrides,needle", [
    ({"attention.delta_beta_init": 1.5}, "attention.delta_beta_init = 1.5: must be a number in (0, 1)"),
    ({"attention.delta_q_scale": 0}, "attention.delta_q_scale = 0.0: must be a number in (0, 64]"),
    ({"attention.layer_type": "mamba"}, "attention.layer_type = 'mamba': must be one of linear_attention, gated_delta"),
    ({"attention.window": 64}, "attention.window = 64: gated_delta layers (attention.layer_type) have no sliding"),
    ({"distill.xent_weight": 1.0}, "distill.xent_weight = 1.0: gated_delta layers (attention.layer_type) have no"),
    ({"attention.delta_output_gate": "yes"}, "attention.delta_output_gate = 'yes': must be true or false"),
])
def test_bad_recipe_values_are_one_line(overrides, needle):
    with pytest.raises(R.RecipeError) as e:
        R.load("gdn", overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_lolcats_turned_gated_delta_names_the_window():
    with pytest.raises(R.RecipeError, match="set attention.window=0"):
        R.load("lolcats", {"attention.layer_type": "gated_delta"})


def test_bad_recipe_value_on_the_command_line(tmp_path):
    res = run_cli("convert", "smollm2-135m", "--recipe", "gdn", "--set", "attention.delta_beta_init=2", "-o",
                  str(tmp_path / "out"))
    assert res.returncode != 0 and not (tmp_path / "out").exists()
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "attention.delta_beta_init = 2.0: must be a number in (0, 1)" in err[0], res.stderr

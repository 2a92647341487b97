"""`linearize bench model`: hybrid vs original on CPU with a tiny config, the shipped published configs,
random materialization, the fixed-slot decode cache and one-line errors."""

from __future__ import annotations

import json
import resource

import pytest
import torch

from conftest import run_cli, tiny_model
from linearize.bench import costs
from linearize.bench import model as bm
from linearize import recipe as R
from linearize.convert.selection import select_layout
from linearize.convert.surgery import linearize_model

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
        "max_position_embeddings": 128, "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}

#: published parameter counts of the shipped configs
PUBLISHED = {"llama-3-8b": 8_030_261_248, "llama-3.2-1b": 1_235_814_400, "mistral-7b": 7_248_023_552,
             "qwen2.5-7b": 7_615_616_512, "qwen3-8b": 8_190_735_360, "qwen3-30b-a3b": 30_532_122_624,
             "gemma-3-1b": 999_885_952,  # Gemma 3 1B: counted from its published config (the model card says 1B)
             # vision-language Gemma 3: the text decoder linearize builds (model cards, with the ~0.42B vision
             # tower: 4.3B, 12.2B, 27.4B)
             "gemma-3-4b": 3_880_263_168, "gemma-3-12b": 11_766_034_176, "gemma-3-27b": 27_009_346_304}


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """Tiny models on a shared 2-core machine: one thread avoids OpenMP contention (seconds per matmul)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # for the CLI subprocess
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture()
def tiny_config(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


def test_cli_tiny_config_on_cpu(tiny_config, tmp_path):
    out = tmp_path / "bench"
    r = run_cli("bench", "model", str(tiny_config), "--random-weights", "--device", "cpu", "--lengths", "64,2048",
                "--batch", "1", "--decode-steps", "4", "-o", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "bench_model.json").read_text())
    assert res["meta"]["layout"].endswith("(3 linear, 1 softmax)") and res["meta"]["device"] == "cpu"
    assert res["meta"]["finished"]
    rows = {(x["model"], x["T"]): x for x in res["rows"]}
    assert set(rows) == {(m, t) for m in ("original", "hybrid") for t in (64, 2048)}
    for x in rows.values():
        assert x["status"] == "ok", x
        assert x["prefill_tok_s"] > 0 and x["decode_tok_s"] > 0
        assert x["decode_mode"] == "eager" and "CPU" in x["decode_note"]
        assert set(x["decode_modes"]) == set(x["decode_sdpa_s"]) and all("CPU" in v for v in x["decode_modes"].values())
        assert x["peak_bytes"] == "n/a"
        # measured cache == the closed form of costs.cache_bytes
        assert x["cache_bytes"] == x["cache_bytes_formula"]
    # the hybrid's state and its 512-token window rings are fixed-size: more than 64 tokens of KV, less than 2,048
    assert rows["hybrid", 64]["cache_bytes"] > rows["original", 64]["cache_bytes"]
    assert rows["hybrid", 2048]["cache_bytes"] < rows["original", 2048]["cache_bytes"]
    assert rows["original", 2048]["cache_bytes"] == 32 * rows["original", 64]["cache_bytes"]
    for q in res["ratios"]:
        h, o = rows["hybrid", q["T"]], rows["original", q["T"]]
        assert q["prefill_speedup"] == pytest.approx(h["prefill_tok_s"] / o["prefill_tok_s"], rel=1e-3)
        assert q["decode_speedup"] == pytest.approx(h["decode_tok_s"] / o["decode_tok_s"], rel=1e-3)
        assert q["cache_ratio"] == pytest.approx(h["cache_bytes"] / o["cache_bytes"], rel=1e-3)
        assert q["peak_ratio"] is None
        # the bounds: FLOPs per token and bytes per decode step of the original over the hybrid's
        T, co, ch = q["T"], o["cost"], h["cost"]
        # the hybrid's three converted layers attend exactly over their 512-token windows: sliding attention
        assert co["sliding_windows"] == [] and ch["sliding_windows"] == [512] * 3
        slide = 512 - 512 * 512 / (2 * T) if T > 512 else T / 2
        flops = [co["matmul_flops_per_token"] + co["attention_flops_per_token_per_T"] * T,
                 ch["matmul_flops_per_token"] + ch["attention_flops_per_token_per_T"] * T
                 + 3 * ch["attention_flops_per_key"] * slide]
        assert q["prefill_bound"] == pytest.approx(flops[0] / flops[1], rel=1e-3)
        step = [c["decode_weight_bytes"] + x["cache_bytes"] for c, x in ((co, o), (ch, h))]
        assert q["decode_bound"] == pytest.approx(step[0] / step[1], rel=1e-3)
    # tied embeddings (TINY): the table is read every decode step as the output layer; 4 vs 1 softmax layers
    co, ch = rows["original", 64]["cost"], rows["hybrid", 64]["cost"]
    assert co["attention_flops_per_token_per_T"] == 2 * 4 * 4 * 16 and ch["attention_flops_per_token_per_T"] == 2 * 4 * 16
    assert co["decode_weight_bytes"] == res["meta"]["original_parameters"] * 4  # fp32 on CPU, nothing left out
    assert co["matmul_flops_per_token"] == 2 * (res["meta"]["original_parameters"] - 256 * 64)
    assert "the hybrid's shapes allow prefill" in r.stdout
    assert "bench model: hybrid vs original" in r.stdout and "wrote" in r.stdout


def test_several_layouts_against_one_original_run(tiny_config, tmp_path):
    """``--ratio 3:1,1:0``: the original's rows once, then one set of rows, ratios and goals per layout, each
    hybrid with its own layout and the prefill chunk asked for."""
    out = tmp_path / "bench"
    r = run_cli("bench", "model", str(tiny_config), "--random-weights", "--device", "cpu", "--lengths", "64",
                "--batch", "1", "--decode-steps", "2", "--ratio", "3:1,1:0", "--prefill-chunk", "16", "-o", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "bench_model.json").read_text())
    assert [x["model"] for x in res["rows"]] == ["original", "hybrid 3:1", "hybrid 1:0"]
    assert all(x["status"] == "ok" for x in res["rows"])
    hybrids = {h["model"]: h for h in res["meta"]["hybrids"]}
    assert hybrids["hybrid 3:1"]["layer_types"].count("full_attention") == 1
    assert "full_attention" not in hybrids["hybrid 1:0"]["layer_types"]
    assert res["meta"]["prefill_chunk_tokens"] == {"hybrid 3:1": 16, "hybrid 1:0": 16}
    rows = {x["model"]: x for x in res["rows"]}
    # each hybrid's cache is its own layout's closed form: at 64 tokens a linear layer's state and window ring
    # outweigh a softmax layer's KV, so all-linear holds more
    assert all(x["cache_bytes"] == x["cache_bytes_formula"] for x in rows.values())
    assert rows["hybrid 1:0"]["cache_bytes"] > rows["hybrid 3:1"]["cache_bytes"]
    assert {q["model"] for q in res["ratios"]} == {"hybrid 3:1", "hybrid 1:0"}
    for q in res["ratios"]:
        assert q["cache_ratio"] == pytest.approx(rows[q["model"]]["cache_bytes"] / rows["original"]["cache_bytes"],
                                                 rel=1e-3)
    assert "hybrid 3:1 vs original" in r.stdout and "hybrid 1:0 vs original" in r.stdout


def test_set_changes_the_layers_it_times(tiny_config, tmp_path, capsys):
    """``--set attention.window=8``: the on-the-fly hybrid serves an 8-token window (its cache holds 8-slot rings,
    the closed form agrees), the run records and prints the override; a checkpoint's own settings are not
    overridden."""
    kw = dict(random_weights=True, device="cpu", lengths="64", batches="1", decode_steps=1, log=lambda m: None)
    wide = bm.bench_model(str(tiny_config), out_dir=tmp_path / "a", **kw)
    narrow = bm.bench_model(str(tiny_config), out_dir=tmp_path / "b", overrides={"attention.window": 8}, **kw)
    assert narrow["meta"]["overrides"] == {"attention.window": 8} and wide["meta"]["overrides"] == {}
    rows = [{x["model"]: x for x in r["rows"]} for r in (wide, narrow)]
    assert rows[0]["original"]["cache_bytes"] == rows[1]["original"]["cache_bytes"]
    h512, h8 = rows[0]["hybrid"], rows[1]["hybrid"]
    assert h8["cache_bytes"] == h8["cache_bytes_formula"] < h512["cache_bytes"] == h512["cache_bytes_formula"]
    bm.print_result(narrow)
    assert "| attention.window=8 |" in capsys.readouterr().out
    hybrid = tmp_path / "h.json"  # a hybrid's config: its settings are its own
    cfg = json.loads(tiny_config.read_text())
    hybrid.write_text(json.dumps({**cfg, "model_type": "linearize", "base_model_type": "llama",
                                  "layer_types": ["linear_attention", "full_attention"] * 2}))
    with pytest.raises(bm.LinearizeError, match="has its own linear-attention settings"):
        bm.bench_model(str(hybrid), out_dir=tmp_path / "c", overrides={"attention.window": 8}, **kw)


def test_a_row_that_cannot_fit_is_skipped_unrun(monkeypatch):
    """Weights plus the closed-form cache above the GPU's memory: the row is named as skipped, with both sizes."""
    model = tiny_model("llama", seed=0)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert bm.too_big(model, 1 << 30, 8, cpu) is None  # nothing is checked on a CPU
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 10 << 30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev=None: type("P", (), {"total_memory": 80 << 30}))
    p = next(model.parameters())
    per_token = costs.cache_bytes(model.config, 1, 1, p.element_size())["original"]
    fits = (70 << 30) // per_token
    assert bm.too_big(model, fits, 1, gpu) is None
    why = bm.too_big(model, fits + 1, 1, gpu)
    assert why.startswith("skipped: weights 10.0 GiB + cache") and "80.0 GiB" in why


def test_long_rows_warm_up_on_a_prefix():
    short = torch.zeros(8, 1 << 16, dtype=torch.long)
    assert bm.warmup_ids(short).shape == short.shape
    long = torch.zeros(16, 1 << 16, dtype=torch.long)  # 1M tokens
    assert bm.warmup_ids(long).shape == (16, bm.WARMUP_PREFIX)


@pytest.mark.parametrize("args, message", [
    (["no-such-model", "--random-weights"], "no shipped config"),
    (["llama-3-8b", "--random-weights", "--lengths", "4K,x"], "bad length"),
    (["llama-3-8b", "--random-weights", "--ratio", "3:1,7"], "expected A:B"),
    (["llama-3-8b", "--random-weights", "--prefill-chunk", "-1"], "--prefill-chunk"),
    (["llama-3-8b", "--random-weights", "--set", "distill.lr=1"], "only attention.* fields"),
    (["llama-3-8b", "--random-weights", "--set", "attention.window=-3"], "attention.window"),
])
def test_bad_inputs_one_line_exit_2(tmp_path, args, message):
    from typer.testing import CliRunner

    from linearize.cli import app

    out = tmp_path / "never"
    r = CliRunner().invoke(app, ["bench", "model", *args, "--device", "cpu", "-o", str(out)])
    assert r.exit_code == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr
    assert not out.exists()


def test_decode_profile_categories(tiny_config, tmp_path):
    """--profile: each row splits a few of its timed decode steps by category (CPU: operator time), the parts add up
    to the total and are printed; kernel names of a GPU profile land where they belong."""
    out = tmp_path / "bench"
    r = run_cli("bench", "model", str(tiny_config), "--random-weights", "--device", "cpu", "--lengths", "64",
                "--batch", "1", "--decode-steps", "2", "--profile", "-o", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "bench_model.json").read_text())
    for row in res["rows"]:
        prof = row["decode_profile_ms"]
        assert set(prof) == {"linear attention", "softmax attention", "matmul", "other", "total"}
        assert prof["total"] > 0 and prof["matmul"] > 0
        assert prof["total"] == pytest.approx(sum(v for k, v in prof.items() if k != "total"), abs=1e-3)
        top = row["decode_profile_other_top"]  # what "other" is made of, largest first, never more than it
        assert top and [ms for _, ms in top] == sorted((ms for _, ms in top), reverse=True)
        assert sum(ms for _, ms in top) <= prof["other"] + 1e-3
        assert not any(p.search(name.lower()) for name, _ in top for _, p in bm.PROFILE_CATEGORIES)
    assert "decode step, CPU operator time in ms" in r.stdout and "largest in other:" in r.stdout

    def category(name):
        return next((c for c, p in bm.PROFILE_CATEGORIES if p.search(name.lower())), "other")

    assert category("_window_step_kernel") == category("_window_step_commit_kernel") == "linear attention"
    assert category("_la_fwd_kernel") == category("_hedgehog_map_kernel") == category("_rotary_kernel") == "linear attention"
    assert category("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16") == "softmax attention"
    assert category("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT") == category("aten::mm") == "matmul"
    assert category("void at::native::vectorized_elementwise_kernel<4>") == category("aten::mul") == "other"
    mul = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<"
           "c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > >(int")
    assert bm.kernel_label(mul) == "MulFunctor" and bm.kernel_label("aten::mul") == "aten::mul"
    assert bm.kernel_label("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
                           "at::native::MeanOps<float, float, float, float>, unsigned int>") == "MeanOps"
    assert bm.kernel_label("void at::native::radixSortKVInPlace<-2, -1, 32, 4, long, long>(x)") == "radixSortKVInPlace"


def test_cost_model_of_the_llama3_8b_shape():
    """The bounds' inputs on the Llama-3-8B config (meta device, untied embeddings): ~14 GFLOP of products per
    prefill token, 2 T H d of attention per softmax layer, every weight but the input table read per step."""
    from transformers import AutoModelForCausalLM

    cfg, _ = bm.load_config("llama-3-8b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    c = costs.cost_model(model)
    table = 128256 * 4096
    assert c["matmul_flops_per_token"] == 2 * (PUBLISHED["llama-3-8b"] - 2 * table)
    assert c["attention_flops_per_token_per_T"] == 2 * 32 * 32 * 128
    assert c["decode_weight_bytes"] == 2 * (PUBLISHED["llama-3-8b"] - table)


def test_cost_model_of_sliding_layers():
    """Gemma 3 1B (meta device): the 4 global layers cost 2 T H d per token, the 22 sliding ones 4 H d per key they
    see (w - w^2 / 2T of a T-token prefill, T / 2 below the window)."""
    from transformers import AutoModelForCausalLM

    cfg, _ = bm.load_config("gemma-3-1b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    c = costs.cost_model(model)
    assert c["attention_flops_per_token_per_T"] == 2 * 4 * 4 * 256 and c["sliding_windows"] == [512] * 22
    matmul = c["matmul_flops_per_token"]
    assert costs.flops_per_token(c, 256) == matmul + 2 * 16 * 256 * 256 + 22 * 4 * 4 * 256 * 128
    assert costs.flops_per_token(c, 4096) == matmul + 2 * 16 * 256 * 4096 + 22 * 4 * 4 * 256 * (512 - 512 * 512 / 8192)


def test_cost_model_of_a_mixture_of_experts():
    """Qwen3-30B-A3B (48 layers of 128 experts, 8 per token): a prefill token multiplies by the dense weights and
    1/16 of the routed experts (~3B); a decode step reads every dense weight and the experts at least one of its
    tokens is routed to (1/16 at batch 1, 1 - (15/16)^8 at batch 8)."""
    from transformers import AutoModelForCausalLM

    cfg, _ = bm.load_config("qwen3-30b-a3b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    c = costs.cost_model(model)
    experts = 48 * 128 * (2 * 768 * 2048 + 2048 * 768)
    table = 151936 * 2048
    dense = PUBLISHED["qwen3-30b-a3b"] - experts
    assert c["expert_bytes"] == 2 * experts and c["expert_share"] == 8 / 128
    assert c["matmul_flops_per_token"] == 2 * (dense - 2 * table + experts // 16)
    assert c["decode_weight_bytes"] == 2 * (dense - table)
    assert costs.decode_read_bytes(c, 1) == pytest.approx(2 * (dense - table) + 2 * experts / 16)
    assert costs.decode_read_bytes(c, 8) == pytest.approx(2 * (dense - table) + 2 * experts * (1 - (15 / 16) ** 8))
    for family in ("mixtral", "qwen2_moe", "qwen3_moe"):  # a hybrid reads the routing from its base config
        hybrid = linearize_model(tiny_model(family), select_layout(4, ratio="3:1"), R.load("lolcats"))
        assert costs.cost_model(hybrid)["expert_share"] == 2 / 4
    tiny = tiny_model("qwen3")  # dense, tied table, fp32: a step reads every weight at any batch
    dense = costs.cost_model(tiny)
    assert dense["expert_bytes"] == 0 and costs.decode_read_bytes(dense, 8) == sum(p.numel() * 4 for p in tiny.parameters())


def test_llama3_8b_config_on_meta_has_the_published_shape():
    from transformers import AutoModelForCausalLM

    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    cfg, name = bm.load_config("llama-3-8b")
    assert name == "llama-3-8b"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (4096, 32, 32, 8, 14336, 128256)
    assert cfg.rope_parameters["rope_theta"] == 500000.0 and cfg.max_position_embeddings >= 131072
    assert not cfg.tie_word_embeddings
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED["llama-3-8b"]
    assert all(p.is_meta for p in model.parameters())
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert grown_mib < 1024, f"building on meta raised peak RSS by {grown_mib:.0f} MiB (16 GiB if materialized)"


@pytest.mark.parametrize("alias", sorted(PUBLISHED))
def test_shipped_configs_are_aliases_with_published_sizes(alias):
    from transformers import AutoModelForCausalLM

    from linearize.io.aliases import ALIASES

    assert set(bm.shipped_configs()) == set(PUBLISHED)
    assert alias in ALIASES
    assert bm.config_source(ALIASES[alias])[1] == alias  # the hub id resolves through the alias table
    cfg, _ = bm.load_config(alias)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[alias]


def test_random_materialization_on_device():
    cfg, _ = bm.load_config(_write_tiny())
    model = bm.random_model(cfg, dtype=torch.float32, device="cpu")
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings stay tied
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    assert 0.015 < model.model.layers[0].mlp.up_proj.weight.std().item() < 0.025
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_config(cfg)
    assert torch.equal(model.model.rotary_emb.inv_freq, fresh.model.rotary_emb.inv_freq)


def _write_tiny(config: dict | None = None):
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "tiny.json"
    path.write_text(json.dumps(config or TINY))
    return str(path)


@torch.no_grad()
def test_original_prefills_in_pieces_where_one_forward_runs_out_of_memory(monkeypatch):
    """The original's prefill in pieces (the rows together) leaves the cache one forward leaves, and decodes the
    same; a row whose one-forward prefill runs out of memory is prefilled again in pieces and measured, its note
    saying so; without pieces it stays out of memory."""
    cfg, _ = bm.load_config(_write_tiny())
    model = bm.random_model(cfg, dtype=torch.float32, device="cpu")
    T = 33
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(1))
    whole, pieces = bm.prefill(model, ids), bm.prefill(model, ids, pieces=20)  # 10 tokens per row: 4 pieces
    for a, b in zip(whole.layers, pieces.layers):
        assert a.keys.shape == b.keys.shape == (2, 2, T, 16)
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.values, a.values, rtol=1e-5, atol=1e-5)
    real, calls = bm.prefill, []

    def tight(model, ids, pieces=0):  # one forward over 2 x 33 tokens does not fit; pieces of 20 do
        calls.append(pieces)
        if not pieces:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, ids, pieces)

    monkeypatch.setattr(bm, "prefill", tight)
    kw = dict(steps=2, backends=[None], dev=torch.device("cpu"), timing=bm.Timing(min_time=0.0, max_reps=1,
                                                                                    warmup_steps=1))
    row = bm.bench_row(model, "original", T, 2, pieces=20, **kw)
    assert row["status"] == "ok" and row["prefill_pieces_tokens"] == 20 and calls[0] == 0 and set(calls[1:]) == {20}
    assert "pieces of 20 tokens" in row["note"] and row["decode_tok_s"] > 0
    assert row["cache_bytes"] == bm.cache_nbytes(whole)
    row = bm.bench_row(model, "original", T, 2, **kw)
    assert row["status"] == "oom" and row["prefill_tok_s"] == "oom" and "prefill_pieces_tokens" not in row
    assert bm.bench_row(model, "original", T, 2, pieces=66, **kw)["status"] == "oom"  # one piece is the whole


def test_original_prefill_halves_its_pieces_until_they_fit(monkeypatch):
    """Pieces of the hybrids' default that still run out of memory are halved until a prefill fits (the 8B
    original at 32K x 8 on an 80 GB GPU), down to the floor per row; the row names the pieces it used."""
    cfg, _ = bm.load_config(_write_tiny())
    model = bm.random_model(cfg, dtype=torch.float32, device="cpu")
    real, calls = bm.prefill, []

    def fits_below(limit):
        def tight(model, ids, pieces=0):
            calls.append(pieces)
            if not pieces or pieces > limit:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return real(model, ids, pieces)
        return tight

    monkeypatch.setattr(bm, "MIN_PIECE_ROW_TOKENS", 2)
    kw = dict(steps=2, backends=[None], dev=torch.device("cpu"), timing=bm.Timing(min_time=0.0, max_reps=1,
                                                                                    warmup_steps=1))
    monkeypatch.setattr(bm, "prefill", fits_below(10))
    row = bm.bench_row(model, "original", 33, 2, pieces=40, **kw)
    assert calls[:3] == [0, 40, 20] and set(calls[3:]) == {10}
    assert row["status"] == "ok" and row["prefill_pieces_tokens"] == 10 and "halved from" in row["note"]
    calls.clear()
    monkeypatch.setattr(bm, "prefill", fits_below(1))  # under the floor: out of memory, after 40, 20, 10, 5
    row = bm.bench_row(model, "original", 33, 2, pieces=40, **kw)
    assert row["status"] == "oom" and calls == [0, 40, 20, 10, 5]


def test_decode_cache_steps_in_place_at_position_t_minus_1():
    cfg, _ = bm.load_config(_write_tiny())
    model = bm.random_model(cfg, dtype=torch.float32, device="cpu")
    T = 33
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(0))
    full = model(input_ids=ids).logits[:, -1]
    cache = bm.prefill(model, ids)
    assert bm.cache_nbytes(cache) == 4 * 2 * (2 * 2 * T * 16 * 4)  # layers x (K, V) x [B, Hk, T, D] fp32
    dcache = bm.decode_cache(cache, T)
    ptr = dcache.layers[0].keys.data_ptr()
    kw = dict(input_ids=ids[:, -1:], position_ids=torch.full((2, 1), T - 1), use_cache=True, logits_to_keep=1,
              **bm._cache_kwargs(model, dcache))
    for _ in range(3):  # re-decoding the last token at its own position reproduces the full forward
        step = model(**kw).logits[:, -1]
        torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-4)
    assert dcache.layers[0].keys.data_ptr() == ptr and dcache.layers[0].keys.shape[2] == T

    from linearize import recipe as recipes

    hybrid = bm._surgery(model, ["linear_attention"] * 3 + ["full_attention"], recipes.load("lolcats")["attention"])
    cache = bm.prefill(hybrid, ids)
    dcache = bm.decode_cache(cache, T)
    window_state = dcache.layers[0].state
    assert int(window_state.seen) == T
    kw = dict(input_ids=ids[:, -1:], position_ids=torch.full((2, 1), T - 1), use_cache=True, logits_to_keep=1,
              **bm._cache_kwargs(hybrid, dcache))
    out = hybrid(**kw).logits
    assert out.shape == (2, 1, 256) and torch.isfinite(out).all()
    assert int(window_state.seen) == T + 1  # the linear layers advanced their state in place


@torch.no_grad()
def test_decode_cache_of_sliding_layers(monkeypatch):
    """A layer that slides over W = 16 tokens keeps the last 15 after a 33-token prefill: its decode-timing layer
    gets a 16th slot, so a step attends to the 16 keys a real step does (none masked), in place; the full layer keeps
    all 33."""
    tiny = dict(TINY, model_type="gemma3_text", sliding_window=16, query_pre_attn_scalar=16,
                layer_types=["sliding_attention"] * 3 + ["full_attention"])
    cfg, _ = bm.load_config(_write_tiny(tiny))
    model = bm.random_model(cfg, dtype=torch.float32, device="cpu")
    T = 33
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(0))
    from linearize import recipe as recipes

    hybrid = bm._surgery(model, ["linear_attention", "full_attention", "linear_attention", "full_attention"],
                         recipes.load("lolcats")["attention"])
    for m in (hybrid, bm.random_model(cfg, dtype=torch.float32, device="cpu")):
        dcache = bm.decode_cache(bm.prefill(m, ids), T)
        kv = {i: layer for i, layer in enumerate(dcache.layers) if hasattr(layer, "slot")}
        assert kv[1].keys.shape[2] == 16 and kv[1].get_mask_sizes(1) == (16, T - 16) and kv[1].is_sliding
        assert kv[3].keys.shape[2] == T and kv[3].get_mask_sizes(1) == (T, 0) and not kv[3].is_sliding
        keys_seen = []
        real_sdpa = torch.nn.functional.scaled_dot_product_attention

        def spy(q, k, v, attn_mask=None, *args, **kwargs):
            keys_seen.append((k.shape[2], attn_mask is None or bool(attn_mask.all())))
            return real_sdpa(q, k, v, attn_mask, *args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        ptr = kv[1].keys.data_ptr()
        kw = dict(input_ids=ids[:, -1:], position_ids=torch.full((2, 1), T - 1), use_cache=True, logits_to_keep=1,
                  **bm._cache_kwargs(m, dcache))
        for _ in range(2):
            assert torch.isfinite(m(**kw).logits).all()
        monkeypatch.undo()
        assert kv[1].keys.data_ptr() == ptr
        assert (16, True) in keys_seen and (T, True) in keys_seen and all(ok for _, ok in keys_seen)


#: aten ops that read a tensor back to the host (or have data-dependent shapes): each breaks CUDA-graph capture
HOST_SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero"}


@torch.no_grad()
@pytest.mark.parametrize("capturing", [False, True], ids=["eager", "capturing"])
@pytest.mark.parametrize("kind", ["original", "hybrid"])
def test_decode_step_is_graph_capturable(kind, capturing, monkeypatch):
    """What the CUDA-graph capture on the GPU needs, checked on CPU: the decode step reads nothing back to the
    host, and SDPA runs without a mask (so flash / cuDNN are eligible), also while a stream is capturing (where
    transformers 5.17 builds a mask unless the attention implementation has no mask function) and with the
    same logits as without the maskless implementation."""
    import transformers.utils.import_utils as tf_import_utils
    from torch.utils._python_dispatch import TorchDispatchMode

    from linearize import recipe as recipes

    cfg, _ = bm.load_config(_write_tiny())
    model = bm.random_model(cfg, dtype=torch.float32, device="cpu")
    if kind == "hybrid":
        model = bm._surgery(model, ["linear_attention"] * 3 + ["full_attention"], recipes.load("lolcats")["attention"])
    T = 40
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(1))

    def first_step():  # a fresh decode cache each time: the linear layers advance their state in place
        dcache = bm.decode_cache(bm.prefill(model, ids), T)
        return dict(input_ids=ids[:, -1:], position_ids=torch.full((2, 1), T - 1), use_cache=True, logits_to_keep=1,
                    **bm._cache_kwargs(model, dcache))

    reference = model(**first_step()).logits
    kw = first_step()
    if capturing:  # what transformers sees inside torch.cuda.graph(...)
        monkeypatch.setattr(tf_import_utils, "is_cuda_stream_capturing", lambda: True)
    sdpa_masks = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        sdpa_masks.append(kwargs.get("attn_mask", args[3] if len(args) > 3 else None))
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)

    class Ops(TorchDispatchMode):
        seen: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.seen.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    with Ops(), bm._maskless_sdpa(model):
        logits = model(**kw).logits
    assert model.config._attn_implementation == "sdpa"  # restored
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    assert not (Ops.seen & HOST_SYNC_OPS), Ops.seen & HOST_SYNC_OPS
    assert sdpa_masks and all(m is None for m in sdpa_masks)
    assert len(sdpa_masks) == (1 if kind == "hybrid" else 4)


def test_parse_sdpa():
    assert bm.parse_sdpa("flash, cudnn") == ["flash", "cudnn"]
    with pytest.raises(bm.LinearizeError, match="--sdpa"):
        bm.parse_sdpa("flash,fast")

"""The conversion's plan (linearize.convert.plan): the spec resolved once, the layout decided once for every combination
of options, the token budget split per stage."""

import dataclasses
import json
import sys

import pytest

from conftest import char_tokenizer, tiny_model, tiny_workspace
from linearize.convert import pipeline
from linearize.io import sources
from linearize import recipe as R
from linearize.errors import LinearizeError, SelectionError
from linearize.convert.plan import (Layout, LayoutOptions, RunOptions, TrainingOptions, build_plan, decide_layout,
                                    default_output_name, plan_auto_select, split_tokens)
from linearize.convert.selection import FULL, LINEAR


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A tiny 4-layer llama directory with a character tokenizer and a corpus."""
    return tiny_workspace(tmp_path_factory.mktemp("plan"), char_tokenizer(), layers=4)


# ------------------------------------------------------------------------------------ the spec, resolved once


def test_convert_resolves_the_spec_once(ws, tmp_path, monkeypatch):
    """A surgery-only convert: one call of the resolver, whatever module calls it (plan, loading, naming, saving)."""
    calls = []
    original = sources.resolve

    def counting(spec):
        calls.append(spec)
        return original(spec)

    for module in [m for name, m in sys.modules.items() if name == "linearize" or name.startswith("linearize.")]:
        if getattr(module, "resolve", None) is original:  # `from .sources import resolve` copies too
            monkeypatch.setattr(module, "resolve", counting)
    logs = []
    out = pipeline.convert(str(ws / "tiny"), layout=LayoutOptions(ratio="1:1"), training=TrainingOptions(train=False),
                           run=RunOptions(out=tmp_path / "OUT", dtype="float32", device="cpu"), log=logs.append)
    assert calls == [str(ws / "tiny")]
    assert out == tmp_path / "OUT" and json.loads((out / "config.json").read_text())["layer_types"] == [
        LINEAR, FULL, LINEAR, FULL]
    assert logs == ["layers: LSLS  (2 linear, 2 softmax)"]


def test_plan_is_frozen_and_names_the_output(ws, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = build_plan(str(ws / "tiny"), layout=LayoutOptions(softmax_layers="0-1"),
                      training=TrainingOptions(train=False), log=lambda m: None)
    assert plan.source.kind == "dir" and plan.source_dir == (ws / "tiny").resolve()
    assert plan.base_config.num_hidden_layers == 4 and plan.recipe.name == "lolcats"
    assert plan.layout == Layout("softmax_layers", "3:1", "0-1") and plan.auto is None
    assert plan.layer_types == [FULL, FULL, LINEAR, LINEAR]
    assert plan.out.name == "tiny-custom-lolcats" and plan.tokens == {"distill": None, "finetune": None}
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.out = tmp_path
    assert not list(tmp_path.iterdir())  # planning writes nothing


# --------------------------------------------------------------------------------------------- the layout


def _decide(method="interleave", train=True, fsdp=False, **options):
    logs = []
    layout = decide_layout(LayoutOptions(**options), method=method, train=train, fsdp=fsdp, log=logs.append)
    return layout, logs


OVERRIDE = "select: --softmax-layers overrides --select auto (no probe)"
FSDP = "select: interleave (the recipe's auto selection does not run under --fsdp)"
LAYOUTS = [  # (options, recipe method, train, fsdp) -> (mode, ratio, select as recorded, optional, logs)
    (dict(), "interleave", True, False, ("interleave", "3:1", "interleave", False, [])),
    (dict(ratio="1:1"), "interleave", True, False, ("interleave", "1:1", "interleave", False, [])),
    (dict(), "auto", True, False, ("auto_count", "3:1", "auto", True, [])),  # the recipe's auto: optional
    (dict(ratio="1:1"), "auto", True, False, ("auto_count", "1:1", "auto", True, [])),
    (dict(), "auto", False, False, ("interleave", "3:1", "interleave", False, [])),  # surgery only: no probe
    (dict(), "auto", True, True, ("interleave", "3:1", "interleave", False, [FSDP])),
    (dict(select="interleave"), "auto", True, False, ("interleave", "3:1", "interleave", False, [])),
    (dict(select="auto"), "interleave", True, False, ("auto_count", "3:1", "auto", False, [])),
    (dict(select="AUTO"), "interleave", False, False, ("auto_count", "3:1", "auto", False, [])),  # runs the probe
    (dict(select="auto"), "interleave", True, True, ("auto_count", "3:1", "auto", False, [])),  # fsdp refuses it
    (dict(kv_budget="2GB@32K"), "interleave", True, False, ("auto_kv", "3:1", "auto", False, [])),
    (dict(select="auto", kv_budget="2GB@32K"), "auto", False, False, ("auto_kv", "3:1", "auto", False, [])),
    (dict(softmax_layers="1,3"), "interleave", True, False, ("softmax_layers", "3:1", "interleave", False, [])),
    (dict(softmax_layers="1,3"), "auto", True, False, ("softmax_layers", "3:1", "interleave", False, [])),
    (dict(softmax_layers="1,3", ratio="1:1"), "auto", True, True, ("softmax_layers", "1:1", "interleave", False, [])),
    (dict(softmax_layers="1,3", select="auto"), "interleave", True, False,
     ("softmax_layers", "3:1", "auto", False, [OVERRIDE])),
    (dict(softmax_layers="1,3", kv_budget="2GB@32K"), "interleave", True, False,
     ("softmax_layers", "3:1", "auto", False, [OVERRIDE])),
]


@pytest.mark.parametrize("options,method,train,fsdp,expected", LAYOUTS)
def test_layout_decision(options, method, train, fsdp, expected):
    layout, logs = _decide(method, train, fsdp, **options)
    assert (layout.mode, layout.ratio, layout.select, layout.optional, logs) == expected
    assert layout.softmax_layers == options.get("softmax_layers") and layout.kv_budget == options.get("kv_budget")
    assert layout.auto == expected[0].startswith("auto")


@pytest.mark.parametrize("options,needle", [
    (dict(select="best"), "--select 'best'"),
    (dict(select="interleave", kv_budget="2GB@32K"), "needs --select auto"),
    (dict(ratio="1:1", kv_budget="2GB@32K"), "pass one"),
    (dict(kv_budget="lots"), "--kv-budget"),
    (dict(ratio="3-1"), "--ratio '3-1'"),
    (dict(softmax_layers="1,x"), "--softmax-layers '1,x'"),
])
def test_layout_refusals_are_one_line(options, needle):
    with pytest.raises(SelectionError, match=needle) as e:
        _decide("auto", **options)
    assert "\n" not in str(e.value)


def test_what_the_layout_names_and_records():
    assert default_output_name("m", _decide()[0], "lolcats") == "m-3to1-lolcats"
    assert default_output_name("m", _decide(ratio="1:1", select="auto")[0], "elu") == "m-1to1-auto-elu"
    kv = _decide(kv_budget="2GB@32K")[0]
    assert default_output_name("m", kv, "lolcats") == "m-kv2GB-32K-auto-lolcats"
    assert kv.recorded() == {"ratio": None, "softmax_layers": None, "select": "auto", "kv_budget": "2GB@32K"}
    custom = _decide(softmax_layers="1,3", kv_budget="2GB@32K")[0]
    assert default_output_name("m", custom, "lolcats") == "m-custom-lolcats"
    assert custom.recorded() == {"ratio": None, "softmax_layers": "1,3", "select": "auto", "kv_budget": "2GB@32K"}
    assert _decide(ratio="1:1")[0].recorded() == {"ratio": "1:1", "softmax_layers": None, "select": "interleave",
                                                  "kv_budget": None}
    back = _decide("auto")[0].fall_back()
    assert (back.mode, back.select, back.optional) == ("interleave", "interleave", False)
    assert default_output_name("m", back, "lolcats") == "m-3to1-lolcats"


# ---------------------------------------------------------------------------------- auto, once the config is read


def _auto(method="interleave", swap_rounds=0, tokens=None, finetune=True, **options):
    """``plan_auto_select`` on a tiny 4-layer llama's config (no weights) with a small-step lolcats."""
    rec = R.load("lolcats", {"attention.window": 8, "distill.seq_len": 32, "distill.batch_size": 2,
                             "select.retrieval_length": 400, "select.retrieval_prompts": 2,
                             "select.swap_rounds": swap_rounds})
    layout, logs = _decide(method, **options)
    budgets = split_tokens(TrainingOptions(tokens=tokens, finetune=finetune))
    layout, auto = plan_auto_select(layout, tiny_model("llama", layers=4).config, rec, budgets, dtype="float32",
                                    device="cpu", train=True, log=logs.append)
    return layout, auto, logs


def test_auto_by_count_and_by_kv_budget():
    layout, auto, logs = _auto("auto", ratio="1:1", tokens="6400")
    assert layout.mode == "auto_count" and not logs
    assert (auto.count, auto.count_from, auto.interleave) == (2, "--ratio 1:1", (1, 3))
    assert (auto.stage1_tokens, auto.probe_tokens, auto.total_tokens) == (3200, 320, 6400) and auto.kv_detail is None
    layout, auto, logs = _auto(kv_budget="1GB@1K", tokens="6400")
    assert layout.mode == "auto_kv" and auto.count == 4 and auto.count_from == "--kv-budget 1GB@1K"
    assert auto.kv_detail["softmax_count"] == 4 and auto.interleave == (3,)  # what 3:1 would keep
    assert auto.kv_detail["dtype_bytes"] == 4  # float32
    assert _auto(tokens="6400", select="auto", ratio="1:1", finetune=False)[1].total_tokens == 6400


@pytest.mark.parametrize("options,log", [
    (dict(ratio="1:0", tokens="6400"), None),  # no softmax layer: nothing to choose
    (dict(ratio="0:1", tokens="6400"), None),  # every layer softmax
    (dict(ratio="1:1", tokens="192"), "select: interleave (the recipe's auto selection does not fit: --select auto: "
                                      "the stage-1 budget of 96 tokens"),
    (dict(ratio="1:1", tokens="2560", swap_rounds=2), "select: interleave (the recipe's auto selection would score "
                                                      "the layers on about"),
])
def test_the_recipes_auto_gives_way_to_interleave(options, log):
    layout, auto, logs = _auto("auto", **options)
    assert auto is None and (layout.mode, layout.select, layout.optional) == ("interleave", "interleave", False)
    if log is None:
        assert logs == []
    else:
        assert len(logs) == 1 and logs[0].startswith(log), logs


def test_an_explicit_auto_refuses_instead():
    layout, auto, logs = _auto(select="auto", ratio="1:0", tokens="6400")
    assert layout.mode == "auto_count" and auto.count == 0 and not logs  # the probe is skipped when it runs
    layout, auto, logs = _auto(select="auto", ratio="1:1", tokens="2560", swap_rounds=2)
    assert auto is not None and auto.scoring_tokens > auto.total_tokens and not logs  # runs anyway
    with pytest.raises(SelectionError, match="less than one batch"):
        _auto(select="auto", ratio="1:1", tokens="192")
    with pytest.raises(SelectionError, match=r"limit 25%"):
        _auto(select="auto", ratio="1:1", tokens="192", finetune=False, swap_rounds=0)


def test_interleave_plans_no_probe():
    layout, auto, logs = _auto(ratio="1:1", tokens="192")
    assert layout.mode == "interleave" and auto is None and not logs


# ---------------------------------------------------------------------------------------------- the budgets


@pytest.mark.parametrize("options,expected", [
    (dict(), {"distill": None, "finetune": None}),  # the recipe's
    (dict(tokens="40M"), {"distill": 20_000_000, "finetune": 20_000_000}),
    (dict(tokens="41"), {"distill": 20, "finetune": 21}),
    (dict(tokens=1000, finetune=False), {"distill": 1000}),
    (dict(tokens="40M", distill_tokens="10M"), {"distill": 10_000_000, "finetune": 20_000_000}),
    (dict(tokens="40M", finetune_tokens="1M"), {"distill": 20_000_000, "finetune": 1_000_000}),
    (dict(distill_tokens="256K"), {"distill": 256_000, "finetune": None}),
    (dict(finetune_tokens="1_000", finetune=False), {"distill": None}),
])
def test_budget_split(options, expected):
    assert split_tokens(TrainingOptions(**options)) == expected


@pytest.mark.parametrize("options", [dict(tokens="lots"), dict(distill_tokens="0"),
                                     dict(finetune_tokens="1.5", finetune=False)])
def test_bad_budget_is_one_line(options):
    with pytest.raises(LinearizeError) as e:
        split_tokens(TrainingOptions(**options))
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------- the training length


def test_train_length_keeps_tokens_per_step():
    """--train-length sets both stages' sequence length and scales the batch and the held-out rows so a step and
    the held-out report keep the recipe's tokens; a field given with --set keeps its value."""
    from linearize.convert.plan import train_length_overrides

    rec = R.load("lolcats")  # 4 x 8,192 tokens a step, 2 held-out rows, in both stages
    got = train_length_overrides(rec, 2048, {"finetune.batch_size": 2})
    assert got == {"distill.seq_len": 2048, "distill.batch_size": 16, "distill.eval_seqs": 8,
                   "finetune.seq_len": 2048, "finetune.eval_seqs": 8}
    short = train_length_overrides(rec, 512, {})
    assert short["distill.batch_size"] == 64 and short["distill.eval_seqs"] == 32
    tiny = train_length_overrides(R.load("lolcats-cpu"), 2048, {})  # 2 x 512 rows a LoRA step: at least one row
    assert tiny["finetune.batch_size"] == 1 and tiny["finetune.eval_seqs"] == 1


def test_train_length_reaches_the_recipe_as_run(ws, tmp_path):
    plan = build_plan(str(ws / "tiny"), overrides={"distill.data": str(ws / "corpus.txt")},
                      layout=LayoutOptions(ratio="1:1"), training=TrainingOptions(train_length="512", tokens="128K"),
                      run=RunOptions(out=tmp_path / "OUT"), log=lambda m: None)
    assert plan.recipe["distill"]["seq_len"] == plan.recipe["finetune"]["seq_len"] == 512
    assert plan.recipe["distill"]["batch_size"] == 64 and plan.recipe["distill"]["data"] == str(ws / "corpus.txt")
    assert plan.recipe.overrides["finetune.eval_seqs"] == 32  # recorded in the checkpoint's linearize_recipe.yaml


@pytest.mark.parametrize("training,overrides,needle", [
    (dict(train_length="2K"), {}, "distill.seq_len 2048 is beyond"),  # the tiny model's context is 1,024 tokens
    (dict(), {"distill.seq_len": 2048}, "distill.seq_len 2048 is beyond"),  # one given with --set, too
    (dict(train_length="512", finetune=False), {"finetune.seq_len": 4096}, "both set the training length"),
    (dict(train_length="1k2"), {}, "bad --train-length"),
])
def test_train_length_refusals_are_one_line(ws, tmp_path, training, overrides, needle):
    with pytest.raises(LinearizeError) as e:
        build_plan(str(ws / "tiny"), overrides=overrides, layout=LayoutOptions(ratio="1:1"),
                   training=TrainingOptions(**training), run=RunOptions(out=tmp_path / "OUT"), log=lambda m: None)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "OUT").exists()


def test_the_recipes_own_length_fits_the_context(ws, tmp_path):
    """The recipe's 8K rows on a model of 1,024 positions: both stages train at 1,024 tokens (batch and held-out rows
    scaled as --train-length 1024 would), said in one line; a stage whose length is given keeps it."""
    logs = []
    plan = build_plan(str(ws / "tiny"), layout=LayoutOptions(ratio="1:1"), run=RunOptions(out=tmp_path / "A"),
                      log=logs.append)
    assert [plan.recipe[s]["seq_len"] for s in ("distill", "finetune")] == [1024, 1024]
    assert plan.recipe["distill"]["batch_size"] == 32 and plan.recipe["finetune"]["eval_seqs"] == 16
    assert plan.recipe.overrides["distill.seq_len"] == 1024  # recorded: a rerun of a stage trains the same
    assert "training at 1024 tokens, " in "\n".join(logs) and "the recipe's 8192 is longer" in "\n".join(logs)
    plan = build_plan(str(ws / "tiny"), overrides={"finetune.seq_len": 512}, layout=LayoutOptions(ratio="1:1"),
                      run=RunOptions(out=tmp_path / "B"), log=lambda m: None)
    assert [plan.recipe[s]["seq_len"] for s in ("distill", "finetune")] == [1024, 512]
    plan = build_plan(str(ws / "tiny"), layout=LayoutOptions(ratio="1:1"), training=TrainingOptions(train=False),
                      run=RunOptions(out=tmp_path / "C"), log=logs.append)
    assert plan.recipe["distill"]["seq_len"] == 8192  # nothing trains: the recipe as it is


def test_a_stage_that_does_not_run_is_not_checked(ws, tmp_path):
    """--no-finetune: only stage 1's length has to fit the context; --no-train: neither."""
    over = {"distill.seq_len": 256, "finetune.seq_len": 4096}
    build_plan(str(ws / "tiny"), overrides=over, layout=LayoutOptions(ratio="1:1"),
               training=TrainingOptions(finetune=False), run=RunOptions(out=tmp_path / "A"), log=lambda m: None)
    build_plan(str(ws / "tiny"), layout=LayoutOptions(ratio="1:1"), training=TrainingOptions(train=False),
               run=RunOptions(out=tmp_path / "B"), log=lambda m: None)

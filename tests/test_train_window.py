"""Train narrow, serve wide (``attention.train_window``): the recipe field, the width the probe and both training
stages run at, the width the layers keep afterwards, the reports and ``linearize info``."""

import pytest
import torch

from conftest import tiny_model
from linearize import recipe as R
from linearize.bench.info import describe_converted
from linearize.convert.probe import all_linear
from linearize.model.layout import training_width
from linearize.train import distill as D
from linearize.train import finetune as FT
from test_distill import _hybrid as distill_hybrid, _recipe as distill_recipe, _tokenizer, corpus  # noqa: F401
from test_finetune import QUIET, _hybrid as finetune_hybrid, _recipe as finetune_recipe


def record_widths(hybrid) -> list[int]:
    """The window of every linear layer at each of its training-mode forwards (appended as they run)."""
    seen = []
    for m in hybrid.linear_modules():
        m.register_forward_pre_hook(lambda mod, *a: seen.append(mod.window) if mod.training else None)
    return seen


def test_recipe_field():
    """The default recipe trains at 64 and serves at 512; a window given alone is trained and served at (off
    included); a training width given with window 0 is refused."""
    assert R.load("lolcats-cpu")["attention"]["train_window"] == 0
    assert training_width(R.load("lolcats-cpu")["attention"]) is None
    rec = R.load("lolcats")
    assert (rec["attention"]["window"], training_width(rec["attention"])) == (512, 64)
    off = R.load("lolcats", {"attention.window": 0})
    assert off["attention"]["train_window"] == 0 and training_width(off["attention"]) is None
    assert R.load("lolcats", {"attention.window": 128})["attention"]["train_window"] == 0  # given alone: both
    assert R.load("lolcats", {"attention.window": 128, "attention.train_window": 32})["attention"]["train_window"] == 32
    assert R.load("lolcats", {"attention.layer_windows": {"0-3": 256}})["attention"]["train_window"] == 64
    with pytest.raises(R.RecipeError, match="attention.window is 0, so the layers have no window to train"):
        R.load("lolcats", {"attention.window": 0, "attention.train_window": 64})
    for bad in (-1, 4097, 1.5):
        with pytest.raises(R.RecipeError, match="attention.train_window"):
            R.load("lolcats", {"attention.train_window": bad})
    assert R.load("lolcats")["finetune"]["train_window"] is None  # stage 2 as the probe and stage 1
    with pytest.raises(R.RecipeError, match="finetune.train_window = 0: attention.window is 0"):
        R.load("lolcats", {"attention.window": 0, "finetune.train_window": 0})
    with pytest.raises(R.RecipeError, match="finetune.train_window = 4096 is not shorter than finetune.seq_len"):
        R.check_training(R.load("lolcats-cpu", {"attention.window": 64, "finetune.train_window": 4096}),
                         {"finetune": None})


def test_training_rows_are_checked_against_the_training_width():
    """A served window as long as the rows is fine when the layers train narrower; a training width as long as the
    rows is not."""
    with pytest.raises(R.RecipeError, match="attention.window = 512 is not shorter than distill.seq_len = 512"):
        R.check_training(R.load("lolcats-cpu", {"attention.window": 512}), {"distill": None})
    R.check_training(R.load("lolcats-cpu", {"attention.window": 512, "attention.train_window": 64}),
                     {"distill": None, "finetune": None})
    with pytest.raises(R.RecipeError, match="attention.train_window = 512 is not shorter than distill.seq_len"):
        R.check_training(R.load("lolcats-cpu", {"attention.window": 64, "attention.train_window": 512}),
                         {"distill": None})
    # a hybrid checkpoint's own window is replaced by the training width too
    R.check_training(R.load("lolcats-cpu", {"attention.train_window": 64}), {"finetune": None}, window=4096)


def test_distill_trains_at_the_training_width_and_keeps_the_served_one(corpus, monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    hybrid = distill_hybrid()  # served at 8
    seen = record_widths(hybrid)
    rec = distill_recipe(corpus)
    rec = R.load("lolcats", {**{f"distill.{k}": v for k, v in rec["distill"].items()},
                             "attention.window": 8, "attention.train_window": 3})
    report = D.distill(hybrid, _tokenizer(), rec, progress=False, log=lambda m: None)
    assert seen and set(seen) == {3}
    assert report["train_window"] == 3
    assert {m.window for m in hybrid.linear_modules()} == {8}
    # per-step widths still draw within a training width; the layers still end at their own
    seen.clear()
    rec = R.load("lolcats", {**{f"distill.{k}": v for k, v in rec["distill"].items()}, "distill.windows": [2, 5],
                             "attention.window": 8, "attention.train_window": 3})
    D.distill(hybrid, _tokenizer(), rec, progress=False, log=lambda m: None)
    assert set(seen) <= {2, 3, 5} and {2, 5} <= set(seen)
    assert {m.window for m in hybrid.linear_modules()} == {8}


def test_the_width_changes_what_distill_learns(corpus, monkeypatch, tmp_path):
    """Not a label: the same run at another training width ends with other feature maps."""
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    base = {f"distill.{k}": v for k, v in distill_recipe(corpus)["distill"].items()}
    ends = []
    for width in (0, 3):
        hybrid = distill_hybrid()
        D.distill(hybrid, _tokenizer(), R.load("lolcats", {**base, "attention.window": 8,
                                                           "attention.train_window": width}),
                  progress=False, log=lambda m: None)
        ends.append(torch.cat([p.detach().flatten() for p in D.trainable_parameters(hybrid)]))
    assert not torch.allclose(ends[0], ends[1], atol=1e-5)


def test_finetune_trains_at_the_training_width_and_keeps_the_served_one(corpus):
    hybrid = finetune_hybrid()  # served at 8
    seen = record_widths(hybrid)
    base = {f"finetune.{k}": v for k, v in finetune_recipe(corpus, steps=2)["finetune"].items()}
    rec = R.load("lolcats", {**base, "attention.window": 8, "attention.train_window": 3})
    model, report = FT.finetune(hybrid, _tokenizer(), rec, **QUIET)
    assert seen and set(seen) == {3}
    assert report["train_window"] == 3
    assert {m.window for m in model.linear_modules()} == {8}


@pytest.mark.parametrize("own, width", [(0, 8), (5, 5)])
def test_finetune_trains_at_its_own_width(corpus, own, width):
    """``finetune.train_window`` sets stage 2's width apart from the probe's and stage 1's: 0 = the served one."""
    hybrid = finetune_hybrid()  # served at 8
    seen = record_widths(hybrid)
    base = {f"finetune.{k}": v for k, v in finetune_recipe(corpus, steps=2)["finetune"].items()}
    rec = R.load("lolcats", {**base, "attention.window": 8, "attention.train_window": 3, "finetune.train_window": own})
    assert training_width(rec["attention"]) == 3  # the probe and stage 1
    model, report = FT.finetune(hybrid, _tokenizer(), rec, **QUIET)
    assert seen and set(seen) == {width}
    assert report["train_window"] == (width if own else None)
    assert {m.window for m in model.linear_modules()} == {8}
    # `linearize info` reads the report: the layers trained at 3, stage 2 at its own width
    la = {**rec["attention"], "window": 8, "train_window": 3}
    fitted = "the served width" if own == 0 else str(own)
    assert describe_converted(la, report).endswith(f"8-token window (trained at 3, stage 2 at {fitted})")


def test_finetune_restores_the_width_when_it_fails(corpus):
    hybrid = finetune_hybrid()
    base = {f"finetune.{k}": v for k, v in finetune_recipe(corpus, steps=2)["finetune"].items()}
    rec = R.load("lolcats", {**base, "finetune.data": str(corpus) + ".missing", "attention.window": 8,
                             "attention.train_window": 3})
    with pytest.raises(Exception):
        FT.finetune(hybrid, _tokenizer(), rec, **QUIET)
    assert {m.window for m in hybrid.linear_modules()} == {8}


def test_the_probes_hybrid_runs_at_the_training_width():
    model = tiny_model("llama", layers=2, seed=0)
    rec = R.load("lolcats", {"attention.window": 8, "attention.train_window": 3, "attention.layer_windows": {"1": 6}})
    with all_linear(model, rec) as hybrid:
        assert [m.window for m in hybrid.linear_modules()] == [3, 3]
    with all_linear(model, R.load("lolcats", {"attention.window": 8, "attention.layer_windows": {"1": 6}})) as hybrid:
        assert [m.window for m in hybrid.linear_modules()] == [8, 6]


def test_info_says_what_the_layers_trained_at():
    la = dict(R.load("lolcats", {"attention.window": 512, "attention.train_window": 64, "attention.sinks": 16})
              ["attention"])
    assert describe_converted(la) == "linear attention, hedgehog maps, 512-token window (trained at 64), 16 sinks"
    la["layer_windows"] = {"24-29": 64}
    assert "512-token window (layers 24-29: 64, trained at 64)" in describe_converted(la)
    assert "(trained" not in describe_converted(dict(R.load("lolcats-cpu")["attention"]))
    assert describe_converted(dict(R.load("lolcats")["attention"])).endswith("512-token window (trained at 64)")
    # stage 2 as the layers (the default) or a report from before the field: no stage-2 note
    assert describe_converted(dict(R.load("lolcats")["attention"]), {"train_window": 64}).endswith("(trained at 64)")
    assert describe_converted(dict(R.load("lolcats")["attention"]), {}).endswith("(trained at 64)")
    served = dict(R.load("lolcats", {"attention.window": 512})["attention"])  # trained at the served width
    assert describe_converted(served, {"train_window": None}).endswith("512-token window")
    assert describe_converted(served, {"train_window": 64}).endswith("512-token window (stage 2 at 64)")


@pytest.mark.slow
def test_convert_trains_narrow_and_writes_a_wide_checkpoint(tmp_path, monkeypatch):
    """The command line end to end on a tiny model: the probe and both stages at the training width (the log, the
    reports), the checkpoint at the served one (config, info), and it loads and generates."""
    import json

    from conftest import char_tokenizer, run_cli, tiny_workspace

    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    ws = tiny_workspace(tmp_path / "ws", char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 .,?", lowercase=True),
                        layers=4)
    corpus = str(ws / "corpus.txt")
    sets = {"attention.window": 16, "attention.train_window": 8, "distill.data": corpus, "finetune.data": corpus,
            "distill.seq_len": 32, "finetune.seq_len": 32, "distill.batch_size": 2, "finetune.batch_size": 2,
            "distill.eval_seqs": 2, "finetune.eval_seqs": 2, "select.retrieval_length": 400,
            "select.retrieval_prompts": 2, "select.swap_rounds": 0}
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    out = tmp_path / "out"
    res = run_cli("convert", str(ws / "tiny"), "--ratio", "1:1", "--select", "auto", "--tokens", "6400", *args,
                  "-o", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "windows: the windowed layers train at 8 tokens and serve at 16" in res.stdout
    report = json.loads((out / "report.json").read_text())["stages"]
    assert report["distill"]["train_window"] == 8 and report["finetune"]["train_window"] == 8
    la = json.loads((out / "config.json").read_text())["linear_attention"]
    assert la["window"] == 16 and la["train_window"] == 8
    info = run_cli("info", str(out))
    assert info.returncode == 0 and "16-token window (trained at 8)" in info.stdout, info.stdout[-2000:]
    gen = run_cli("generate", str(out), "abc", "--max-new-tokens", "4")
    assert gen.returncode == 0, gen.stderr[-2000:]

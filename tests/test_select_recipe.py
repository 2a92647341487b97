"""Layer selection and recipe loading/validation."""

import pytest

from linearize import recipe as R
from linearize.errors import RecipeError, SelectionError
from linearize.convert.selection import (FULL, LINEAR, layout_from_ratio, parse_layer_list, select_layout,
                                         softmax_indices)


def test_ratio_3_to_1_on_30_layers():
    layout = layout_from_ratio("3:1", 30)
    assert softmax_indices(layout) == [3, 7, 11, 15, 19, 23, 27]
    assert layout.count(LINEAR) == 23 and layout.count(FULL) == 7


@pytest.mark.parametrize("ratio,n_lin", [("1:0", 30), ("0:1", 0), ("1:1", 15), ("7:1", 27)])
def test_ratio_counts(ratio, n_lin):
    assert layout_from_ratio(ratio, 30).count(LINEAR) == n_lin


@pytest.mark.parametrize("bad", ["3:0:1", "a:b", "0:0", "3", "-1:2", ""])
def test_bad_ratio(bad):
    with pytest.raises(SelectionError):
        layout_from_ratio(bad, 30)


def test_softmax_layers_override_and_range():
    layout = select_layout(8, ratio="1:0", softmax_layers="1,5-6")
    assert softmax_indices(layout) == [1, 5, 6]
    assert parse_layer_list("3, 7") == [3, 7]
    with pytest.raises(SelectionError, match="out of range"):
        select_layout(8, softmax_layers="8")
    with pytest.raises(SelectionError):
        parse_layer_list("x")


def test_shipped_recipes_load():
    names = R.available()
    assert {"lolcats", "elu"} <= set(names)
    r = R.load("lolcats")
    assert r["attention"]["feature_map"] == "hedgehog" and r["attention"]["window"] == 512
    assert r["attention"]["train_window"] == 64 and r["distill"]["seq_len"] == r["finetune"]["seq_len"] == 8192
    for n in names:
        text = R.find(n).read_text()
        assert text.lstrip().startswith("#") and "linearize convert" in text  # header shows the command


def test_recipe_override_and_errors(tmp_path):
    r = R.load("lolcats", {"attention.window": 32})
    assert r["attention"]["window"] == 32 and r.overrides == {"attention.window": 32}
    with pytest.raises(RecipeError, match="attention.window = -1"):
        R.load("lolcats", {"attention.window": -1})
    with pytest.raises(RecipeError, match="unknown field 'attention.foo'"):
        R.load("lolcats", {"attention.foo": 1})
    with pytest.raises(RecipeError, match="one of"):
        R.load("lolcats", {"attention.feature_map": "nope"})
    with pytest.raises(RecipeError, match="unknown recipe"):
        R.load("does-not-exist")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nbogus: 1\n")
    with pytest.raises(RecipeError, match="unknown field 'bogus'"):
        R.load(str(bad))
    bad.write_text("attention: [1, 2\n")
    with pytest.raises(RecipeError, match="invalid YAML"):
        R.load(str(bad))


def test_resolved_yaml_keeps_source_bytes():
    import yaml

    r = R.load("elu", {"attention.window": 16})
    text = R.resolved_yaml(r, {"base_model": "m"})
    assert text.startswith(r.source_text)
    data = yaml.safe_load(text)
    assert data["resolved"]["recipe"]["attention"]["window"] == 16
    assert R.validate(data)["attention"]["window"] == 0  # the original fields, metadata ignored


def test_checkpoint_recipe_copy_reloads_with_the_values_as_run(tmp_path):
    """A stage rerun on a checkpoint starts from the conversion's --set values; new overrides win; saving
    again keeps the recipe's own text once (no stacked resolved blocks)."""
    shipped = R.load("lolcats")
    r = R.load("lolcats", {"distill.seq_len": 256, "finetune.lr": 3e-4})
    copy = tmp_path / "linearize_recipe.yaml"
    copy.write_text(R.resolved_yaml(r, {"base_model": "m"}))
    again = R.load(str(copy), {"finetune.lr": 1e-5})
    assert again["distill"]["seq_len"] == 256 and again["finetune"]["lr"] == 1e-5
    assert again["finetune"]["seq_len"] == shipped["finetune"]["seq_len"]
    assert again.source_text == shipped.source_text
    copy.write_text(R.resolved_yaml(again, {"base_model": "m"}))
    assert copy.read_text().count(R.RESOLVED_MARKER) == 1
    assert R.load(str(copy))["finetune"]["lr"] == 1e-5


def test_ratio_that_leaves_no_softmax_layer_is_refused():
    with pytest.raises(SelectionError, match="none would stay softmax"):
        layout_from_ratio("30:1", 30)
    assert layout_from_ratio("29:1", 30)[-1] == FULL and layout_from_ratio("1:0", 30) == [LINEAR] * 30


def test_cpu_recipe_is_lolcats_sized_for_a_cpu():
    """lolcats-cpu trains the same layers with the same losses as lolcats; only sizes, budgets, the layer choice
    (interleave: the probe would cost more than the budget trains), the attention sinks, the window's widths, the
    decay (measured on a CPU, not yet on a GPU) and stage 2's text differ, and its budgets pass the pre-load checks."""
    cpu, gpu = R.load("lolcats-cpu"), R.load("lolcats")
    measured_on_cpu = {"sinks": 0, "window": 0, "train_window": 0, "decay": ""}
    assert {**cpu["attention"], **measured_on_cpu} == {**gpu["attention"], **measured_on_cpu}
    assert (cpu["attention"]["sinks"], gpu["attention"]["sinks"]) == (16, 0)
    assert (cpu["attention"]["window"], gpu["attention"]["window"]) == (128, 512)
    assert (cpu["attention"]["train_window"], gpu["attention"]["train_window"]) == (0, 64)
    assert (cpu["attention"]["decay"], gpu["attention"]["decay"]) == ("learned", "none")
    sizing = {"tokens", "seq_len", "batch_size", "grad_accum", "lr", "warmup_steps", "eval_seqs", "checkpoint_every"}
    # stage 2's light mix of fiction and code (measured on the GPU) changed nothing beyond 0.6 points of ratio in
    # the CPU recipe's 39K stage-2 tokens, for 2 more minutes: the CPU recipe fine-tunes on the wiki alone
    assert (cpu["finetune"]["data"], gpu["finetune"]["data"]) == ("wiki", "wiki:0.8,books:0.1,code:0.1")
    for stage in ("distill", "finetune"):
        changed = {k for k in gpu[stage] if cpu[stage][k] != gpu[stage][k]} - {"data"}
        assert changed and changed <= sizing, changed
        assert cpu[stage]["seq_len"] * cpu[stage]["batch_size"] < gpu[stage]["seq_len"] * gpu[stage]["batch_size"]
    assert cpu["distill"]["data"] == gpu["distill"]["data"] == "wiki"
    assert cpu["select"]["method"] == "interleave"
    R.check_training(cpu, {"distill": None, "finetune": None})

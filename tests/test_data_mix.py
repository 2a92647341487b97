"""Tests for data mixtures (linearize.data.mixture) and per-domain perplexity (the named corpora: test_corpora.py).

Offline and small: word-level tokenizers trained here, a tiny random Llama for the eval.
"""

from __future__ import annotations

import collections
import itertools
import json
import random
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import char_tokenizer, tiny_model
from linearize import recipe as R
from linearize.cli import app
from linearize.errors import DataError
from linearize.data.checks import check_training_source
from linearize.data.tokens import count_tokens
from linearize.data.packing import heldout_sequences, packed_batches
from linearize.data.specs import iter_texts, parse_spec
from linearize.errors import RecipeError
from linearize.data.mixture import allocate, interleave, mixture_text, parse_mixture, row_parts

WORDS_A = [f"a{i}" for i in range(20)]
WORDS_B = [f"b{i}" for i in range(20)]


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test caches under a temporary LINEARIZE_CACHE, never the user's home."""
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(WORDS_A + WORDS_B, trainer=trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>")


def _write_docs(path: Path, words: list[str], n: int) -> Path:
    path.write_text("\n\n".join(" ".join(words[(i + j) % len(words)] for j in range(8 + i % 13)) for i in range(n)))
    return path


@pytest.fixture(scope="module")
def two_files(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("mix")
    return str(_write_docs(root / "a.txt", WORDS_A, 900)), str(_write_docs(root / "b.txt", WORDS_B, 900))


def _part_of(tok, row: torch.Tensor) -> str:
    """``a`` or ``b``: which file a packed row came from (a row never mixes them)."""
    words = {t[0] for t in tok.convert_ids_to_tokens(row.tolist()) if t != "</s>"}
    assert len(words) == 1, words
    return words.pop()


# ------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("value, expected", [
    ("wiki", [("wiki", 1.0)]),
    ("wiki:0.7,code:0.3", [("wiki", 0.7), ("code", 0.3)]),
    ("wiki:2, code:1 ,docs:1", [("wiki", 0.5), ("code", 0.25), ("docs", 0.25)]),  # normalised, spaces ignored
    ("wiki,code", [("wiki", 0.5), ("code", 0.5)]),  # no weights: equal shares
    ("code:3", [("code", 1.0)]),
    ("hf:name:config:train:0.25,wiki:0.75", [("hf:name:config:train", 0.25), ("wiki", 0.75)]),
    ("hf:name:config,books", [("hf:name:config", 0.5), ("books", 0.5)]),  # a config is no weight
    ([{"data": "wiki", "weight": 3}, {"data": "books", "weight": 1}], [("wiki", 0.75), ("books", 0.25)]),
    ([{"data": "wiki"}, {"data": "docs"}], [("wiki", 0.5), ("docs", 0.5)]),
])
def test_mixture_accepted(value, expected):
    parts = parse_mixture(value)
    assert [(p.spec, pytest.approx(p.weight)) for p in parts] == expected


@pytest.mark.parametrize("value, needle", [
    ("wiki:0.5,code", "give every part a weight or none"),
    ("wiki,,code", "part 2 is empty"),
    ("wiki:0.5,", "part 2 is empty"),
    ("wiki:0,code:1", "the weight '0' of 'wiki' is not a positive number"),
    ("wiki:-1,code:2", "the weight '-1' of 'wiki'"),
    ("wiki:abc,code:1", "the weight 'abc' of 'wiki'"),
    ("wiki:inf,code:1", "the weight 'inf'"),
    ("wiki:nan,code:1", "the weight 'nan'"),
    ("wiki:1,WIKI:2", "'WIKI' is given twice"),
    ([], "the data list is empty"),
    (["wiki"], "data list item 1 is str"),
    ([{"data": "wiki", "weight": -2}], "the weight -2 of 'wiki' is not a positive number"),
    ([{"data": "wiki", "weight": True}], "the weight True"),
    ([{"data": "wiki", "share": 1}], "unknown key 'share'; allowed: data, weight"),
    ([{"weight": 1}], "'data' must be a data spec"),
    ([{"data": "wiki", "weight": 1}, {"data": "code"}], "give every part a weight or none"),
])
def test_mixture_rejected_in_one_line(value, needle):
    with pytest.raises(DataError) as e:
        parse_mixture(value)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_mixture_specs_resolve(two_files, tmp_path):
    a, b = two_files
    src = parse_spec(f"{a}:0.25,{b}:0.75")
    assert src.kind == "mix" and src.cacheable
    assert [(p.kind, p.paths[0].name, w) for p, w in src.parts] == [("files", "a.txt", 0.25), ("files", "b.txt", 0.75)]
    assert parse_spec([{"data": a, "weight": 1}, {"data": b, "weight": 3}]).parts == src.parts
    assert parse_spec(f"{a}:5").kind == "files"  # one part is that spec
    with pytest.raises(DataError, match="no such file or directory"):
        parse_spec(f"{a}:0.5,{tmp_path / 'missing.txt'}:0.5")
    odd = tmp_path / "odd,name:1.txt"  # an existing path is one spec, commas and colons included
    odd.write_text("alpha beta\n")
    assert parse_spec(str(odd)).kind == "files"
    with pytest.raises(DataError, match="holds a comma"):
        parse_spec([{"data": a}, {"data": str(odd)}])
    assert mixture_text([{"data": "wiki", "weight": 0.7}, {"data": "code", "weight": 0.3}]) == "wiki:0.7,code:0.3"


def test_recipe_takes_a_list_as_the_mixture_string():
    r = R.validate({"distill": {"data": [{"data": "wiki", "weight": 0.6}, {"data": "code", "weight": 0.4}]}})
    assert r["distill"]["data"] == "wiki:0.6,code:0.4" and r["finetune"]["data"] == "wiki"
    r2 = R.load("lolcats").with_overrides({"finetune.data": [{"data": "wiki"}, {"data": "docs"}]})
    assert r2["finetune"]["data"] == "wiki,docs"
    with pytest.raises(RecipeError, match=r"distill.data: data list item 1: unknown key 'w'") as e:
        R.validate({"distill": {"data": [{"data": "wiki", "w": 1}]}})
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------- sampling


def test_row_draws_follow_the_weights_and_the_seed():
    draws = list(itertools.islice(row_parts([0.6, 0.3, 0.1], seed=7), 20_000))
    share = collections.Counter(draws)
    assert [share[i] / len(draws) for i in range(3)] == [pytest.approx(w, abs=0.015) for w in (0.6, 0.3, 0.1)]
    assert list(itertools.islice(row_parts([0.6, 0.3, 0.1], seed=7), 500)) == draws[:500]
    assert list(itertools.islice(row_parts([0.6, 0.3, 0.1], seed=8), 500)) != draws[:500]
    assert allocate(8, [0.5, 0.3, 0.2]) == [4, 2, 2] and allocate(3, [1 / 3] * 3) == [1, 1, 1]
    assert interleave([2, 1]) == [(0, 0), (1, 0), (0, 1)]


def test_packed_mixture_proportions_deterministic(tok, two_files):
    a, b = two_files
    spec = f"{a}:0.7,{b}:0.3"
    kw = dict(seq_len=16, tokens=16 * 8 * 100, batch_size=8)
    batches = list(packed_batches(tok, spec, seed=3, **kw))
    assert len(batches) == 100 and all(x.shape == (8, 16) for x in batches)
    parts = [_part_of(tok, row) for x in batches for row in x]
    assert parts.count("a") / len(parts) == pytest.approx(0.7, abs=0.04)
    again = list(packed_batches(tok, spec, seed=3, **kw))
    assert all(torch.equal(x, y) for x, y in zip(batches, again))  # same seed, same rows
    other = list(packed_batches(tok, spec, seed=4, **kw))
    assert not all(torch.equal(x, y) for x, y in zip(batches, other))
    # the rows of each part are that part's own packed rows, in its own order
    alone = list(packed_batches(tok, a, seed=3, seq_len=16, tokens=16 * 8 * 100, batch_size=8))
    rows_a = [row for x in batches for row in x if _part_of(tok, row) == "a"]
    assert all(torch.equal(r, s) for r, s in zip(rows_a, torch.cat(alone)))


def test_mixture_heldout_shares_and_never_trains_on_it(tok, two_files):
    a, b = two_files
    spec = f"{a}:3,{b}:1"
    held = heldout_sequences(tok, spec, seq_len=16, n_seqs=8)
    assert held.shape == (8, 16)
    assert [_part_of(tok, r) for r in held] == ["a", "a", "b", "a", "a", "a", "b", "a"]  # 6:2, interleaved
    assert torch.equal(held, heldout_sequences(tok, spec, seq_len=16, n_seqs=8))
    assert torch.equal(held[[_part_of(tok, r) == "a" for r in held]], heldout_sequences(tok, a, seq_len=16, n_seqs=6))
    assert count_tokens(tok, spec) == count_tokens(tok, a) + count_tokens(tok, b)
    held_docs = set(iter_texts(spec, "heldout"))
    assert held_docs and not held_docs & set(iter_texts(spec, "train"))


def test_mixture_training_checks_name_the_part(tok, two_files, tmp_path):
    a, b = two_files
    check_training_source(tok, f"{a}:0.5,{b}:0.5", field="distill.data", seq_len=16, batch_size=4, eval_seqs=4)
    small = _write_docs(tmp_path / "small.txt", WORDS_B, 40)  # ~1 held-out document
    with pytest.raises(DataError, match=r"distill.data: the held-out part of '.*small.txt'.*its share of the distill "
                                        r"evaluation needs") as e:
        check_training_source(tok, f"{a}:0.5,{small}:0.5", field="distill.data", seq_len=16, batch_size=4,
                              eval_seqs=64)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------- eval --task ppl --data


def test_eval_ppl_one_row_per_domain(tmp_path, monkeypatch):
    import linearize.evals.runner as runner

    model, tok = tiny_model("llama", layers=2), char_tokenizer()
    monkeypatch.setattr(runner, "_default_loader", lambda: (lambda spec, **kw: (model, tok)))
    rng = random.Random(0)
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"  # 400 documents each, ~8 held out
    one.write_text("\n\n".join(" ".join(rng.choice(["abc", "de", "fgh"]) for _ in range(40)) for _ in range(400)))
    two.write_text("\n\n".join(" ".join(rng.choice(["pqr", "st", "uvw"]) for _ in range(40)) for _ in range(400)))
    out = tmp_path / "r"
    res = CliRunner().invoke(app, ["eval", "smollm2-135m", "--task", "ppl:64", "--lengths", "16,32", "--data",
                                   f"{one},{two}", "-o", str(out)], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["data"], r["length"]) for r in rows] == [(str(one), 16), (str(one), 32), (str(two), 16), (str(two), 32)]
    summ = json.loads((out / "summary.json").read_text())["tasks"]["ppl"]
    assert set(summ["by_data"]) == {str(one), str(two)}
    mean = (summ["nll_by_data"][str(one)]["32"] + summ["nll_by_data"][str(two)]["32"]) / 2
    assert summ["score"] == pytest.approx(torch.tensor(mean).exp().item(), rel=1e-3)
    assert f"ppl @ 32 {one}" in res.stdout and f"ppl @ 16 {two}" in res.stdout
    assert f"held-out tokens of `{two}`" in (out / "report.md").read_text()
    # one spec: the summary as before, no per-domain part
    res = CliRunner().invoke(app, ["eval", "x", "--task", "ppl:64", "--lengths", "32", "--data", str(one), "-o",
                                   str(tmp_path / "r1")], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.stderr[-2000:]
    summ1 = json.loads((tmp_path / "r1" / "summary.json").read_text())["tasks"]["ppl"]
    assert "by_data" not in summ1 and summ1["data"] == str(one)
    assert summ1["by_length"]["32"] == summ["by_data"][str(one)]["32"]


def test_eval_bad_data_fails_before_loading(tmp_path, monkeypatch):
    import linearize.evals.runner as runner

    def never(spec, **kw):
        raise AssertionError("loaded a model")

    monkeypatch.setattr(runner, "_default_loader", lambda: never)
    for bad, needle in [("wiki:2,code", "give every part a weight or none"),
                        (str(tmp_path / "nope.txt"), "no such file or directory")]:
        res = CliRunner().invoke(app, ["eval", "x", "--task", "ppl", "--data", bad, "-o", str(tmp_path / "r")],
                                 env={"COLUMNS": "250"})
        assert res.exit_code != 0 and needle in res.stderr, res.stderr[-2000:]

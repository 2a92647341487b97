"""Output folders: eval, convert, distill and finetune never delete, replace or write into a model checkpoint;
``--overwrite`` replaces only an earlier output of the same command (its ``.linearize-output.json`` says which);
eval's default folder is new for every run. Through the CLI in this process, with a tiny 2-layer model."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import char_tokenizer, tiny_workspace
from linearize.cli import app
from linearize.errors import OutputError
from linearize.io.outputs import MARKER, check_output, command_scope, enclosing_model_dir, is_model_dir, read_marker

SMALL = {"seq_len": 32, "batch_size": 2, "eval_seqs": 2, "warmup_steps": 1}


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def _refused(res, *needles: str) -> str:
    """Exit 2, one stderr line holding every needle, no traceback."""
    exc = res.exception
    assert exc is None or isinstance(exc, SystemExit), f"escaped: {exc!r}"
    assert res.exit_code == 2, (res.exit_code, res.stdout[-2000:], res.stderr[-2000:])
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (and every folder beside it) with its content hash."""
    out = {str(p.relative_to(root.parent)): hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else "dir"
           for p in sorted(root.rglob("*"))}
    out.update({f"../{p.name}": "entry" for p in root.parent.iterdir()})  # nothing new beside it either
    return out


def _sets(stage: str, corpus: Path) -> list[str]:
    out = []
    for k, v in {**SMALL, "data": corpus, **({"loss": "xent"} if stage == "finetune" else {})}.items():
        out += ["--set", f"{stage}.{k}={v}"]
    return out


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A tiny model (``ws/tiny``), a corpus and an untrained hybrid of it (``ws/hybrid``, window 8)."""
    import torch
    from transformers.utils import logging as hf_logging

    root = tiny_workspace(tmp_path_factory.mktemp("ws"), char_tokenizer(), layers=2)
    mp = pytest.MonkeyPatch()
    mp.setenv("LINEARIZE_CACHE", str(root / "cache"))
    hf_logging.disable_progress_bar()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    res = _cli("convert", root / "tiny", "--ratio", "1:0", "--set", "attention.window=8", "--no-train",
               "-o", root / "hybrid")
    assert res.exit_code == 0, res.stderr
    yield root
    torch.set_num_threads(threads)
    hf_logging.enable_progress_bar()
    mp.undo()


@pytest.fixture
def victim(ws, tmp_path):
    """A fresh copy of the tiny original model in its own folder."""
    return Path(shutil.copytree(ws / "tiny", tmp_path / "victim"))


@pytest.fixture
def hybrid_copy(ws, tmp_path):
    return Path(shutil.copytree(ws / "hybrid", tmp_path / "hyb"))


# ----------------------------------------------------------------------------- the four commands

@pytest.mark.parametrize("overwrite", [True, False])
def test_eval_never_replaces_or_writes_into_a_model(ws, victim, hybrid_copy, overwrite):
    flag = ["--overwrite"] if overwrite else []
    before = _snapshot(victim), _snapshot(hybrid_copy)
    # what a user ran: the report folder named like the model it evaluates
    _refused(_cli("eval", victim, "--task", "ppl:2K", "--lengths", "1K", "-o", victim, *flag),
             f"output {victim} is a model checkpoint", "never replaces one")
    _refused(_cli("eval", victim, "--task", "ppl:2K", "--lengths", "1K", "-o", victim / "reports", *flag),
             f"inside the model checkpoint {victim}")
    _refused(_cli("eval", victim, "--task", "ppl", "-o", hybrid_copy, *flag), "is a model checkpoint")
    _refused(_cli("eval", victim, "--task", "ppl", "-o", hybrid_copy / "a" / "b", *flag), "inside the model checkpoint")
    assert (_snapshot(victim), _snapshot(hybrid_copy)) == before


def test_convert_never_replaces_or_writes_into_a_model(ws, victim, hybrid_copy):
    (hybrid_copy / MARKER).unlink()  # a hybrid from before markers: another checkpoint, not an earlier convert's
    before = _snapshot(victim), _snapshot(hybrid_copy)
    args = ["convert", victim, "--ratio", "1:0", "--no-train", "--overwrite"]
    _refused(_cli(*args, "-o", victim), f"output {victim} is a model checkpoint")  # its own source
    _refused(_cli(*args, "-o", victim / "hybrid"), "inside the model checkpoint")
    _refused(_cli(*args, "-o", hybrid_copy / "sub"), "inside the model checkpoint")
    _refused(_cli(*args, "-o", hybrid_copy), "is a model checkpoint")
    assert (_snapshot(victim), _snapshot(hybrid_copy)) == before


def test_distill_never_replaces_or_writes_into_a_model(ws, victim, hybrid_copy):
    before = _snapshot(victim), _snapshot(hybrid_copy)
    args = ["distill", hybrid_copy, "--tokens", 32 * 2, *_sets("distill", ws / "corpus.txt")]
    _refused(_cli(*args, "-o", victim), f"output {victim} is a model checkpoint")
    _refused(_cli(*args, "-o", victim / "d"), "inside the model checkpoint")
    _refused(_cli(*args, "-o", hybrid_copy / "d"), f"inside the model checkpoint {hybrid_copy}")  # its own source
    assert (_snapshot(victim), _snapshot(hybrid_copy)) == before


def test_finetune_never_replaces_or_writes_into_a_model(ws, victim, hybrid_copy):
    before = _snapshot(victim), _snapshot(hybrid_copy)
    args = ["finetune", hybrid_copy, "--tokens", 32 * 2, *_sets("finetune", ws / "corpus.txt")]
    _refused(_cli(*args, "-o", victim), f"output {victim} is a model checkpoint")
    _refused(_cli(*args, "-o", victim / "f"), "inside the model checkpoint")
    _refused(_cli(*args, "--adapter-only", "-o", hybrid_copy), "is a model checkpoint")  # an adapter over PATH
    _refused(_cli(*args, "--adapter-only", "-o", hybrid_copy / "adapter"), "inside the model checkpoint")
    assert (_snapshot(victim), _snapshot(hybrid_copy)) == before


def test_distill_still_updates_its_checkpoint_in_place(ws, hybrid_copy):
    before = (hybrid_copy / "model-00001-of-00001.safetensors").read_bytes()
    res = _cli("distill", hybrid_copy, "--tokens", 32 * 2, *_sets("distill", ws / "corpus.txt"))
    assert res.exit_code == 0, res.stderr[-3000:]
    assert (hybrid_copy / "model-00001-of-00001.safetensors").read_bytes() != before
    assert read_marker(hybrid_copy)["command"] == "distill"
    assert sorted(p.name for p in hybrid_copy.parent.iterdir()) == ["hyb"]  # no temporary or state left
    # and an existing -o that is not PATH is refused (distill has no --overwrite)
    other = hybrid_copy.parent / "other"
    other.mkdir()
    _refused(_cli("distill", hybrid_copy, "--tokens", 32 * 2, *_sets("distill", ws / "corpus.txt"), "-o", other),
             "already exists", "in place")


# ----------------------------------------------------------------------------- --overwrite: only the same command's

def test_convert_overwrite_replaces_only_its_own_output(ws, tmp_path):
    args = ["convert", ws / "tiny", "--ratio", "1:0", "--no-train"]
    out = tmp_path / "OUT"
    assert _cli(*args, "-o", out).exit_code == 0
    marker = read_marker(out)
    assert marker["command"] == "convert" and marker["version"]
    _refused(_cli(*args, "-o", out), "already exists", "--overwrite")
    res = _cli(*args, "-o", out, "--overwrite")  # an earlier convert output: replaced
    assert res.exit_code == 0, res.stderr
    assert read_marker(out)["command"] == "convert"

    mine = tmp_path / "mine"  # a folder of the user's: never replaced, even with --overwrite
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    line = _refused(_cli(*args, "-o", mine, "--overwrite"), "not written by `linearize convert`", "--overwrite")
    assert "overwrite=" not in line
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]

    report = tmp_path / "report"  # another command's output
    report.mkdir()
    (report / MARKER).write_text(json.dumps({"command": "eval", "version": "0"}))
    _refused(_cli(*args, "-o", report, "--overwrite"), "written by `linearize eval`")

    empty = tmp_path / "empty"  # nothing to lose
    empty.mkdir()
    _refused(_cli(*args, "-o", empty), "already exists (pass --overwrite to replace it)")
    assert _cli(*args, "-o", empty, "--overwrite").exit_code == 0
    assert is_model_dir(empty)


def test_eval_default_folder_is_new_per_run_and_overwrite_is_own_only(ws, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["eval", ws / "tiny", "--task", "ppl:256", "--lengths", "32,64", "--data", ws / "corpus.txt"]
    first, second = _cli(*args), _cli(*args)
    assert first.exit_code == 0 and second.exit_code == 0, (first.stderr[-2000:], second.stderr[-2000:])
    dirs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(dirs) == 2 and all(d.name.startswith("eval-tiny-ppl-") for d in dirs), dirs
    for d in dirs:
        assert read_marker(d)["command"] == "eval" and (d / "summary.json").is_file()
    # the table on stdout, named lengths; progress on stderr
    for res in (first, second):
        assert "ppl @ 32" in res.stdout and "ppl @ 64" in res.stdout and "wrote eval-tiny-ppl-" in res.stdout
        assert "ppl @" not in res.stderr
    summ = json.loads((dirs[0] / "summary.json").read_text())["tasks"]["ppl"]
    assert summ["score_length"] == 64 and summ["score"] == summ["by_length"]["64"]
    # --overwrite replaces an earlier report ...
    res = _cli(*args, "-o", dirs[0], "--overwrite")
    assert res.exit_code == 0, res.stderr[-2000:]
    # ... and nothing else
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    _refused(_cli(*args, "-o", mine, "--overwrite"), "not written by `linearize eval`")
    _refused(_cli(*args, "-o", ws / "hybrid", "--overwrite"), "is a model checkpoint")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


# ----------------------------------------------------------------------------- the library rule

def test_check_output_rules(ws, tmp_path):
    tiny, hybrid = ws / "tiny", ws / "hybrid"
    assert is_model_dir(tiny) and is_model_dir(hybrid) and not is_model_dir(ws)
    assert enclosing_model_dir(tiny / "a" / "b") == tiny.resolve() and enclosing_model_dir(tmp_path / "x") is None
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "x.txt").write_text("x")
    # outside the command line: overwrite replaces an unmarked folder, never a model it did not write
    check_output(plain, overwrite=True, command="eval")
    check_output(hybrid, overwrite=True)  # a hybrid rerun in place (pipeline.rerun_stage)
    for target in (tiny, tiny / "sub"):
        with pytest.raises(OutputError, match="model checkpoint"):
            check_output(target, overwrite=True)
    with pytest.raises(OutputError, match="model checkpoint"):
        check_output(hybrid, overwrite=True, command="eval")
    # on the command line: the marker decides; the checkpoint a command updates in place is its own
    with command_scope("eval"):
        with pytest.raises(OutputError, match="not written by `linearize eval`"):
            check_output(plain, overwrite=True)
    with command_scope("distill", in_place=hybrid):
        check_output(hybrid, overwrite=True)
        with pytest.raises(OutputError, match="model checkpoint"):
            check_output(tiny, overwrite=False)

"""Input checks that need no model run before one loads: a bad data file, token budget, output path or a
``--resume`` with other settings is refused in seconds (one line, non-zero exit, nothing written), not after
minutes of loading; plus the hints of a few one-line errors (``--set`` without a section, an unknown model spec)
and the ETA of the rich progress bar."""

from __future__ import annotations

import io
import random
import time
from pathlib import Path

import pytest
import torch

from conftest import char_tokenizer, run_cli, tiny_workspace
from linearize import recipe as R
from linearize.data.specs import is_heldout
from linearize.errors import RecipeError, SpecError, TrainingError

#: seconds a refusal may take through the CLI: the target is 10 s on 2 cores; the margin absorbs a busy machine
LIMIT = 30.0
#: small training settings for the tiny model (window 8, 32-token rows, 2-row batches, 2 evaluation rows)
SETTINGS = {"attention.window": 8, **{f"{s}.{k}": v for s in ("distill", "finetune")
                                      for k, v in (("seq_len", 32), ("batch_size", 2), ("eval_seqs", 2))}}
BATCH = 32 * 2


def _sets(overrides: dict) -> list[str]:
    return [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A tiny model and corpus, data files that cannot train, and a hybrid checkpoint of the tiny model."""
    from transformers import AutoModelForCausalLM

    from linearize.io.checkpoint import save_checkpoint
    from linearize.convert.selection import select_layout
    from linearize.convert.surgery import linearize_model

    root = tiny_workspace(tmp_path_factory.mktemp("checks"), char_tokenizer(), layers=2)
    (root / "empty.txt").write_text("\n\n  \n")
    (root / "binary.txt").write_bytes(bytes(range(256)) * 64)
    (root / "short.txt").write_text("alpha beta gamma")  # 17 tokens: less than one batch
    rng = random.Random(1)
    docs = [" ".join(rng.choice(["alpha", "beta", "river", "stone"]) for _ in range(60)) for _ in range(40)]
    (root / "unheld.txt").write_text("\n\n".join(d for d in docs if not is_heldout(d)))  # nothing to evaluate on
    rec = R.load("lolcats", SETTINGS)
    model = AutoModelForCausalLM.from_pretrained(root / "tiny")
    save_checkpoint(linearize_model(model, select_layout(2, ratio="1:1"), rec), char_tokenizer(), root / "hybrid",
                    base="tiny", recipe=rec)
    return root


@pytest.fixture
def cli(ws, monkeypatch):
    """``run_cli`` with the workspace's data cache; returns ``(result, seconds)``."""
    monkeypatch.setenv("LINEARIZE_CACHE", str(ws / "cache"))

    def run(*args: str):
        t = time.monotonic()
        res = run_cli(*args, timeout=300)
        return res, time.monotonic() - t

    return run


def _convert(ws: Path, out: Path, *extra: str) -> list[str]:
    return ["convert", str(ws / "tiny"), "--ratio", "1:1", "--select", "interleave", *_sets(SETTINGS),
            "--set", f"distill.data={ws / 'corpus.txt'}", "--set", f"finetune.data={ws / 'corpus.txt'}",
            "--tokens", str(BATCH * 20), "-o", str(out), *extra]


def _refused(res, seconds: float, out: Path, *needles: str, state: bool = False) -> None:
    """One line on stderr naming ``needles``, a non-zero exit within :data:`LIMIT`, no output (and no state
    directory unless the test made one: ``state``)."""
    err = res.stderr.strip()
    assert res.returncode != 0 and "Traceback" not in err, err[-3000:]
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err[-3000:]
    assert all(n in err for n in needles), err
    assert seconds < LIMIT, f"refused after {seconds:.1f}s: {err}"
    assert not out.exists() and (state or not out.with_name(f".{out.name}.state").exists())


BAD_DATA = {"empty.txt": ["is empty", "use --set {field}=wiki"],
            "binary.txt": ["is binary, not text", "use --set {field}=wiki"],
            "short.txt": ["17 training tokens, less than one {stage} batch", f"= {BATCH} tokens"],
            "unheld.txt": ["held-out part", "holds 0 tokens", "{stage}.eval_seqs"]}


@pytest.mark.parametrize("name", list(BAD_DATA))
def test_convert_refuses_bad_data_before_loading(ws, cli, tmp_path, name):
    out = tmp_path / "out"
    res, seconds = cli(*_convert(ws, out, "--set", f"distill.data={ws / name}"))
    needles = [n.format(field="distill.data", stage="distill") for n in BAD_DATA[name]]
    _refused(res, seconds, out, "distill.data: ", *needles)
    assert "--data wiki" not in res.stderr  # convert has no --data option


def test_convert_checks_the_finetune_data_too(ws, cli, tmp_path):
    out = tmp_path / "out"
    res, seconds = cli(*_convert(ws, out, "--set", f"finetune.data={ws / 'short.txt'}"))
    _refused(res, seconds, out, "finetune.data: ", "less than one finetune batch", "lower finetune.seq_len")


@pytest.mark.parametrize("stage,name", [("distill", "unheld.txt"), ("finetune", "short.txt")])
def test_distill_and_finetune_refuse_bad_data_before_loading(ws, cli, tmp_path, stage, name):
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (ws / "hybrid").iterdir())
    out = tmp_path / "out"
    res, seconds = cli(stage, str(ws / "hybrid"), "--set", f"{stage}.data={ws / name}", "-o", str(out))
    needles = [n.format(field=f"{stage}.data", stage=stage) for n in BAD_DATA[name]]
    _refused(res, seconds, out, f"{stage}.data: ", *needles)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (ws / "hybrid").iterdir()) == before


def test_budget_and_output_refused_before_loading(ws, cli, tmp_path):
    out = tmp_path / "out"
    res, seconds = cli(*_convert(ws, out, "--distill-tokens", "10"))
    _refused(res, seconds, out, "smaller than one batch")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("keep me")
    res, seconds = cli(*_convert(ws, taken))
    err = res.stderr.strip()
    assert res.returncode != 0 and len(err.splitlines()) == 1 and "Traceback" not in err and seconds < LIMIT, err
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]


# ------------------------------------------------------------------------------------------------- --resume


def _distill_state(model, tok, rec, state_dir: Path, tokens: int) -> Path:
    from linearize.train import distill as D

    D.distill(model, tok, rec, state_dir=state_dir, tokens=tokens, progress=False, log=lambda m: None)
    return state_dir / D.STATE_FILE


def test_convert_resume_names_the_setting_that_differs(ws, cli, tmp_path):
    """The state of an interrupted conversion (lr 1e-3); the same conversion with lr 2e-3 and --resume is refused
    naming distill.lr and both values, before the model loads, and the state is left as it was."""
    from transformers import AutoModelForCausalLM

    from linearize.convert.pipeline import state_dir_for
    from linearize.convert.selection import select_layout
    from linearize.convert.surgery import linearize_model

    out = tmp_path / "out"
    lr = {"distill.data": str(ws / "corpus.txt"), "finetune.data": str(ws / "corpus.txt"), "distill.lr": 1e-3}
    rec = R.load("lolcats", {**SETTINGS, **lr})
    hybrid = linearize_model(AutoModelForCausalLM.from_pretrained(ws / "tiny"), select_layout(2, ratio="1:1"), rec)
    state = _distill_state(hybrid, char_tokenizer(), rec, state_dir_for(out), tokens=BATCH * 10)
    saved = state.read_bytes()
    res, seconds = cli(*_convert(ws, out, "--set", "distill.lr=2e-3", "--resume"))
    _refused(res, seconds, out, "--resume: distill.lr differs (checkpoint 0.001, now 0.002)", state=True)
    assert state.read_bytes() == saved


def test_distill_resume_names_the_budget(ws, cli, tmp_path):
    from linearize.convert.pipeline import state_dir_for
    from linearize.io.sources import load_model

    rec = R.load(str(ws / "hybrid" / "linearize_recipe.yaml"))
    out = tmp_path / "out"
    model, _ = load_model(str(ws / "hybrid"), dtype="float32", device="cpu")
    _distill_state(model, char_tokenizer(), rec, state_dir_for(out), tokens=BATCH * 4)
    res, seconds = cli("distill", str(ws / "hybrid"), "--tokens", str(BATCH * 8), "--resume", "-o", str(out))
    _refused(res, seconds, out, "--resume: the distill token budget differs (checkpoint 256, now 512)", state=True)


def test_finetune_resume_names_the_loss(ws, cli, tmp_path):
    pytest.importorskip("peft", exc_type=ImportError)  # a peft release that does not import with this transformers
    from linearize.train import finetune as FT
    from linearize.convert.pipeline import state_dir_for
    from linearize.io.sources import load_model

    tok = char_tokenizer()
    rec = R.load(str(ws / "hybrid" / "linearize_recipe.yaml"))
    out = tmp_path / "out"
    model, _ = load_model(str(ws / "hybrid"), dtype="float32", device="cpu")
    FT.finetune(model, tok, rec, state_dir=state_dir_for(out), tokens=BATCH * 2, progress=False, log=lambda m: None)
    was = rec["finetune"]["loss"]
    now = "xent" if was == "kl" else "kl"
    res, seconds = cli("finetune", str(ws / "hybrid"), "--tokens", str(BATCH * 2), "--loss", now, "--resume",
                       "-o", str(out))
    _refused(res, seconds, out, f"--resume: the finetune loss (--loss) differs (checkpoint {was}, now {now})",
             state=True)


def test_resume_after_loading_names_the_setting_too(ws, tmp_path, monkeypatch):
    """The library's own check (distill() called directly) names the setting; a state written before settings
    were recorded still refuses, by its fingerprint."""
    from linearize.train import distill as D
    from linearize.io.sources import load_model

    monkeypatch.setenv("LINEARIZE_CACHE", str(ws / "cache"))
    tok = char_tokenizer()
    rec = R.load(str(ws / "hybrid" / "linearize_recipe.yaml"))
    model, _ = load_model(str(ws / "hybrid"), dtype="float32", device="cpu")
    state = _distill_state(model, tok, rec, tmp_path, tokens=BATCH * 2)
    other = rec.with_overrides({"distill.seed": 3})
    with pytest.raises(TrainingError, match=r"--resume: distill\.seed differs \(checkpoint 0, now 3\)"):
        D.distill(model, tok, other, state_dir=tmp_path, resume=True, tokens=BATCH * 2, progress=False)
    old = torch.load(state, weights_only=False)
    del old["settings"]
    torch.save(old, state)
    with pytest.raises(TrainingError, match="fingerprint"):
        D.distill(model, tok, other, state_dir=tmp_path, resume=True, tokens=BATCH * 2, progress=False)


# ------------------------------------------------------------------------------------------------- hints


def test_set_without_section_suggests_the_spellings(ws, cli, tmp_path):
    with pytest.raises(RecipeError, match=r"did you mean distill\.lr or finetune\.lr\?"):
        R.load("lolcats", {"lr": 1e-3})
    with pytest.raises(RecipeError, match=r"did you mean attention\.window\?"):
        R.load("lolcats", {"window": 16})
    with pytest.raises(RecipeError, match=r"did you mean distill\.lr\?"):
        R.load("lolcats", {"distill.lrr": 1e-3})
    out = tmp_path / "out"
    res, seconds = cli(*_convert(ws, out, "--set", "lr=1e-3"))
    _refused(res, seconds, out, "unknown field 'lr'", "did you mean distill.lr or finetune.lr?")


def test_unknown_spec_shows_the_closest_aliases():
    from linearize.io.aliases import ALIASES
    from linearize.io.sources import resolve

    with pytest.raises(SpecError) as e:
        resolve("llama3-8b")
    msg = str(e.value)
    assert "did you mean llama-3-8b" in msg and f"all {len(ALIASES)} aliases: python -c" in msg
    assert "starcoder2-15b" not in msg and "\n" not in msg


def test_rich_bar_shows_an_eta_with_slow_steps():
    """A run resumed at step 4 of 10 whose step takes 40 s (longer than rich's 30 s speed window): after step 5,
    5 steps left at 40 s each."""
    from rich.console import Console
    from rich.progress import TextColumn, TimeRemainingColumn

    from linearize import progress as P

    now = [0.0]
    bar = P._rich_progress(TextColumn("{task.description}"), TimeRemainingColumn(), get_time=lambda: now[0],
                           console=Console(file=io.StringIO(), force_terminal=True), auto_refresh=False)
    task = bar.add_task("distill", total=10, completed=4, info="")
    eta = bar.columns[1]
    assert str(eta.render(bar.tasks[0])) == "eta -:--:--"
    now[0] = 40.0
    bar.update(task, completed=5)
    assert str(eta.render(bar.tasks[0])) == "eta 0:03:20"
    buf = io.StringIO()
    live = P.step_progress("distill", console=Console(file=buf, force_terminal=True, width=160, color_system=None))
    with live:
        t = live.add_task("distill", total=10, completed=0, info="loss 0.1", unit="steps")
        live.update(t, completed=1)
        live.refresh()
    assert "1/10 steps loss 0.1 eta 0:00:0" in buf.getvalue()  # the bar itself prints it


def test_a_rerun_beyond_the_context_is_refused(ws, cli, tmp_path):
    """`finetune --train-length` past the model's 1,024-token context: one line before the model loads."""
    out = tmp_path / "out"
    res, seconds = cli("finetune", str(ws / "hybrid"), "--train-length", "2K", "-o", str(out))
    _refused(res, seconds, out, "finetune.seq_len 2048 is beyond", "--train-length 1024 or less")


def test_a_rerun_at_another_length(ws, tmp_path, monkeypatch):
    """`distill --train-length 64` reruns stage 1 on 64-token rows, the batch and held-out rows halved to keep the
    tokens (2 x 32 -> 1 x 64), and records it in the checkpoint's recipe; stage 2's settings stay."""
    from linearize.convert.pipeline import rerun_stage

    monkeypatch.setenv("LINEARIZE_CACHE", str(ws / "cache"))
    out = rerun_stage("distill", str(ws / "hybrid"), out=tmp_path / "out", train_length="64", tokens=64 * 3,
                      overrides={"distill.data": str(ws / "corpus.txt")}, device="cpu", log=lambda m: None)
    rec = R.load(str(out / "linearize_recipe.yaml"))
    assert (rec["distill"]["seq_len"], rec["distill"]["batch_size"], rec["distill"]["eval_seqs"]) == (64, 1, 1)
    assert (rec["finetune"]["seq_len"], rec["finetune"]["batch_size"]) == (32, 2)

"""Real signals against the CLI: SIGINT and SIGKILL mid-distill, then --resume ends with the same weights."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import char_tokenizer, tiny_workspace

pytestmark = pytest.mark.slow  # training processes interrupted and resumed


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny local model directory (with tokenizer) and a text corpus."""
    return tiny_workspace(tmp_path_factory.mktemp("ws"), char_tokenizer(), layers=2)


#: optimizer steps of the run, each writing its resumable state: slow enough that the signal lands mid-run even when
#: the machine is loaded and the test polls late (a state every 5 steps once let the run finish first)
STEPS = 600


def _args(ws, out, *extra, steps=STEPS):
    return [sys.executable, "-m", "linearize.cli", "convert", str(ws / "tiny"), "--ratio", "1:0",
            "--set", "attention.window=8", "--set", f"distill.data={ws / 'corpus.txt'}", "--set", "distill.seq_len=32",
            "--set", "distill.batch_size=2", "--set", "distill.eval_seqs=2", "--set", "distill.checkpoint_every=1",
            "--tokens", str(32 * 2 * steps), "--no-finetune", "-o", str(out), *extra]


def _interruptible():
    """In the child before it starts: Ctrl-C back to its default. A shell without job control starts background
    commands with SIGINT ignored, and the child would inherit that (and rightly keep ignoring it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _env(ws):
    return {**os.environ, "LINEARIZE_CACHE": str(ws / "cache"), "OMP_NUM_THREADS": "1"}


def _weights(out):
    return load_file(str(out / "model-00001-of-00001.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(workspace):
    out = workspace / "full"
    res = subprocess.run(_args(workspace, out), capture_output=True, text=True, env=_env(workspace), timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return _weights(out)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_interrupt_then_resume_matches(workspace, uninterrupted, sig):
    out = workspace / f"run-{sig.name}"
    state = workspace / f".{out.name}.state" / "distill-state.pt"
    proc = subprocess.Popen(_args(workspace, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(workspace), preexec_fn=_interruptible)
    deadline = time.time() + 300
    while not state.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert state.exists(), "no checkpoint appeared"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    if sig == signal.SIGINT:
        assert proc.returncode == 130, err[-2000:]
        assert "--resume" in err and "Traceback" not in err
    else:
        assert proc.returncode == -signal.SIGKILL
    assert not out.exists()  # nothing that looks finished
    res = subprocess.run(_args(workspace, out, "--resume"), capture_output=True, text=True, env=_env(workspace),
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resumed at step" in res.stdout + res.stderr
    got = _weights(out)
    assert got.keys() == uninterrupted.keys()
    for k in got:
        assert torch.allclose(got[k], uninterrupted[k], atol=1e-6), k
    assert not state.parent.exists()  # state removed once the output is complete


def test_resume_refuses_other_settings(workspace, uninterrupted):
    out = workspace / "mismatch"
    state = workspace / f".{out.name}.state" / "distill-state.pt"
    proc = subprocess.Popen(_args(workspace, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(workspace), preexec_fn=_interruptible)
    while not state.exists() and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    args = _args(workspace, out, "--resume", "--set", "distill.seed=7")
    res = subprocess.run(args, capture_output=True, text=True, env=_env(workspace), timeout=600)
    assert res.returncode != 0 and "fingerprint" in res.stderr and "Traceback" not in res.stderr
    assert not out.exists()


def test_model_without_tokenizer_is_one_line(workspace, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(workspace / "tiny", bare)
    for p in bare.iterdir():
        if p.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            p.unlink()
    out = tmp_path / "OUT"
    res = subprocess.run([sys.executable, "-m", "linearize.cli", "convert", str(bare), "--ratio", "1:0", "--no-train",
                          "-o", str(out)],
                         capture_output=True, text=True, env=_env(workspace), timeout=300)
    assert res.returncode == 2 and "tokenizer" in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert len([ln for ln in res.stderr.splitlines() if ln.strip()]) == 1
    assert not out.exists()

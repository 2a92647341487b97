"""Sharded training (--fsdp, FSDP2) under torchrun (CPU, gloo): 2 processes reach the 1-process losses and weights."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from linearize.train import fsdp
from linearize.errors import LinearizeError
from test_distributed import TORCHRUN, _convert
from test_interrupt import _args, _env, _weights, workspace  # noqa: F401 - the tiny model + corpus fixture

pytestmark = pytest.mark.slow  # multi-process FSDP training under torchrun

CLI = [sys.executable, "-m", "linearize.cli"]


def _run(cmd, ws):
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(ws), timeout=300)


def _histories(one, two, stage):
    r1, r2 = (json.loads((d / "report.json").read_text())["stages"][stage] for d in (one, two))
    return r1, r2, [h["loss"] for h in r1["history"]], [h["loss"] for h in r2["history"]]


@pytest.fixture(scope="module")
def runs(workspace):  # noqa: F811
    """convert (both stages, grad_accum 2): one plain process vs 2 torchrun processes with --fsdp."""
    one, two = workspace / "fsdp-one", workspace / "fsdp-two"
    r1 = _run([sys.executable, *_convert(workspace, one)], workspace)
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = _run([*TORCHRUN, *_convert(workspace, two, "--fsdp")], workspace)
    assert r2.returncode == 0, r2.stderr[-3000:]
    return one, two, r2


def test_fsdp_two_processes_match_one(runs, workspace):  # noqa: F811
    one, two, res = runs
    assert res.stdout.count(f"wrote {two}") == 1  # rank 0 alone prints and writes
    assert "fsdp: 2 decoder layers + root sharded over 2 processes on cpu" in res.stdout
    held = res.stdout.split("rank 0 holds")[1].split("parameters")[0].replace("\n", " ").split(" of ")
    local, total = (int(x.strip().replace(",", "")) for x in held)
    assert local < 0.6 * total  # rank 0 really keeps about half of the weights
    for stage in ("distill", "finetune"):
        r1, r2, h1, h2 = _histories(one, two, stage)
        assert r1["world_size"] == 1 and r2["world_size"] == 2
        assert r2["tokens"] == r1["tokens"] and r2["steps"] == r1["steps"] == len(h1) == len(h2)
        torch.testing.assert_close(torch.tensor(h2), torch.tensor(h1), rtol=1e-4, atol=1e-7, msg=stage)
    w1, w2 = _weights(one), _weights(two)
    assert w1.keys() == w2.keys()  # the same checkpoint format: no FSDP or peft names leak in
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5, msg=k)
    assert any("feature_map" in k for k in w1) and any("window" in k for k in w1)
    base = load_file(str(workspace / "tiny" / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(w2[q], base[q])  # the LoRA deltas were merged into the gathered weights
    assert json.loads((two / "report.json").read_text())["stages"]["finetune"]["merged"] is True


def test_fsdp_finetune_dir_matches_one(runs, workspace):  # noqa: F811
    """`finetune DIR --fsdp` (next-token loss) re-runs stage 2 on a checkpoint like one process does."""
    one, _, _ = runs
    outs = [workspace / "ft-one", workspace / "ft-two"]
    args = ["finetune", str(one), "--tokens", str(32 * 4 * 2 * 3), "--loss", "xent"]
    r1 = _run([*CLI, *args, "-o", str(outs[0])], workspace)
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = _run([*TORCHRUN, "-m", "linearize.cli", *args, "-o", str(outs[1]), "--fsdp",
               "--set", "finetune.activation_checkpointing=true"], workspace)  # FSDP2 with recomputed layers
    assert r2.returncode == 0, r2.stderr[-3000:]
    r1, r2, h1, h2 = _histories(*outs, "finetune")
    assert r2["world_size"] == 2 and len(h1) == len(h2) == 3
    assert r2["activation_checkpointing"] is True and r1["activation_checkpointing"] is False
    torch.testing.assert_close(torch.tensor(h2), torch.tensor(h1), rtol=1e-4, atol=1e-7)
    w1, w2 = _weights(outs[0]), _weights(outs[1])
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5, msg=k)


#: stage 1's optimizer steps in the distill case: a quarter of test_interrupt's (26 s instead of 53 for the test on
#: 2 cores), still seconds of torchrun after the first state appears; the stop landed at step 1 of 150 in trials
FSDP_STEPS = 150


def _stopped_then_resumed(ws, out, args, state_file):
    """Start ``args`` under torchrun --fsdp, stop it (SIGTERM to torchrun, which ends its workers) once
    ``state_file`` exists, then rerun with --resume; returns the resumed run and the step it resumed at."""
    state = ws / f".{out.name}.state" / state_file
    proc = subprocess.Popen([*TORCHRUN, *args, "--fsdp"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(ws))
    deadline = time.time() + 300
    while not state.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert state.exists(), "no checkpoint appeared"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode != 0 and not out.exists()  # stopped before the end: nothing that looks finished
    res = _run([*TORCHRUN, *args, "--fsdp", "--resume"], ws)
    assert res.returncode == 0, res.stderr[-3000:]
    m = re.search(rf"{state_file.split('-')[0]}: resumed at step (\d+)/(\d+)", res.stdout)
    assert m and 0 < int(m[1]) < int(m[2]), res.stdout[-2000:]
    assert not state.parent.exists()  # state removed once the output is complete
    return res


@pytest.mark.parametrize("stage", ["distill", "finetune"])
def test_fsdp_resume_matches_uninterrupted(workspace, stage):  # noqa: F811
    """A stopped --fsdp run resumed with --fsdp --resume ends with the weights of one uninterrupted process."""
    if stage == "distill":  # FSDP_STEPS steps of 2 rows, a state after each
        args = lambda out, *x: _args(workspace, out, *x, steps=FSDP_STEPS)[1:]  # noqa: E731
    else:  # a short stage 1, then 40 LoRA steps of 4 rows, checkpoint every 2
        args = lambda out, *x: _convert(workspace, out, "--set", "finetune.grad_accum=1",  # noqa: E731
                                        "--set", "finetune.checkpoint_every=2", "--finetune-tokens",
                                        str(32 * 4 * 40), *x)
    one, out = workspace / f"res-{stage}-one", workspace / f"res-{stage}-fsdp"
    r1 = _run([sys.executable, *args(one)], workspace)
    assert r1.returncode == 0, r1.stderr[-2000:]
    _stopped_then_resumed(workspace, out, args(out), f"{stage}-state.pt")
    w1, w2 = _weights(one), _weights(out)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5, msg=k)


def test_fsdp_without_torchrun_is_refused(workspace, tmp_path):  # noqa: F811
    out = tmp_path / "solo"
    res = _run([sys.executable, *_convert(workspace, out, "--fsdp")], workspace)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["error: --fsdp shards the model over torchrun processes: start it "
                                               "with `torchrun --nproc_per_node N -m linearize.cli ...` (N >= 2)"]
    assert not out.exists()


def test_fsdp_unsupported_option_under_torchrun_is_refused(runs, workspace, tmp_path):  # noqa: F811
    one, _, _ = runs
    out = tmp_path / "adapter"
    res = _run([*TORCHRUN, "-m", "linearize.cli", "finetune", str(one), "--adapter-only", "-o", str(out), "--fsdp"],
               workspace)
    assert res.returncode != 0
    assert "error: --fsdp does not support --adapter-only yet; drop one of them" in res.stderr
    assert not out.exists()  # (torchrun itself reports the failed children with a traceback of its own)


def test_fsdp_option_checks(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(LinearizeError, match="start it with `torchrun"):
        fsdp.check_options()
    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    fsdp.check_options()  # under torchrun, plain training: fine
    for kw, msg in [({"train": False}, "--no-train: nothing to train"), ({"select_auto": True}, "--select auto"),
                    ({"adapter_only": True}, "--adapter-only")]:
        with pytest.raises(LinearizeError, match=msg):
            fsdp.check_options(**kw)


_ONLY_RANK0_LOADS = """
import os, sys
from linearize.convert import pipeline
from linearize.io import sources
from linearize.train import fsdp
if os.environ["RANK"] != "0":  # the other ranks must build the model on the meta device, never load it
    def refuse(*args, **kwargs):
        raise AssertionError("rank " + os.environ["RANK"] + " loaded the model")
    for module in (sources, fsdp, pipeline):  # the function and every module that imported it by name
        module.load_model = refuse
from linearize.cli import main
sys.argv = ["linearize", *sys.argv[1:]]
main()
"""


def test_fsdp_only_rank0_loads_the_model(runs, workspace, tmp_path):  # noqa: F811
    """Rank 1 never reads the weights (its load function raises), yet ends with the same checkpoint."""
    one, two, _ = runs
    driver = tmp_path / "driver.py"
    driver.write_text(_ONLY_RANK0_LOADS)
    out = tmp_path / "fsdp-rank0"
    args = _convert(workspace, out, "--fsdp")[2:]  # drop "-m linearize.cli"
    res = _run([*TORCHRUN, str(driver), *args], workspace)
    assert res.returncode == 0, res.stderr[-3000:]
    w2, w3 = _weights(two), _weights(out)
    for k in w2:
        torch.testing.assert_close(w3[k], w2[k], rtol=0, atol=0, msg=k)


def test_fsdp_load_error_on_rank0_reaches_every_rank(workspace, tmp_path):  # noqa: F811
    """A model rank 0 cannot load ends every rank with the one-line error (no rank left waiting)."""
    bad = tmp_path / "bad"
    shutil.copytree(workspace / "tiny", bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    args = _convert(workspace, tmp_path / "never", "--fsdp")
    args[args.index(str(workspace / "tiny"))] = str(bad)
    start = time.time()
    res = _run([*TORCHRUN, *args], workspace)
    assert res.returncode != 0 and time.time() - start < 120
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ") and "cannot load" in ln]
    assert len(lines) == 2 and lines[0] == lines[1], res.stderr[-3000:]  # rank 0's error, and rank 1's copy of it
    assert "[rank0]" not in res.stderr and "[rank1]" not in res.stderr  # no rank's traceback (torchrun's own stays)
    assert not (tmp_path / "never").exists()

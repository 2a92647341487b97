"""Data parallel under torchrun (CPU, gloo): 2 processes reach the 1-process losses and weights."""

import json
import subprocess
import sys

import pytest
import torch

from linearize import distributed as dist
from linearize.errors import TrainingError
from test_interrupt import _env, _weights, workspace  # noqa: F401 - the tiny model + corpus fixture

pytestmark = pytest.mark.slow  # multi-process data-parallel training under torchrun

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]


def _convert(ws, out, *extra):
    """Both stages, 8 distill + 4 finetune steps of a global batch of 4 rows x 2 micro-batches (no_sync path)."""
    sets = ["attention.window=8"]
    for stage in ("distill", "finetune"):
        sets += [f"{stage}.data={ws / 'corpus.txt'}", f"{stage}.seq_len=32", f"{stage}.batch_size=4",
                 f"{stage}.grad_accum=2", f"{stage}.eval_seqs=2", f"{stage}.warmup_steps=2"]
    return ["-m", "linearize.cli", "convert", str(ws / "tiny"), "--ratio", "1:0",
            *[a for s in sets for a in ("--set", s)], "--distill-tokens", str(32 * 4 * 2 * 8),
            "--finetune-tokens", str(32 * 4 * 2 * 4), "-o", str(out), *extra]


@pytest.fixture(scope="module")
def runs(workspace):  # noqa: F811
    one, two = workspace / "dp-one", workspace / "dp-two"
    r1 = subprocess.run([sys.executable, *_convert(workspace, one)], capture_output=True, text=True,
                        env=_env(workspace), timeout=300)
    assert r1.returncode == 0, r1.stderr[-2000:]
    # the 2-process run also checkpoints stage 2's activations: DDP with recomputed layers, same math
    r2 = subprocess.run([*TORCHRUN, *_convert(workspace, two, "--set", "finetune.activation_checkpointing=true")],
                        capture_output=True, text=True, env=_env(workspace), timeout=300)
    assert r2.returncode == 0, r2.stderr[-3000:]
    return one, two, r2


def test_two_processes_match_one(runs):
    one, two, res = runs
    assert res.stdout.count(f"wrote {two}") == 1  # rank 0 alone prints (and writes)
    assert sorted(p.name for p in two.parent.iterdir() if p.name.startswith((".dp-two", "dp-two"))) == ["dp-two"]
    r1, r2 = (json.loads((d / "report.json").read_text())["stages"] for d in (one, two))
    assert r2["finetune"]["activation_checkpointing"] is True and r1["finetune"]["activation_checkpointing"] is False
    for stage in ("distill", "finetune"):
        assert r1[stage]["world_size"] == 1 and r2[stage]["world_size"] == 2  # one process group, not 2 copies
        assert r2[stage]["tokens"] == r1[stage]["tokens"] and r2[stage]["steps"] == r1[stage]["steps"]
        h1, h2 = ([h["loss"] for h in r[stage]["history"]] for r in (r1, r2))
        assert len(h1) == len(h2) == r1[stage]["steps"]
        # the global mean of the ranks' half batches is the full batch's loss (distill: global normalizers)
        torch.testing.assert_close(torch.tensor(h2), torch.tensor(h1), rtol=1e-4, atol=1e-7, msg=stage)
    w1, w2 = _weights(one), _weights(two)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5, msg=k)
    trained = [k for k in w1 if "feature_map" in k or "window" in k]
    assert trained  # the stage-1 parameters are among the compared weights


def test_indivisible_batch_is_refused(workspace, tmp_path):  # noqa: F811
    out = tmp_path / "odd"
    args = _convert(workspace, out, "--set", "distill.batch_size=3", "--no-finetune")
    res = subprocess.run([*TORCHRUN, *args], capture_output=True, text=True, env=_env(workspace), timeout=300)
    assert res.returncode != 0
    assert "distill.batch_size 3 cannot be split over 2 torchrun processes" in res.stderr
    assert not out.exists()


def test_helpers_follow_the_torchrun_environment(monkeypatch):
    batch = torch.arange(12).view(6, 2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert (dist.world_size(), dist.rank(), dist.is_main()) == (1, 0, True)
    assert dist.shard(batch) is batch and dist.init("cpu") == "cpu"
    dist.check_batch("distill", 3)  # anything goes in one process
    shards = []
    for r in (0, 1):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("LOCAL_RANK", str(r))
        assert (dist.world_size(), dist.rank(), dist.is_main()) == (2, r, r == 0)
        shards.append(dist.shard(batch))
    assert [s.shape[0] for s in shards] == [3, 3] and torch.equal(torch.cat(shards), batch)  # disjoint, complete
    with pytest.raises(TrainingError, match="multiple of 2"):
        dist.check_batch("finetune", 5)

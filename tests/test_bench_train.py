"""`linearize bench train`: both stages timed on a tiny random config on CPU, the projection, bad inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import run_cli
from linearize.bench import train as bt

pytestmark = pytest.mark.slow  # timed training steps, some under torchrun

# the embedded tokenizer (49,152 tokens) must fit the vocabulary of a --random-weights model
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49152,
        "max_position_embeddings": 1024, "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


@pytest.fixture()
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


def test_both_stages_timed_and_projected(tiny, tmp_path, embedded_dir):
    out = tmp_path / "bt"
    r = run_cli("bench", "train", str(tiny), "--random-weights", "--device", "cpu", "--seq-len", "128", "--batch", "2",
                "--steps", "3", "--warmup-steps", "1", "--tokens", "40M", "-o", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads((out / bt.RESULT_FILE).read_text())
    assert res["layout"].startswith("LLLS") and res["seq_len"] == 128 and res["batch"] == 2
    for stage in ("distill", "finetune"):
        row = res["stages"][stage]
        assert row["status"] == "ok" and row["tokens"] == 3 * 2 * 128 and row["tokens_per_second"] > 0
        assert row["passes_per_micro_batch"] == 1  # 2 rows of 128 tokens fit this machine in one pass
        assert row["seconds_per_step"] == pytest.approx(256 / row["tokens_per_second"], rel=1e-3, abs=6e-5)  # 4 decimals
    proj = res["projection"]
    assert proj["budgets"] == {"distill": 20_000_000, "finetune": 20_000_000}
    want = sum(proj["budgets"][s] / res["stages"][s]["tokens_per_second"] for s in ("distill", "finetune"))
    assert proj["total_seconds"] == pytest.approx(want, rel=1e-3)
    assert proj["target"]["met"] == (proj["total_seconds"] <= 3600)
    assert "projected conversion: 40M tokens" in r.stdout


def test_recipe_fields_set_on_the_command_line(tiny, tmp_path, embedded_dir):
    out = tmp_path / "bt"
    r = run_cli("bench", "train", str(tiny), "--random-weights", "--device", "cpu", "--seq-len", "64", "--batch", "2",
                "--steps", "1", "--warmup-steps", "1", "--stages", "finetune",
                "--set", "finetune.activation_checkpointing=true", "-o", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads((out / bt.RESULT_FILE).read_text())
    assert res["overrides"] == {"finetune.activation_checkpointing": True}
    row = res["stages"]["finetune"]
    assert row["status"] == "ok" and row["activation_checkpointing"] is True
    assert "activation checkpointing)" in r.stderr
    bad = run_cli("bench", "train", str(tiny), "--random-weights", "--device", "cpu", "--set", "finetune.nope=1",
                  "-o", str(tmp_path / "bt2"))
    assert bad.returncode != 0 and "unknown field" in bad.stderr and "Traceback" not in bad.stderr


def test_a_stage_out_of_memory_is_a_row_and_one_line(tiny, tmp_path, monkeypatch, embedded_dir):
    from linearize.errors import ResourceError

    line = ("finetune: one row of 128 tokens does not fit in GPU memory (~1.0 GB free after it failed); lower "
            "--set finetune.seq_len or use a GPU with more memory")

    def out_of_memory(*args, **kwargs):
        raise ResourceError(line)

    monkeypatch.setattr(bt, "_run_stage", out_of_memory)
    logs = []
    res = bt.bench_train(str(tiny), random_weights=True, device="cpu", seq_len=128, batch=2, steps=1, warmup=1,
                         stages="finetune", out_dir=tmp_path / "bt", log=logs.append)
    assert res["stages"]["finetune"] == {"status": "oom", "note": line}
    assert [m for m in logs if m.startswith("finetune")] == [line]  # the stage is named once


def test_projection_uses_the_recipe_budgets_without_tokens():
    from linearize import recipe as R

    rows = {"distill": {"status": "ok", "tokens_per_second": 1000.0},
            "finetune": {"status": "ok", "tokens_per_second": 500.0}}
    rec = R.load("lolcats", {"distill.tokens": "1M", "finetune.tokens": "2M"})
    proj = bt.project(rows, rec, None)
    assert proj["seconds"] == {"distill": 1000.0, "finetune": 4000.0} and "target" not in proj
    assert "seconds" not in bt.project({"distill": rows["distill"]}, rec, 40_000_000)  # a stage missing: no total


@pytest.mark.parametrize("args,needle", [
    (["--stages", "distill,bogus"], "--stages"),
    (["--steps", "0"], "--steps 0"),
    (["--tokenizer", "smollm2-135m", "--seq-len", "-1"], "--seq-len"),
])
def test_bad_input_is_one_line(tiny, tmp_path, args, needle):
    r = run_cli("bench", "train", str(tiny), "--random-weights", "--device", "cpu", *args, "-o", str(tmp_path / "bt"))
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) == 1
    assert not (tmp_path / "bt").exists()


def test_vocabulary_too_small_for_the_tokenizer(tmp_path, embedded_dir):
    path = tmp_path / "small_vocab.json"
    path.write_text(json.dumps({**TINY, "vocab_size": 256}))
    r = run_cli("bench", "train", str(path), "--random-weights", "--device", "cpu", "-o", str(tmp_path / "bt"))
    assert r.returncode == 2 and "do not fit" in r.stderr and "Traceback" not in r.stderr


def test_data_parallel_under_torchrun(tiny, tmp_path, embedded_dir):
    """Two gloo processes share each global micro-batch: global tokens, one printed table, GPU-hours judged, and
    the per-step losses of the one-process run (2 micro-batches of 2 rows per step in both); with --fsdp the same
    losses from a model sharded over the two, and tokens/s per GPU in the table."""
    def run(out, *launcher, extra=()):
        args = ["-m", "linearize.cli", "bench", "train", str(tiny), "--random-weights", "--device", "cpu",
                "--seq-len", "128", "--batch", "2", "--grad-accum", "2", "--steps", "2", "--warmup-steps", "1",
                "--tokens", "40M", "-o", str(out), *extra]
        r = subprocess.run([sys.executable, *launcher, *args], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "COLUMNS": "200"})
        assert r.returncode == 0, r.stderr[-3000:]
        return r, json.loads((out / bt.RESULT_FILE).read_text())

    torchrun = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone")
    r2, two = run(tmp_path / "bt2", *torchrun)
    assert r2.stdout.count("wrote ") == 1 and "x 2 micro-batches over 2 processes" in r2.stdout  # rank 0 prints
    rf, sharded = run(tmp_path / "bt2f", *torchrun, extra=("--fsdp",))
    assert "over 2 processes, sharded (FSDP)" in rf.stdout and "tokens/s per GPU" in rf.stdout
    assert "root sharded over 2 processes on cpu" in rf.stderr  # the shard log line (rank 0)
    r1, one = run(tmp_path / "bt1")
    assert (one["world_size"], two["world_size"], two["grad_accum"]) == (1, 2, 2)
    assert (one["fsdp"], two["fsdp"], sharded["fsdp"], sharded["layout"]) == (False, False, True, one["layout"])
    for stage in ("distill", "finetune"):
        rows = one["stages"][stage], two["stages"][stage], sharded["stages"][stage]
        assert rows[0]["tokens"] == rows[1]["tokens"] == rows[2]["tokens"] == 2 * 2 * 2 * 128  # steps x batch x mb
        for row in rows[1:]:
            assert len(row["losses"]) == 2
            assert row["losses"] == pytest.approx(rows[0]["losses"], rel=1e-4, abs=1e-7), stage  # as test_distributed
            assert row["tokens_per_second_per_gpu"] == pytest.approx(row["tokens_per_second"] / 2)
    proj = two["projection"]
    assert proj["gpu_seconds"] == pytest.approx(2 * proj["total_seconds"], rel=1e-3)
    assert proj["target"]["met"] == (proj["gpu_seconds"] <= 3600)


def test_fsdp_without_torchrun_is_one_line(tiny, tmp_path):
    out = tmp_path / "btf"
    r = run_cli("bench", "train", str(tiny), "--random-weights", "--device", "cpu", "--fsdp", "-o", str(out))
    assert r.returncode != 0 and "--fsdp shards the model over torchrun processes" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_indivisible_batch_under_torchrun_is_one_line(tiny, tmp_path):
    out = tmp_path / "bt3"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", "-m",
                        "linearize.cli", "bench", "train", str(tiny), "--random-weights", "--device", "cpu",
                        "--batch", "3", "-o", str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode != 0 and "--batch 3 cannot be split over 2 torchrun processes" in r.stderr
    assert not out.exists()  # (torchrun adds its own report of the failed processes)

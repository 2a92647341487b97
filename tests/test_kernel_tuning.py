"""Saved per-GPU launch configurations (linearize/kernels/tuning.py): written by bench kernels --tune, reloaded."""

from __future__ import annotations

import json

import pytest
import torch

from linearize.kernels import triton_linear, triton_step, triton_window, tuning


@pytest.fixture()
def iso(tmp_path, monkeypatch):
    """A private cache, pristine configurations and a fake GPU name; restores everything afterwards."""
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path))
    configs = {"linear": dict(triton_linear.CONFIG), "window": dict(triton_window.CONFIG),
               "step": dict(triton_step.CONFIG)}
    monkeypatch.setattr(triton_linear, "CONFIG", configs["linear"])
    monkeypatch.setattr(triton_window, "CONFIG", configs["window"])
    monkeypatch.setattr(triton_step, "CONFIG", configs["step"])
    monkeypatch.setattr(tuning, "_CONFIGS", dict(configs))  # what the modules registered at import, as copies
    monkeypatch.setattr(tuning, "_STATE", {"checked": False, "source": None, "tuned": None})
    monkeypatch.setattr(tuning, "_gpu_name", lambda device=None: "NVIDIA Test GPU 80GB")
    return tmp_path


def test_save_then_apply_on_the_same_gpu(iso):
    triton_linear.CONFIG["fwd_warps"] = 4
    triton_window.CONFIG["fwd_warps"] = 4
    triton_step.CONFIG["step_warps"] = 16
    path = tuning.save("NVIDIA Test GPU 80GB")
    assert path == iso / "kernels" / "nvidia-test-gpu-80gb.json"
    blob = json.loads(path.read_text())
    assert blob["gpu"] == "NVIDIA Test GPU 80GB" and blob["linear"]["fwd_warps"] == 4
    assert blob["step"]["step_warps"] == 16
    triton_linear.CONFIG["fwd_warps"] = 8  # back to a default in memory
    triton_window.CONFIG["fwd_warps"] = 8
    triton_step.CONFIG["step_warps"] = 4
    tuning.ensure_applied(torch.device("cuda", 0))
    assert triton_linear.CONFIG["fwd_warps"] == 4 and triton_window.CONFIG["fwd_warps"] == 4
    assert triton_step.CONFIG["step_warps"] == 16
    assert tuning.applied_from() == str(path)
    triton_linear.CONFIG["fwd_warps"] = 2
    tuning.ensure_applied(torch.device("cuda", 0))  # once per process
    assert triton_linear.CONFIG["fwd_warps"] == 2


@pytest.mark.parametrize("edit", ["gpu", "triton", "unknown_key", "garbage"])
def test_unusable_files_are_ignored(iso, edit):
    path = tuning.save("NVIDIA Test GPU 80GB")
    blob = json.loads(path.read_text())
    if edit == "gpu":
        blob["gpu"] = "Another GPU"
    elif edit == "triton":
        blob["triton"] = "0.0.1"
    elif edit == "unknown_key":
        blob["linear"]["no_such_knob"] = 1
    path.write_text("{not json" if edit == "garbage" else json.dumps(blob))
    before = dict(triton_linear.CONFIG)
    assert tuning.load("NVIDIA Test GPU 80GB") is None
    tuning.ensure_applied(torch.device("cuda", 0))
    assert triton_linear.CONFIG == before and tuning.applied_from() is None


def test_files_from_before_the_step_sweeps_still_apply(iso):
    """A file without the decode steps' section (written before they were tuned) applies its kernels' settings
    and leaves the steps' defaults."""
    triton_linear.CONFIG["fwd_warps"] = 4
    path = tuning.save("NVIDIA Test GPU 80GB")
    blob = json.loads(path.read_text())
    del blob["step"]
    path.write_text(json.dumps(blob))
    triton_linear.CONFIG["fwd_warps"] = 8
    steps = dict(triton_step.CONFIG)
    tuning.ensure_applied(torch.device("cuda", 0))
    assert triton_linear.CONFIG["fwd_warps"] == 4 and triton_step.CONFIG == steps


def test_a_module_imported_after_the_first_launch_gets_its_section(iso, monkeypatch):
    """A model's prefill launches the forward kernels (and loads the file) before the first decode step imports the
    steps' module: the steps' saved section still applies when that module registers, and an unknown key there
    leaves its defaults."""
    triton_step.CONFIG["step_ring_split"] = 64
    tuning.save("NVIDIA Test GPU 80GB")
    triton_step.CONFIG["step_ring_split"] = 0
    del tuning._CONFIGS["step"]  # not imported yet
    tuning.ensure_applied(torch.device("cuda", 0))
    assert triton_step.CONFIG["step_ring_split"] == 0 and tuning.applied_from() is not None
    tuning.register("step", triton_step.CONFIG)  # the first decode step imports it
    assert triton_step.CONFIG["step_ring_split"] == 64
    late = dict(triton_step.CONFIG, no_such_knob=1)
    monkeypatch.setitem(tuning._STATE["tuned"], "late", late)
    fresh = {"step_ring_split": 0}
    tuning.register("late", fresh)
    assert fresh == {"step_ring_split": 0}


def test_cpu_and_opt_out_leave_the_defaults(iso, monkeypatch):
    triton_linear.CONFIG["fwd_warps"] = 4
    tuning.save("NVIDIA Test GPU 80GB")
    triton_linear.CONFIG["fwd_warps"] = 8
    tuning.ensure_applied(torch.device("cpu"))
    assert triton_linear.CONFIG["fwd_warps"] == 8
    monkeypatch.setattr(tuning, "_STATE", {"checked": False, "source": None})
    monkeypatch.setenv("LINEARIZE_KERNEL_TUNING", "0")
    tuning.ensure_applied(torch.device("cuda", 0))
    assert triton_linear.CONFIG["fwd_warps"] == 8 and tuning.applied_from() is None


def test_bench_summary_ratios_per_length():
    """`bench kernels`' summary: their ms / our ms per T, and both window rows (plain and fused Hedgehog
    features) against our plain linear forward."""
    from linearize.bench.kernels import summarize

    def row(bench, impl, passes, ms, T=2048):
        return {"bench": bench, "impl": impl, "T": T, "B": 16, "passes": passes, "ms": ms}

    rows = [row("linear", "ours", "fwd", 0.5), row("linear", "ours", "fwd+bwd", 2.0),
            row("linear", "fla", "fwd", 1.5), row("linear", "fla-unnorm", "fwd", 0.6),
            row("linear", "fla", "fwd+bwd", 3.0), row("linear", "sdpa-flash", "fwd", 1.0),
            row("linear", "sdpa-cudnn", "fwd", 0.8), row("window", "ours W=64", "fwd", 1.0),
            row("window", "ours W=64", "fwd+bwd", 4.0), row("window", "ours W=64 fused hedgehog", "fwd", 0.6)]
    (s,) = summarize(rows)
    assert s["T"] == 2048 and s["fwd vs fla norm"] == pytest.approx(3.0)
    assert s["fwd vs fla unnorm"] == pytest.approx(1.2) and s["fwd+bwd vs fla norm"] == pytest.approx(1.5)
    assert s["fwd vs best sdpa"] == pytest.approx(1.6)
    assert s["window fwd / ours fwd"] == pytest.approx(2.0)
    assert s["window fused-hedgehog fwd / ours fwd"] == pytest.approx(1.2)


def test_sweep_never_keeps_a_configuration_that_changes_the_result():
    """bench.sweep_configs: a faster setting with a wrong result (or a compile failure) is reported and left out;
    the fastest correct one comes first and the configuration is restored."""
    from linearize.bench.kernels import TUNE_TOLERANCE, sweep_configs

    config = {"tile": 64, "warps": 4}
    x = torch.linspace(1, 2, 100)
    ms = {64: 2.0, 128: 0.5, 256: 1.0}  # 128 is fastest but wrong; 256 fails to compile with 8 warps

    def run(t):
        if config["tile"] == 256 and config["warps"] == 8:
            raise RuntimeError("out of shared memory")
        return (t * (1.5 if config["tile"] == 128 else 1 + TUNE_TOLERANCE / 4),)

    timer = lambda fn: (fn(), ms[config["tile"]] / config["warps"] * 4)[1]  # noqa: E731
    logs = []
    out = sweep_configs(config, {"tile": [128, 256], "warps": [4, 8]}, run, {(1, 100): (x,)}, {(1, 100): [x]},
                        {(1, 100): 2.0}, timer, logs.append)
    assert [c for _, c in out] == [{"tile": 256, "warps": 4}, {}]
    assert out[0][0] == pytest.approx(0.5) and out[1][0] == pytest.approx(1.0)
    assert config == {"tile": 64, "warps": 4}
    assert sum("wrong result" in m for m in logs) == 2 and sum("out of shared memory" in m for m in logs) == 1


def test_tune_only_names_the_known_families():
    """A mistyped family ends in one line listing the known ones (checked before any GPU is needed)."""
    from conftest import run_cli

    from linearize.bench.kernels import TUNE_FAMILIES

    r = run_cli("bench", "kernels", "--tune-only", "lin_fwd,win_bwd")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    msg = r.stderr.strip().splitlines()
    assert len(msg) == 1 and "unknown win_bwd" in msg[0] and all(f in msg[0] for f in TUNE_FAMILIES)


def test_sweep_stops_when_a_configuration_kills_the_gpu_context():
    """After an illegal memory access every later launch fails too: the sweep stops with one clear error
    (and the configuration is restored) instead of timing the rest as failures."""
    from linearize.bench.kernels import sweep_configs

    config = {"tile": 64}
    x = torch.ones(4)
    tried = []

    def run(t):
        tried.append(config["tile"])
        if config["tile"] == 128:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return (t,)

    from linearize.errors import DeviceError

    with pytest.raises(DeviceError, match=r"\{.tile.: 128\} crashed the GPU context"):
        sweep_configs(config, {"tile": [128, 256]}, run, {(1, 4): (x,)}, {(1, 4): [x]}, {(1, 4): 1.0},
                      lambda fn: 1.0, lambda m: None)
    assert config == {"tile": 64} and 256 not in tried


def test_bench_rows_written_as_they_come(tmp_path):
    """`bench kernels -o`: the JSON is rewritten atomically after each block of rows (complete: false) and at the end."""
    from linearize.bench.kernels import write_rows

    out = tmp_path / "sub" / "bench.json"
    rows = [{"bench": "copy", "ms": 0.5}]
    write_rows(out, {"date": "d"}, [], rows, complete=False)
    assert json.loads(out.read_text()) == {"meta": {"date": "d"}, "checks": [], "rows": rows, "complete": False}
    rows.append({"bench": "linear", "ms": 1.0})
    write_rows(out, {"date": "d"}, [], rows, complete=True)
    blob = json.loads(out.read_text())
    assert blob["complete"] and len(blob["rows"]) == 2
    assert [p.name for p in out.parent.iterdir()] == ["bench.json"]  # no temporary file left


def test_decode_step_sweeps_run_and_save(iso):
    """tune_kernels' decode-step families end to end (on CPU: the PyTorch steps, a fake timer): every candidate
    gives the defaults' step (the saved state is restored before each call), the fastest is kept and saved."""
    import itertools

    from linearize.bench.kernels import tune_kernels

    ticks = itertools.count()
    # a timer under which later candidates look faster, so the sweep must move off the defaults
    out = tune_kernels(heads=4, dim=16, families=["lin_step", "win_step"], device="cpu",
                       timer=lambda fn: (fn(), 1000.0 - next(ticks))[1])
    assert out["step"] == triton_step.CONFIG
    assert (out["step"]["step_waves"], out["step"]["step_warps"]) == (2.0, 16)  # the last candidate of the grid
    assert out["step"]["linear_step_waves"] == 2.0
    saved = json.loads(tuning.tuned_path("cpu").read_text())
    assert saved["step"] == out["step"]


def test_window_fused_sweep_is_skipped_under_the_two_pass_forward(iso):
    """With the two-pass window forward (the default) the window's fused forward is the linear kernel's, shifted:
    its own fused_bv / fused_warps change nothing (an H200 sweep of 2026-12-02 timed nine candidates within 0.6% and
    kept one by noise), so the sweep says so and leaves them."""
    from linearize.bench.kernels import tune_kernels

    before = dict(triton_window.CONFIG)
    said = []
    out = tune_kernels(heads=4, dim=16, families=["win_fused_fwd"], device="cpu", progress=said.append,
                       timer=lambda fn: 1.0)
    assert triton_window.CONFIG == before and out["window"] == before
    assert len(said) == 2 and said[0].startswith("tune win_fused_fwd: skipped") and said[1].startswith("tuned:")

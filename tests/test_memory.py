"""Fitting a training micro-batch to the memory there is (linearize.train.memory) and the stages' split passes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from linearize.errors import ResourceError
from linearize.train import distill as D
from linearize.train import finetune as FT
from linearize.train import loop as L
from linearize.train import memory as M
from test_distill import _hybrid as distill_hybrid
from test_distill import _recipe as distill_recipe
from test_distill import _tokenizer, corpus  # noqa: F401 - the corpus fixture is used by name
from test_finetune import _hybrid as finetune_hybrid
from test_finetune import _recipe as finetune_recipe

QUIET = dict(progress=False, log=lambda m: None)
GB = 10**9
CPU = torch.device("cpu")


def _measured(monkeypatch, *, in_use: float, peaks: list[float], free: float) -> list[int]:
    """Pretend the device has ``in_use`` GB in use, ``free`` GB free and reaches ``peaks`` GB (absolute) in
    successive measured passes; returns the row counts ``run_rows`` was called with."""
    calls: list[int] = []
    left = list(peaks)

    def peak_bytes(device, fn):
        fn()
        return int(left.pop(0) * GB)

    monkeypatch.setattr(M, "peak_bytes", peak_bytes)
    monkeypatch.setattr(M, "_in_use", lambda device: int(in_use * GB))
    monkeypatch.setattr(M, "free_bytes", lambda device: int(free * GB))
    return calls


def test_a_micro_batch_that_fits_runs_whole(monkeypatch):
    calls = _measured(monkeypatch, in_use=1, peaks=[2, 2.5], free=20)
    logs = []
    assert M.plan_pieces("distill", 16, 2048, CPU, calls.append, log=logs.append) == 1  # 2 + 15 x 0.5 <= 1 + 16
    assert calls == [1, 2] and logs == []


def test_a_micro_batch_that_does_not_fit_is_split_evenly(monkeypatch):
    calls = _measured(monkeypatch, in_use=1, peaks=[2, 3], free=5)  # 1 GB a row; 1 + 0.8 x 5 = 5 GB: 4 rows fit
    logs = []
    assert M.plan_pieces("finetune", 16, 2048, CPU, calls.append, log=logs.append) == 4
    assert len(logs) == 1 and "finetune: a micro-batch of 16 rows x 2,048 tokens needs ~16.0 GB at its peak and ~5.0 " \
                              "GB are available" in logs[0]
    assert "4 passes of 4 rows (same effective batch" in logs[0]
    _measured(monkeypatch, in_use=1, peaks=[2, 3], free=4)  # 1 + 3.2 GB: 3 rows fit; 10 rows do not split in 4
    assert M.plan_pieces("finetune", 10, 2048, CPU, lambda n: None, log=logs.append) == 5


def test_one_row_that_does_not_fit_is_one_clear_error(monkeypatch):
    _measured(monkeypatch, in_use=1, peaks=[9, 12], free=5)
    with pytest.raises(ResourceError) as e:
        M.plan_pieces("distill", 4, 4096, CPU, lambda n: None)
    msg = str(e.value)
    assert msg.startswith("distill: one row of 4,096 tokens needs ~8.0 GB at its peak and only ~5.0 GB are available")
    assert "--set distill.seq_len" in msg and "\n" not in msg and e.value.exit_code == 3


def test_one_row_is_measured_once_and_nothing_splits_without_a_meter(monkeypatch):
    calls = []
    _measured(monkeypatch, in_use=1, peaks=[2], free=5)
    assert M.plan_pieces("distill", 1, 2048, CPU, calls.append) == 1 and calls == [1]
    calls.clear()
    monkeypatch.setattr(M, "peak_bytes", lambda device, fn: (fn(), None)[1])  # cannot measure here
    assert M.plan_pieces("distill", 8, 2048, CPU, calls.append) == 1 and calls == [1]


def test_one_row_that_does_not_fit_turns_the_lean_mode_on_and_measures_again(monkeypatch):
    calls = _measured(monkeypatch, in_use=1, peaks=[9, 2, 3], free=5)  # lean: 1 GB a row, 4 rows fit
    logs, switched = [], []
    lean = ("activation checkpointing", lambda: switched.append(True))
    assert M.plan_pieces("finetune", 16, 2048, CPU, calls.append, log=logs.append, lean=lean) == 4
    assert switched == [True] and calls == [1, 1, 2]
    assert logs[0] == ("finetune: one row of 2,048 tokens needs ~8.0 GB at its peak and only ~5.0 GB are available: "
                       "turning on activation checkpointing")
    assert "4 passes of 4 rows" in logs[1] and len(logs) == 2
    _measured(monkeypatch, in_use=1, peaks=[9, 7], free=5)  # still too big once lean: the one-line error
    with pytest.raises(ResourceError, match=r"^finetune: one row of 2,048 tokens needs ~6.0 GB at its peak"):
        M.plan_pieces("finetune", 16, 2048, CPU, lambda n: None, log=logs.append, lean=lean)
    assert switched == [True, True]


def test_measuring_leaves_the_random_state_alone(monkeypatch):
    _measured(monkeypatch, in_use=1, peaks=[2, 3], free=100)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    M.plan_pieces("finetune", 4, 64, CPU, lambda n: torch.rand(n))  # dropout draws while measuring
    assert torch.equal(torch.rand(3), expected)


# run in a fresh interpreter: in a long test session a 256 MB tensor can reuse heap memory that earlier tests freed
# but the allocator kept resident, so it need not raise the resident set at all (seen in CI)
HOST_PEAK = """
import torch
from linearize.train import memory as M
cpu = torch.device("cpu")
base = M._in_use(cpu)
def allocate():
    x = torch.ones(64 * 2**20)  # 256 MB, touched: resident
    return float(x[-1])
first = M.peak_bytes(cpu, allocate)
second = M.peak_bytes(cpu, lambda: None)  # the peak was reset: back near the resident set
print(M.free_bytes(cpu), base, first, second)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="host peak measured through /proc (Linux)")
def test_host_peak_and_free_memory_are_read_on_linux():
    res = subprocess.run([sys.executable, "-c", HOST_PEAK], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    free, base, first, second = (int(v) for v in res.stdout.split())
    size = 256 * 2**20
    assert free > 0
    assert first >= base + 0.9 * size
    assert second < first - 0.5 * size


def _force_split(monkeypatch, pieces: int) -> list[int]:
    """Make the stage loop split each micro-batch into ``pieces`` passes; record the rows it measured."""
    seen: list[int] = []

    def plan(stage, rows, seq_len, device, run_rows, log=print, lean=None):
        run_rows(1)  # the stage's measuring pass runs
        seen.append(rows)
        return pieces

    monkeypatch.setattr(L, "plan_pieces", plan)
    return seen


def test_a_split_distill_step_equals_smaller_micro_batches_accumulated(corpus, monkeypatch):  # noqa: F811
    tok = _tokenizer()
    a = distill_hybrid()
    seen = _force_split(monkeypatch, 2)
    rep = D.distill(a, tok, distill_recipe(corpus, batch_size=4, tokens=64 * 4 * 4, copy_fraction=0.0), **QUIET)
    assert seen == [4] and rep["passes_per_micro_batch"] == 2 and rep["steps"] == 4
    monkeypatch.undo()
    b = distill_hybrid()
    rep_b = D.distill(b, tok, distill_recipe(corpus, batch_size=2, grad_accum=2, tokens=64 * 4 * 4,
                                             copy_fraction=0.0), **QUIET)
    assert rep_b["passes_per_micro_batch"] == 1 and rep_b["steps"] == 4
    for (k, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(pa, pb, atol=1e-6), k
    assert [h["loss"] for h in rep["history"]] == pytest.approx([h["loss"] for h in rep_b["history"]], rel=1e-5)


def test_a_split_finetune_step_equals_the_whole_micro_batch(corpus, monkeypatch):  # noqa: F811
    tok = _tokenizer()
    rec = finetune_recipe(corpus, steps=4, batch_size=4, tokens=64 * 4 * 4, copy_fraction=0.0)
    whole, rep_whole = FT.finetune(finetune_hybrid(), tok, rec, **QUIET)
    assert rep_whole["passes_per_micro_batch"] == 1
    seen = _force_split(monkeypatch, 4)
    split, rep_split = FT.finetune(finetune_hybrid(), tok, rec, **QUIET)
    assert seen == [4] and rep_split["passes_per_micro_batch"] == 4
    for (k, pa), pb in zip(whole.state_dict().items(), split.state_dict().values()):
        assert torch.allclose(pa, pb, atol=1e-5), k
    assert [h["loss"] for h in rep_split["history"]] == pytest.approx([h["loss"] for h in rep_whole["history"]],
                                                                      rel=1e-5)


def test_finetune_turns_activation_checkpointing_on_when_one_row_does_not_fit(corpus, monkeypatch):  # noqa: F811
    """The lean fallback of stage 2: decoder layers recompute their forward in the backward, the step's math is
    unchanged, and the model comes back without checkpointing."""
    tok = _tokenizer()
    rec = finetune_recipe(corpus, steps=3, batch_size=2, tokens=64 * 2 * 3, copy_fraction=0.0)
    model = finetune_hybrid()
    grad_forwards = []  # forwards of layer 0's MLP with autograd on (inside the checkpointed region)
    model.model.layers[0].mlp.register_forward_pre_hook(lambda mod, args: grad_forwards.append(torch.is_grad_enabled()))
    plain, rep_plain = FT.finetune(model, tok, rec, **QUIET)
    assert rep_plain["activation_checkpointing"] is False
    assert sum(grad_forwards) == 2 + 3  # measuring 1 and 2 rows, 3 steps
    peaks = iter([50, 2, 2.5])  # one row "needs" 49 GB of 5, then fits once lean; two rows fit
    monkeypatch.setattr(M, "peak_bytes", lambda device, fn: (fn(), int(next(peaks) * GB))[1])
    monkeypatch.setattr(M, "_in_use", lambda device: GB)
    monkeypatch.setattr(M, "free_bytes", lambda device: 5 * GB)
    model = finetune_hybrid()
    grad_forwards.clear()
    model.model.layers[0].mlp.register_forward_pre_hook(lambda mod, args: grad_forwards.append(torch.is_grad_enabled()))
    logs = []
    lean, rep = FT.finetune(model, tok, rec, progress=False, log=logs.append)
    assert rep["activation_checkpointing"] is True and rep["passes_per_micro_batch"] == 1
    assert any("turning on activation checkpointing" in m for m in logs)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in lean.modules())
    for (k, pa), pb in zip(plain.state_dict().items(), lean.state_dict().values()):
        assert torch.allclose(pa, pb, atol=1e-5), k
    assert [h["loss"] for h in rep["history"]] == pytest.approx([h["loss"] for h in rep_plain["history"]], rel=1e-5)
    assert sum(grad_forwards) == 1 + 2 * (2 + 3)  # 1 row plain; then 1 and 2 rows and 3 steps, each recomputed


def test_running_out_of_gpu_memory_while_measuring(monkeypatch):
    """Two rows that raise torch.OutOfMemoryError: one row per pass; one row that does: one clear line."""
    def meter(fail_at):
        def peak_bytes(device, fn):
            n = fn()
            if n >= fail_at:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return int((1 + n) * GB)
        return peak_bytes

    monkeypatch.setattr(M, "_in_use", lambda device: GB)
    monkeypatch.setattr(M, "free_bytes", lambda device: 3 * GB)
    monkeypatch.setattr(M.torch.cuda, "empty_cache", lambda: None)
    logs = []
    monkeypatch.setattr(M, "peak_bytes", meter(fail_at=2))
    assert M.plan_pieces("finetune", 8, 2048, CPU, lambda n: n, log=logs.append) == 8
    assert len(logs) == 1 and "needs more than two rows' worth at its peak" in logs[0] and "8 passes of 1 row (" in logs[0]
    monkeypatch.setattr(M, "peak_bytes", meter(fail_at=1))
    with pytest.raises(ResourceError, match=r"^finetune: one row of 2,048 tokens does not fit in GPU memory "):
        M.plan_pieces("finetune", 8, 2048, CPU, lambda n: n)
    lean_on = []  # out of memory at one row, then lean: measured again and fits whole
    monkeypatch.setattr(M, "peak_bytes", lambda device, fn: meter(fail_at=1 if not lean_on else 99)(device, fn))
    logs.clear()
    assert M.plan_pieces("finetune", 2, 2048, CPU, lambda n: n, log=logs.append,
                         lean=("activation checkpointing", lambda: lean_on.append(1))) == 1
    assert lean_on == [1] and logs == ["finetune: one row of 2,048 tokens needs more than the free GPU memory: "
                                       "turning on activation checkpointing"]

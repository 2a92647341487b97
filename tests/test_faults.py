"""Fault injection: what happens when things go wrong, through the CLI.

Kills during save and during training, out-of-memory in every stage, exploding and non-finite losses,
corrupt shards, bad YAML and bad inputs. Each case asserts the exit code, ONE line on stderr naming
what went wrong, no traceback, that nothing is lost (a resumed run ends with the weights of an
uninterrupted one) and that nothing half-written looks finished.

Real kills and injected out-of-memory errors run in a subprocess through :data:`DRIVER`, which patches
one function (selected by ``LINEARIZE_TEST_FAULT``) and then starts the normal CLI; everything else
runs the CLI in-process (``typer.testing.CliRunner``), which is the same code path without the
interpreter start-up. Tiny 2-layer models throughout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from linearize.cli import app
from linearize.errors import RecipeError, ResourceError, TrainingError, UnsupportedModelError
from linearize.train import distill as D
from linearize.train import finetune as FT
from linearize.train import guards
from linearize.train import loop as L
from test_interrupt import _env, workspace  # noqa: F401 - the tiny model + corpus fixture is used by name

#: patches one thing, then runs ``linearize ARGS`` as the console script does.
#: LINEARIZE_TEST_FAULT = KIND:LAYER:N. KIND slow-save: the first shard is written, a marker file
#: (LINEARIZE_TEST_MARK) appears, then the save hangs (to be killed). KIND kill / cuda-oom / host-oom:
#: the N-th training-mode forward of linear layer LAYER sends SIGKILL to the process / raises
#: torch.OutOfMemoryError / raises MemoryError.
DRIVER = r"""
import os, signal, sys, time
import torch
kind, layer, at = os.environ["LINEARIZE_TEST_FAULT"].split(":")
if kind == "slow-save":
    import linearize.io.checkpoint as C
    real_save = C.save_file
    def save_file(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        open(os.environ["LINEARIZE_TEST_MARK"], "w").close()
        time.sleep(300)
    C.save_file = save_file
else:
    import linearize.model.attention as A
    import linearize.train.loop
    # the counts below are of training forwards: no measuring forwards before step 0 (linearize.train.memory)
    linearize.train.loop.plan_pieces = lambda *args, **kwargs: 1
    real_forward = A.LinearAttention.forward
    seen = [0]
    def forward(self, *args, **kwargs):
        if self.training and self.layer_idx == int(layer):
            seen[0] += 1
            if seen[0] == int(at):
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if kind == "cuda-oom":
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                if kind == "host-oom":
                    raise MemoryError()
        return real_forward(self, *args, **kwargs)
    A.LinearAttention.forward = forward
from linearize.cli import main
sys.argv[0] = "linearize"
main()
"""

SMALL = {"seq_len": 32, "batch_size": 2, "eval_seqs": 2, "warmup_steps": 1}


def _sets(stage: str, corpus: Path, **kw) -> list[str]:
    out = []
    pinned = {"loss": "xent"} if stage == "finetune" else {}  # the step counts below assume next-token loss
    for k, v in {**SMALL, **pinned, "data": corpus, **kw}.items():
        out += ["--set", f"{stage}.{k}={v}"]
    return out


def _driver(ws: Path, fault: str, *args, mark: Path | None = None, wait: bool = True):
    env = {**_env(ws), "LINEARIZE_TEST_FAULT": fault, "COLUMNS": "400"}
    if mark is not None:
        env["LINEARIZE_TEST_MARK"] = str(mark)
    cmd = [sys.executable, "-c", DRIVER, *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _cli(*args):
    """The CLI in this process; ``exception`` is set when something escaped as a traceback would."""
    return CliRunner().invoke(app, [str(a) for a in args])


def _one_line(res, code: int, *needles: str, progress: bool = False) -> str:
    """Exit ``code``, exactly one non-empty stderr line holding every needle, no traceback. With
    ``progress`` (eval draws its progress bars on stderr) the error is the one last ``error:`` line."""
    exc = getattr(res, "exception", None)
    assert exc is None or isinstance(exc, SystemExit), f"escaped: {exc!r}"
    rc = res.exit_code if hasattr(res, "exit_code") else res.returncode
    assert rc == code, (rc, res.stderr[-3000:])
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    if progress:
        assert [ln for ln in lines if "error:" in ln] == lines[-1:], res.stderr
        lines = lines[-1:]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for name in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(path / name)))
    return out


def _same(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6), k


@pytest.fixture(scope="module")
def ws(workspace):  # noqa: F811
    """The tiny model + corpus, with this process set up like the subprocesses (cache, one thread)."""
    from transformers.utils import logging as hf_logging

    mp = pytest.MonkeyPatch()
    mp.setenv("LINEARIZE_CACHE", str(workspace / "cache"))
    hf_logging.disable_progress_bar()  # as the console script does
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield workspace
    torch.set_num_threads(threads)
    hf_logging.enable_progress_bar()
    mp.undo()


@pytest.fixture(scope="module")
def hybrid(ws):
    """An untrained tiny hybrid checkpoint (both layers linear, window 8)."""
    out = ws / "hybrid"
    res = _cli("convert", ws / "tiny", "--ratio", "1:0", "--set", "attention.window=8", "--no-train", "-o", out)
    assert res.exit_code == 0, res.stderr
    return out


# ------------------------------------------------------------------------------------------ kills


def test_kill_during_save_leaves_nothing_finished_and_rerun_succeeds(ws, tmp_path):
    out, mark = tmp_path / "OUT", tmp_path / "saving"
    proc = _driver(ws, "slow-save:0:0", "convert", ws / "tiny", "--ratio", "1:0", "--set", "attention.window=8",
                   "--no-train", "-o", out, mark=mark, wait=False)
    deadline = time.time() + 120
    while not mark.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert mark.exists(), proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert not out.exists()  # nothing that looks finished...
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".OUT.tmp-")]
    assert len(leftovers) == 1  # ...only a hidden, half-written temporary directory
    assert any(p.suffix == ".safetensors" for p in (tmp_path / leftovers[0]).iterdir())
    res = _cli("convert", ws / "tiny", "--ratio", "1:0", "--set", "attention.window=8", "--no-train", "-o", out)
    assert res.exit_code == 0, res.stderr
    from linearize.io.checkpoint import verify_checkpoint

    verify_checkpoint(out, hashes=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["OUT", "saving"]  # the dead run's leftovers are gone


def test_killed_between_renames_restores_the_previous_output(tmp_path):
    from linearize.io.checkpoint import atomic_dir

    out = tmp_path / "OUT"
    out.mkdir()
    (out / "config.json").write_text("{}")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited: its leftovers are fair game
    os.replace(out, tmp_path / f".OUT.old-{pid}")  # a rerun in place was killed after moving OUT aside
    (tmp_path / f".OUT.tmp-{pid}").mkdir()
    with atomic_dir(out, overwrite=True) as tmp:
        assert (out / "config.json").is_file()  # put back before anything else happens
        (tmp / "new.txt").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["OUT"]
    assert [p.name for p in out.iterdir()] == ["new.txt"]


def test_disk_full_during_save_is_one_line_and_leaves_nothing(ws, tmp_path, monkeypatch):
    import errno

    import linearize.io.checkpoint as C

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(C, "save_file", full)
    res = _cli("convert", ws / "tiny", "--ratio", "1:0", "--no-train", "-o", tmp_path / "OUT")
    _one_line(res, 2, "model-00001-of-00001.safetensors: No space left on device (disk full)")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def finetune_full(ws, hybrid):
    """An uninterrupted LoRA run on the hybrid (8 steps), in this process."""
    out = ws / "ft-full"
    res = _cli("finetune", hybrid, "--tokens", 32 * 2 * 8, *_sets("finetune", ws / "corpus.txt"), "-o", out)
    assert res.exit_code == 0, res.stderr
    # a stage rerun on a checkpoint without adapters scores the recall check against softmax mode (the teacher)
    rc = json.loads((out / "report.json").read_text())["stages"]["recall"]
    assert rc["task"] == "copy" and rc["length"] == 32 and 0 <= rc["hybrid"] <= 1 and 0 <= rc["teacher"] <= 1
    return out


def test_kill_during_finetune_then_resume_matches(ws, hybrid, finetune_full, tmp_path):
    out = tmp_path / "OUT"
    args = ["finetune", hybrid, "--tokens", 32 * 2 * 8, *_sets("finetune", ws / "corpus.txt", checkpoint_every=2),
            "-o", out]
    res = _driver(ws, "kill:0:6", *args)  # SIGKILL inside step 5: the last periodic checkpoint is step 4
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    assert not out.exists()
    state = torch.load(tmp_path / ".OUT.state" / "finetune-state.pt", weights_only=False)
    assert state["step"] == 4
    res = _cli(*args, "--resume")
    assert res.exit_code == 0, res.stderr
    assert "resumed at step 4/8" in res.stdout
    _same(out, finetune_full)
    assert not (tmp_path / ".OUT.state").exists()


# ------------------------------------------------------------------------------------ out of memory


def test_oom_in_distill_saves_state_and_resume_matches(ws, tmp_path):
    args = ["convert", ws / "tiny", "--ratio", "1:0", "--set", "attention.window=8", "--no-finetune",
            "--tokens", 32 * 2 * 8, *_sets("distill", ws / "corpus.txt", checkpoint_every=100)]
    full = tmp_path / "FULL"
    assert _cli(*args, "-o", full).exit_code == 0
    out = tmp_path / "OUT"
    res = _driver(ws, "cuda-oom:1:4", *args, "-o", out)  # layer 1's forward in step 3 (0-based)
    line = _one_line(res, 3, "distill: out of GPU memory in layer 1 at step 3/8 (batch 2 x 32 tokens)",
                     "state saved in", "--resume", "--dtype bfloat16",
                     "--set distill.batch_size=1 --set distill.grad_accum=2")
    assert str(tmp_path / ".OUT.state") in line
    assert not out.exists() and not list(tmp_path.glob(".OUT.tmp-*"))
    # checkpoint_every=100: this state can only come from the out-of-memory handler
    assert torch.load(tmp_path / ".OUT.state" / "distill-state.pt", weights_only=False)["step"] == 3
    res = _cli(*args, "-o", out, "--resume")
    assert res.exit_code == 0, res.stderr
    assert "resumed at step 3/8" in res.stdout
    _same(out, full)


def test_host_oom_in_finetune_saves_state_and_resume_matches(ws, hybrid, finetune_full, tmp_path):
    out = tmp_path / "OUT"
    args = ["finetune", hybrid, "--tokens", 32 * 2 * 8, *_sets("finetune", ws / "corpus.txt", checkpoint_every=100),
            "-o", out]
    res = _driver(ws, "host-oom:0:3", *args)
    _one_line(res, 3, "finetune: out of host memory in layer 0 at step 2/8 (batch 2 x 32 tokens)",
              "state saved in", "run the same command with --resume", "--set finetune.batch_size=1")
    assert not out.exists()
    assert torch.load(tmp_path / ".OUT.state" / "finetune-state.pt", weights_only=False)["step"] == 2
    res = _cli(*args, "--resume")
    assert res.exit_code == 0, res.stderr
    assert "resumed at step 2/8" in res.stdout
    _same(out, finetune_full)


def test_oom_in_eval_is_one_line_and_writes_nothing(ws, hybrid, tmp_path, monkeypatch):
    import linearize.model.attention as A

    def oom(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(A.LinearAttention, "forward", oom)
    res = _cli("eval", hybrid, "--task", "ppl", "--lengths", "64", "--data", ws / "corpus.txt", "-o", tmp_path / "EV")
    _one_line(res, 3, "eval: out of GPU memory in task ppl on the model", "in layer 0", "(batch 1 x 64 tokens)",
              "--lengths", progress=True)
    assert list(tmp_path.iterdir()) == []


def test_cpu_allocator_failure_in_generate_is_one_line(hybrid, monkeypatch):
    import linearize.model.attention as A

    def oom(self, *args, **kwargs):  # what torch raises when the host allocator fails
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(A.LinearAttention, "forward", oom)
    _one_line(_cli("generate", hybrid, "Hi", "--max-new-tokens", "2"), 3,
              "generate: out of host memory in layer 0", "--dtype bfloat16")


def test_oom_inside_the_optimizer_step_keeps_the_last_checkpoint(tmp_path):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()  # the optimizer took step 1 while the loop still counts 0 completed: cut short
    ckpt = tmp_path / "state.pt"
    ckpt.write_bytes(b"previous")
    guard = guards.LossGuard("distill", {"batch_size": 4, "grad_accum": 1, "seq_len": 64}, ckpt=ckpt)

    def must_not_save():
        raise AssertionError("a half-applied optimizer step must not be saved")

    err = guard.out_of_memory(torch.OutOfMemoryError("CUDA out of memory"), step=0, total=9, save=must_not_save,
                              optimizer=opt)
    assert isinstance(err, ResourceError) and err.exit_code == 3
    assert "optimizer step was cut short" in str(err) and "--resume" in str(err) and "\n" not in str(err)
    assert ckpt.read_bytes() == b"previous"


def test_is_oom_recognises_each_kind():
    assert guards.is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert guards.is_oom(MemoryError())
    assert guards.is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert guards.is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert guards.memory_kind(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED")) == "GPU"
    assert not guards.is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm`"))
    assert not guards.is_oom(RuntimeError("shape mismatch"))
    assert guards.memory_kind(MemoryError()) == "host" and guards.memory_kind(torch.OutOfMemoryError()) == "GPU"


# ------------------------------------------------------------------------------------- bad losses


def _tiny_distill(ws, **kw):
    """A tiny 2-layer hybrid (window 8), its tokenizer and a 20-step distill recipe, checkpoint every 5."""
    from linearize import recipe as R
    from test_distill import _hybrid, _tokenizer

    over = {"attention.window": 8, "distill.data": str(ws / "corpus.txt"), "distill.seq_len": 32,
            "distill.batch_size": 2, "distill.tokens": 32 * 2 * 20, "distill.warmup_steps": 1,
            "distill.eval_seqs": 2, "distill.checkpoint_every": 5}
    over.update({f"distill.{k}": v for k, v in kw.items()})
    return _hybrid(), _tokenizer(), R.load("lolcats", over)


def spike_layer_1(monkeypatch, factor):
    """Multiply layer 1's loss by ``factor`` in the 13th micro-batch (step 12); micro-batches are not split."""
    real, calls = D.layer_loss, {"n": 0}

    def spike(module, *args, **kwargs):
        loss = real(module, *args, **kwargs)
        if module.layer_idx != 1:
            return loss
        calls["n"] += 1
        return loss * factor if calls["n"] == 13 else loss

    monkeypatch.setattr(D, "layer_loss", spike)
    monkeypatch.setattr(L, "plan_pieces", lambda *args, **kwargs: 1)  # no measuring forwards before step 0


@pytest.mark.parametrize("factor,needle", [(1e6, "exploding loss in layer 1 at step 12"),
                                           (float("inf"), "non-finite loss in layer 1 at step 12")])
def test_bad_loss_stops_naming_layer_and_step(ws, tmp_path, monkeypatch, factor, needle):
    model, tok, rec = _tiny_distill(ws)
    spike_layer_1(monkeypatch, factor)
    with pytest.raises(TrainingError) as e:
        D.distill(model, tok, rec, state_dir=tmp_path, progress=False, log=lambda m: None)
    msg = str(e.value)
    assert msg.startswith(f"distill: {needle}") and "\n" not in msg
    assert "the last good checkpoint is kept" in msg and "--set distill.lr=" in msg
    assert torch.load(tmp_path / "distill-state.pt", weights_only=False)["step"] == 10  # the last periodic one


def test_exploding_loss_check_can_be_turned_off(ws, tmp_path, monkeypatch):
    """distill.max_loss_ratio = 0 (a recipe field, 100 in every shipped recipe) lets the spike of the test above pass."""
    from linearize import recipe as R

    assert {R.load(n)[s]["max_loss_ratio"] for n in R.available() for s in ("distill", "finetune")} == {100.0}
    with pytest.raises(RecipeError, match=r"finetune\.max_loss_ratio = -1\.0: must be a number >= 0"):
        R.load("lolcats", {"finetune.max_loss_ratio": -1})
    model, tok, rec = _tiny_distill(ws, max_loss_ratio=0)
    spike_layer_1(monkeypatch, 1e6)
    assert D.distill(model, tok, rec, progress=False, log=lambda m: None)["steps"] == 20


def test_loss_guard_ignores_noise_on_a_near_zero_layer_and_the_warmup():
    guard = guards.LossGuard("distill", {"lr": 0.01}, layers=[3, 7], max_ratio=100)
    quiet, busy = torch.tensor(1e-8), torch.tensor(1.0)
    guard.check([quiet * 1e6, busy], step=0)  # a spike during the warm-up: the running mean is not settled
    for step in range(1, 12):
        guard.check([quiet, busy], step)
    guard.check([quiet * 1000, busy], 12)  # 1000x its own mean, but 1e-5 is noise next to layer 7's 1.0
    with pytest.raises(TrainingError, match=r"^distill: exploding loss in layer 3 at step 13: 5 is "):
        guard.check([quiet * 5e8, busy], 13)
    with pytest.raises(TrainingError, match=r"^distill: non-finite loss in layer 7 at step 14; no checkpoint .*"
                                            r"--set distill.lr=0.0025$"):
        guard.check([quiet, busy * float("nan")], 14)


def test_exploding_loss_in_finetune_names_step(ws, tmp_path, monkeypatch):
    from linearize import recipe as R
    from test_distill import _tokenizer
    from test_finetune import _hybrid

    rec = R.load("lolcats", {"attention.window": 8, "finetune.data": str(ws / "corpus.txt"), "finetune.loss": "xent",
                             **{f"finetune.{k}": v for k, v in SMALL.items()}, "finetune.tokens": 32 * 2 * 16})
    model, calls = _hybrid(), {"n": 0}

    def blow_up(module, args, output):  # logits x 1e4 on the 13th training forward
        if module.training:
            calls["n"] += 1
            if calls["n"] == 13:
                return output * 1e4
        return output

    model.lm_head.register_forward_hook(blow_up)
    monkeypatch.setattr(L, "plan_pieces", lambda *args, **kwargs: 1)  # count training forwards only
    with pytest.raises(TrainingError, match=r"^finetune: exploding loss at step 12: .* its running mean"):
        FT.finetune(model, _tokenizer(), rec, state_dir=tmp_path, progress=False, log=lambda m: None)


# ------------------------------------------------------------------------------------ corrupt shards


@pytest.fixture()
def broken(hybrid, tmp_path):
    """A copy of the hybrid whose only shard the test damages."""
    path = tmp_path / "broken"
    shutil.copytree(hybrid, path)
    return path, path / "model-00001-of-00001.safetensors"


@pytest.mark.parametrize("command", ["info", "generate", "eval", "distill"])
def test_truncated_shard_fails_naming_the_file(broken, command, tmp_path):
    path, shard = broken
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    extra = {"info": [], "generate": ["Hi"], "eval": ["--task", "ppl", "--lengths", "64", "-o", tmp_path / "EV"],
             "distill": ["--tokens", "1K"]}[command]
    _one_line(_cli(command, path, *extra), 2, str(shard), "truncated or edited")
    assert not (tmp_path / "EV").exists()


def test_edited_shard_header_fails_naming_the_file(broken):
    path, shard = broken
    data = bytearray(shard.read_bytes())
    data[8:16] = b"{#######"  # same size, unreadable header
    shard.write_bytes(bytes(data))
    _one_line(_cli("generate", path, "Hi"), 2, str(shard), "sha256")


# ---------------------------------------------------------------------------------------- bad YAML


@pytest.mark.parametrize("text,needle", [
    ("name: x\nattention:\n  window: [1, 2\n", "line 4: invalid YAML"),
    ("- attention\n- distill\n", "line 1: expected a mapping of sections and fields at the top level, got list"),
    ("name: x\n\nattention:\n  feature_map: elu\n  window: -3\n", "line 5: attention.window = -3"),
    ("name: x\nattention: 12\n", "line 2: attention must be a mapping of fields, got 12"),
], ids=["syntax", "top-level-list", "field-range", "section-type"])
def test_bad_yaml_recipe_names_file_and_line(ws, tmp_path, text, needle):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    _one_line(_cli("convert", ws / "tiny", "--recipe", bad, "--no-train", "-o", tmp_path / "OUT"), 2,
              f"recipe {bad}", needle)
    assert [p.name for p in tmp_path.iterdir()] == ["bad.yaml"]


# ------------------------------------------------------------------------------------- bad inputs


@pytest.fixture(scope="module")
def odd_models(tmp_path_factory):
    """Config-only model directories: any attempt to load weights would fail differently."""
    import transformers

    root = tmp_path_factory.mktemp("odd")
    transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                            vocab_size=64).save_pretrained(root / "bert")
    transformers.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=64).save_pretrained(root / "mamba")
    (root / "alien").mkdir()
    (root / "alien" / "config.json").write_text('{"model_type": "no-such-arch", "num_hidden_layers": 2}')
    (root / "a-file").write_text("x")
    return root


def _read_only_dir(tmp_path: Path) -> Path:
    """A directory this process cannot create files in (permission bits do not stop root: use /proc)."""
    d = tmp_path / "ro"
    d.mkdir(parents=True)
    d.chmod(0o555)
    try:
        (d / "probe").touch()
    except OSError:
        return d
    (d / "probe").unlink()
    return Path("/proc")


BAD_INPUTS = [
    # (id, args after `linearize`, exit code, needles)
    ("window>=seq_len", ["convert", "{tiny}", "--set", "distill.seq_len=32"], 2,
     ["attention.train_window = 64 is not shorter than distill.seq_len = 32"]),
    ("window>=finetune.seq_len", ["convert", "{tiny}", "--set", "attention.window=16", "--set",
                                  "finetune.seq_len=16"], 2,
     ["attention.window = 16 is not shorter than finetune.seq_len = 16"]),
    ("tokens=0", ["convert", "{tiny}", "--tokens", "0"], 2, ["invalid token count '0'"]),
    ("distill-tokens<0", ["convert", "{tiny}", "--distill-tokens", "-5"], 2, ["invalid token count '-5'"]),
    ("recipe tokens=0", ["convert", "{tiny}", "--set", "distill.tokens=0"], 2,
     ["--set: distill.tokens = 0: must be a token budget > 0"]),
    ("tokens<one batch", ["convert", "{tiny}", "--set", "attention.window=8", "--tokens", "1K"], 2,
     ["distill: 500 tokens is smaller than one batch (batch_size 4 x seq_len 8192 = 32,768 tokens)"]),
    ("rerun tokens=0", ["distill", "{hybrid}", "--tokens", "0"], 2, ["invalid token count '0'"]),
    ("unknown feature map", ["convert", "{tiny}", "--set", "attention.feature_map=bogus", "--no-train"], 2,
     ["--set: attention.feature_map = 'bogus': must be one of", "hedgehog"]),
    ("missing data", ["convert", "{tiny}", "--set", "distill.data={tmp}/nope.txt"], 2, ["no such file"]),
    ("encoder-only", ["convert", "{odd}/bert", "--no-train"], 2, ["bert is an encoder-only model", "llama"]),
    ("no attention", ["convert", "{odd}/mamba", "--no-train"], 2,
     ["mamba is a model without softmax attention"]),
    ("unknown arch", ["convert", "{odd}/alien", "--no-train"], 2, ["cannot read its config.json"]),
    ("output under a file", ["convert", "{tiny}", "--ratio", "1:0", "--no-train", "-o", "{odd}/a-file/OUT"], 2,
     ["a-file is not a directory"]),
    ("output read-only", ["convert", "{tiny}", "--ratio", "1:0", "--no-train", "-o", "{ro}/OUT"], 2,
     ["is not writable"]),
    ("eval output under a file", ["eval", "{hybrid}", "--task", "ppl", "-o", "{odd}/a-file/EV"], 2,
     ["a-file is not a directory"]),
    ("bad device", ["convert", "{tiny}", "--no-train", "--device", "gpu0"], 2, ["--device 'gpu0'"]),
    ("missing GPU", ["generate", "{hybrid}", "Hi", "--device", "cuda:99"], 2, ["--device cuda:99"]),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_and_writes_nothing(ws, hybrid, odd_models, tmp_path, case):
    _, args, code, needles = case
    ro = _read_only_dir(tmp_path / "x") if "{ro}" in " ".join(args) else None
    work = tmp_path / "work"
    work.mkdir()
    subs = {"{tiny}": str(ws / "tiny"), "{hybrid}": str(hybrid), "{odd}": str(odd_models), "{tmp}": str(tmp_path),
            "{ro}": str(ro)}
    for k, v in subs.items():
        args = [a.replace(k, v) for a in args]
    if "-o" not in args and args[0] == "convert":
        args += ["-o", str(work / "OUT")]
    before = sorted(p.name for p in hybrid.parent.iterdir())
    _one_line(_cli(*args), code, *needles)
    assert list(work.iterdir()) == []  # nothing written
    assert sorted(p.name for p in hybrid.parent.iterdir()) == before
    assert not any(p.name.startswith(".linearize-probe-") for p in odd_models.iterdir())


def test_layer_without_standard_attention_is_named():
    from conftest import tiny_model
    from linearize import recipe as R
    from linearize.convert.selection import select_layout
    from linearize.convert.surgery import linearize_model

    model = tiny_model("llama", layers=2)
    model.model.layers[1].self_attn = torch.nn.Identity()
    with pytest.raises(UnsupportedModelError, match=r"llama: layer 1 has no standard attention \(self_attn.q_proj"):
        linearize_model(model, select_layout(2, ratio="1:0"), R.load("lolcats"))

"""Attention transfer on a tiny model: loss falls, resume reproduces an uninterrupted run, NaN stops."""

import pytest
import torch

from conftest import char_tokenizer, spy_micro_shapes, tiny_model
from linearize import recipe as R
from linearize.errors import TrainingError, TrainingInterrupted
from linearize.convert.selection import select_layout
from linearize.convert.surgery import linearize_model
from linearize.train import distill as D
from linearize.train import loop as L


def _tokenizer():
    return char_tokenizer()


def interrupt_after_save(monkeypatch, module, step: int):
    """Make ``module._save_state`` (the stage loop's, :mod:`linearize.train.loop`) raise KeyboardInterrupt once, right
    after saving ``step``; returns the real one."""
    real_save = module._save_state

    def save_then_die(path, state):
        real_save(path, state)
        if state["step"] == step and not getattr(save_then_die, "fired", False):
            save_then_die.fired = True
            raise KeyboardInterrupt

    monkeypatch.setattr(module, "_save_state", save_then_die)
    return real_save


@pytest.fixture()
def corpus(tmp_path):
    import random

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "north", "seven", "blue"]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(30, 80))) for _ in range(400)]
    p = tmp_path / "corpus.txt"
    p.write_text("\n\n".join(docs))
    return str(p)


def _hybrid(seed=0):
    model = tiny_model("llama", layers=2, seed=seed)
    model.resize_token_embeddings(64)
    rec = R.load("lolcats", {"attention.window": 8})
    return linearize_model(model, select_layout(2, ratio="1:0"), rec)


def _recipe(corpus, **kw):
    over = {"attention.window": 8, "distill.data": corpus, "distill.seq_len": 64, "distill.batch_size": 2,
            "distill.tokens": 64 * 2 * 8, "distill.lr": 3e-2, "distill.warmup_steps": 1, "distill.eval_seqs": 4}
    over.update({f"distill.{k}": v for k, v in kw.items()})
    return R.load("lolcats", over)


def _uninterrupted_and_resumed(rec, monkeypatch, tmp_path):
    """``(a, c, report)``: one hybrid distilled without a break, one interrupted after step 4 and resumed (a fresh
    process would rebuild the model from the same surgery), and the resumed run's report."""
    tok = _tokenizer()
    a = _hybrid()
    D.distill(a, tok, rec, state_dir=tmp_path / "a", progress=False, log=lambda m: None)
    real_save = interrupt_after_save(monkeypatch, L, step=4)
    with pytest.raises((KeyboardInterrupt, TrainingInterrupted)):
        D.distill(_hybrid(), tok, rec, state_dir=tmp_path / "b", progress=False, log=lambda m: None)
    monkeypatch.setattr(L, "_save_state", real_save)
    c = _hybrid()
    rep = D.distill(c, tok, rec, state_dir=tmp_path / "b", resume=True, progress=False, log=lambda m: None)
    return a, c, rep


def test_distill_lowers_heldout_mse(corpus, monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    hybrid = _hybrid()
    rec = _recipe(corpus, tokens=64 * 2 * 40)
    report = D.distill(hybrid, _tokenizer(), rec, progress=False, log=lambda m: None)
    assert report["steps"] == 40 and report["tokens"] == 64 * 2 * 40
    assert report["heldout_mse_end_mean"] < report["heldout_mse_start_mean"]
    assert all(not p.requires_grad for p in hybrid.parameters())
    assert {m.mode for m in hybrid.linear_modules()} == {"linear"}


def test_resume_matches_uninterrupted(corpus, monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    tok = _tokenizer()
    rec = _recipe(corpus, checkpoint_every=2)
    a, c, rep = _uninterrupted_and_resumed(rec, monkeypatch, tmp_path)
    assert rep["steps"] == 8
    for pa, pc in zip(a.state_dict().values(), c.state_dict().values()):
        assert torch.allclose(pa, pc, atol=1e-6)

    other = _recipe(corpus, checkpoint_every=2, seed=1)
    with pytest.raises(TrainingError, match="fingerprint"):
        D.distill(_hybrid(), tok, other, state_dir=tmp_path / "b", resume=True, progress=False, log=lambda m: None)


def test_non_finite_loss_names_layer_and_step(corpus, monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    hybrid = _hybrid()
    with torch.no_grad():
        hybrid.linear_modules()[1].feature_map_k.layer.weight.fill_(float("nan")) if hasattr(
            hybrid.linear_modules()[1].feature_map_k, "layer") else next(
            hybrid.linear_modules()[1].feature_map_k.parameters()).fill_(float("nan"))
    with pytest.raises(TrainingError, match=r"layer 1 at step 0"):
        D.distill(hybrid, _tokenizer(), _recipe(corpus), progress=False, log=lambda m: None)


def test_non_finite_gradient_stops_before_the_update(corpus, monkeypatch, tmp_path):
    """A finite loss whose gradient is not (step 2): the update is not applied, the run stops naming the step and
    the checkpoint of step 2 keeps finite parameters."""
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(L, "plan_pieces", lambda *args, **kwargs: 1)  # count training backwards only
    hybrid = _hybrid()
    backwards = {"n": 0}

    def poison(grad):  # layer 0's query map: one backward per micro-batch
        backwards["n"] += 1
        return grad * float("inf") if backwards["n"] == 3 else grad

    hybrid.linear_modules()[0].feature_map_q.weight.register_hook(poison)
    with pytest.raises(TrainingError, match=r"^distill: non-finite gradient at step 2; the last good checkpoint is "
                                            r"kept .*; try a lower distill\.lr$"):
        D.distill(hybrid, _tokenizer(), _recipe(corpus, checkpoint_every=2), state_dir=tmp_path, progress=False,
                  log=lambda m: None)
    state = torch.load(tmp_path / "distill-state.pt", weights_only=False)
    assert state["step"] == 2 and all(torch.isfinite(p).all() for p in state["params"])
    assert all(torch.isfinite(p).all() for p in hybrid.parameters())


@pytest.mark.parametrize("name", R.available())
def test_every_shipped_recipe_distills(name, corpus, monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    base = R.load(name)
    over = {"distill.data": corpus, "distill.seq_len": 64, "distill.batch_size": 2, "distill.tokens": 64 * 2 * 3,
            "distill.warmup_steps": 1, "distill.eval_seqs": 2}
    if base["attention"]["window"]:
        over["attention.window"] = 8
    rec = R.load(name, over)
    model = tiny_model("llama", layers=2)
    model.resize_token_embeddings(64)
    hybrid = linearize_model(model, select_layout(2, ratio="1:1"), rec)
    report = D.distill(hybrid, _tokenizer(), rec, progress=False, log=lambda m: None)
    learnable = any(p.numel() for m in hybrid.linear_modules() for p in m.learned_parameters())
    if learnable:
        assert report["steps"] == 3 and all(h["loss"] == h["loss"] for h in report["history"])
    else:
        assert report == {"skipped": "nothing to train"}


def test_hedgehog_xent_term(corpus, monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    model = tiny_model("llama", layers=2)
    model.resize_token_embeddings(64)
    hybrid = linearize_model(model, select_layout(2, ratio="1:0"), R.load("hedgehog"))
    D.trainable_parameters(hybrid)
    ids = torch.randint(0, 64, (2, 40))
    hybrid.set_attention_mode("distill")
    for m in hybrid.linear_modules():
        m.xent_rows = 16
    hybrid(ids, use_cache=False)
    mse_only = [D.layer_loss(m, 1.0, 0.0) for m in hybrid.linear_modules()]
    both = [D.layer_loss(m, 1.0, 1.0) for m in hybrid.linear_modules()]
    for m, a, b in zip(hybrid.linear_modules(), mse_only, both):
        assert m.distill_xent is not None and m.distill_xent.item() > 0
        assert torch.allclose(b - a, m.distill_xent)
        (b).backward(retain_graph=True)
    assert hybrid.linear_modules()[0].feature_map_q.weight.grad is not None


def test_ctrl_c_during_the_optimizer_step_saves_a_whole_step(corpus, monkeypatch, tmp_path):
    """Ctrl-C that lands right after the parameters were updated but before the step was counted: the step is
    completed first (linearize.train.guards.whole_step), so the saved state is consistent and resuming matches."""
    import os
    import signal

    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    # Python's own Ctrl-C handler, whatever this process inherited (a job started in the background of a
    # non-interactive shell starts with SIGINT ignored)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    tok = _tokenizer()
    rec = _recipe(corpus, checkpoint_every=100)
    a = _hybrid()
    D.distill(a, tok, rec, progress=False, log=lambda m: None)

    real_step = torch.optim.AdamW.step
    calls = {"n": 0}

    def step_then_ctrl_c(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 5:
            os.kill(os.getpid(), signal.SIGINT)  # delivered while the loop still has bookkeeping to do
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_ctrl_c)
    with pytest.raises(TrainingInterrupted, match="interrupted at step 5/8"):
        D.distill(_hybrid(), tok, rec, state_dir=tmp_path / "b", progress=False, log=lambda m: None)
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signal.signal(signal.SIGINT, inherited)
    c = _hybrid()
    rep = D.distill(c, tok, rec, state_dir=tmp_path / "b", resume=True, progress=False, log=lambda m: None)
    assert rep["steps"] == 8
    for pa, pc in zip(a.state_dict().values(), c.state_dict().values()):
        assert torch.allclose(pa, pc, atol=1e-6)


def test_windows_are_drawn_per_step_and_the_layers_keep_their_own(corpus, monkeypatch, tmp_path):
    """``distill.windows``: every step trains at the window its seed and index draw, the report lists them, and
    the layers end at the recipe's window."""
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    rec = _recipe(corpus, windows=[2, 4, 8])
    draws = [D.step_window(rec["distill"], s) for s in range(8)]
    assert len(set(draws)) > 1 and set(draws) <= {2, 4, 8}
    assert draws == [D.step_window(rec["distill"], s) for s in range(8)]  # the same again: seed and step alone
    assert D.step_window(_recipe(corpus)["distill"], 0) is None
    hybrid = _hybrid()
    seen = []
    for m in hybrid.linear_modules():
        m.register_forward_pre_hook(lambda mod, *a: seen.append(mod.window) if mod.training else None)
    report = D.distill(hybrid, _tokenizer(), rec, progress=False, log=lambda m: None)
    per_step = len(hybrid.linear_modules())  # one training forward per step here (batch 2, one piece)
    trained = seen[-8 * per_step:]  # the memory plan's measuring passes come first
    assert trained == [w for w in draws for _ in range(per_step)]
    assert report["windows"] == [2, 4, 8]
    assert {m.window for m in hybrid.linear_modules()} == {8}


def test_windows_resume_draws_the_same(corpus, monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    tok = _tokenizer()
    a, c, _ = _uninterrupted_and_resumed(_recipe(corpus, checkpoint_every=2, windows=[2, 8]), monkeypatch, tmp_path)
    for pa, pc in zip(a.state_dict().values(), c.state_dict().values()):
        assert torch.allclose(pa, pc, atol=1e-6)
    # without the draws the same run ends elsewhere: the windows are what the steps trained at
    d = _hybrid()
    D.distill(d, tok, _recipe(corpus, checkpoint_every=2), state_dir=tmp_path / "d", progress=False,
              log=lambda m: None)
    assert any(not torch.allclose(pa, pd, atol=1e-6) for pa, pd in zip(a.state_dict().values(),
                                                                       d.state_dict().values()))


@pytest.mark.parametrize("value", [[0], [1.5], ["a"], [True], "64"])
def test_windows_refuses_what_is_not_a_list_of_widths(value):
    with pytest.raises(R.RecipeError, match="distill.windows"):
        R.load("lolcats", {"distill.windows": value})


def test_windows_need_a_window_and_a_longer_sequence(corpus):
    with pytest.raises(R.RecipeError, match="no sliding window to vary"):
        R.load("lolcats", {"attention.window": 0, "distill.windows": [64]})
    with pytest.raises(R.RecipeError, match="distill.windows"):
        R.load("gdn", {"distill.windows": [64]})
    rec = _recipe(corpus, windows=[8, 64])
    with pytest.raises(R.RecipeError, match="distill.windows holds 64, not shorter than distill.seq_len = 64"):
        R.check_training(rec, {"distill": None})
    R.check_training(_recipe(corpus, windows=[8, 32]), {"distill": None})


def test_lengths_cut_each_steps_rows_to_the_drawn_length(corpus, monkeypatch, tmp_path):
    """``distill.lengths``: every step's rows are cut to the length its seed and index draw (the same tokens)."""
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    rec = _recipe(corpus, lengths=[16, 32, 64])
    draws = [L.step_length(rec["distill"], s) for s in range(8)]
    assert len(set(draws)) > 1 and draws == [L.step_length(rec["distill"], s) for s in range(8)]
    assert L.step_length(_recipe(corpus)["distill"], 0) is None
    shapes = spy_micro_shapes(monkeypatch, D.AttentionTransfer)
    report = D.distill(_hybrid(), _tokenizer(), rec, progress=False, log=lambda m: None)
    assert shapes[-8:] == [(2 * 64 // n, n) for n in draws]  # after the memory plan's measuring passes
    assert report["lengths"] == [16, 32, 64] and report["tokens"] == 8 * 2 * 64


def test_lengths_must_divide_the_row_and_pass_the_window(corpus):
    with pytest.raises(R.RecipeError, match="distill.lengths"):
        R.load("lolcats", {"distill.lengths": [8]})  # below 16
    with pytest.raises(R.RecipeError, match="distill.lengths holds 48, which does not divide distill.seq_len = 64"):
        R.check_training(_recipe(corpus, lengths=[48, 64]), {"distill": None})
    with pytest.raises(R.RecipeError, match="not longer than attention.window = 16"):
        R.check_training(R.load("lolcats", {"attention.window": 16, "distill.data": corpus, "distill.seq_len": 64,
                                            "distill.lengths": [16, 64]}), {"distill": None})
    R.check_training(_recipe(corpus, lengths=[16, 64]), {"distill": None})

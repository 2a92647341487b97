"""LoRA stage 2 on tiny hybrids: xent lowers perplexity, kl lowers KL to the softmax teacher, merging
touches only the targeted projections of linear layers, resume reproduces an uninterrupted run, NaN
stops naming the step, and the adapter-only output loads with peft."""

import re
import warnings

import pytest
import torch

from conftest import spy_micro_shapes, tiny_model
from linearize import recipe as R
from linearize.errors import TrainingError, TrainingInterrupted
from linearize.model.modeling import LinearizeForCausalLM
from linearize.convert.selection import select_layout
from linearize.convert.surgery import linearize_model
from linearize.train import finetune as FT
from linearize.train import loop as L
from test_distill import _tokenizer, corpus, interrupt_after_save  # noqa: F401 - the corpus fixture is used by name

QUIET = dict(progress=False, log=lambda m: None)


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    # Tiny models run fastest on one thread; with more, OpenMP barriers on a busy CI box cost ~100x.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _hybrid(layers=2, ratio="1:0", sharp=False, dtype=None):
    """A tiny llama hybrid; ``sharp`` scales q/k, v/o and the final norm so linear and softmax
    attention differ measurably (a random tiny model otherwise attends almost uniformly)."""
    model = tiny_model("llama", layers=layers, seed=0)
    model.resize_token_embeddings(64)
    if sharp:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(8)
                elif n.endswith(("v_proj.weight", "o_proj.weight")) or n == "model.norm.weight":
                    p.mul_(4)
    if dtype is not None:
        model.to(dtype)
    rec = R.load("lolcats", {"attention.window": 8})
    return linearize_model(model, select_layout(layers, ratio=ratio), rec)


def _recipe(corpus, steps=8, **kw):
    over = {"attention.window": 8, "finetune.data": corpus, "finetune.seq_len": 64, "finetune.batch_size": 2,
            "finetune.tokens": 64 * 2 * steps, "finetune.lr": 1e-2, "finetune.warmup_steps": 1,
            "finetune.eval_seqs": 4, "finetune.loss": "xent", "finetune.layers": "linear"}
    over.update({f"finetune.{k}": v for k, v in kw.items()})
    return R.load("lolcats", over)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _ids():
    return torch.randint(0, 60, (2, 40), generator=torch.Generator().manual_seed(0))


def _plain(model):
    """The returned model is a plain, frozen, eval-mode hybrid in linear mode without peft leftovers."""
    assert type(model) is LinearizeForCausalLM
    assert not hasattr(model, "peft_config")
    assert not any("lora" in n or "base_layer" in n for n, _ in model.named_parameters())
    assert all(not p.requires_grad for p in model.parameters())
    assert not model.training
    assert {m.mode for m in model.linear_modules()} == {"linear"}


def test_target_regex_matches_only_linear_layers():
    hybrid = _hybrid(layers=4, ratio="3:1")
    rx = FT.lora_target_regex(hybrid, ["q_proj", "o_proj"])
    hits = sorted(n for n, _ in hybrid.named_modules() if re.fullmatch(rx, n))
    assert hits == [f"model.layers.{i}.self_attn.{p}" for i in hybrid.config.linear_layers for p in ("o_proj", "q_proj")]


def test_layers_all_adapts_softmax_layers_too_and_the_teacher_stays_the_original(corpus):
    """finetune.layers=all: adapters (then merged) on every attention layer; the KL teacher runs adapters off."""
    hybrid = _hybrid(layers=4, ratio="3:1", sharp=True)
    full = [i for i, t in enumerate(hybrid.config.layer_types) if t == "full_attention"]
    assert full and set(FT.adapter_layers(hybrid, "all")) == set(range(4))
    rx = FT.lora_target_regex(hybrid, ["q_proj"], "all")
    assert sorted(n for n, _ in hybrid.named_modules() if re.fullmatch(rx, n)) == [
        f"model.layers.{i}.self_attn.q_proj" for i in range(4)]
    before = {k: v.clone() for k, v in hybrid.state_dict().items()}
    out, rep = FT.finetune(hybrid, _tokenizer(), _recipe(corpus, steps=4, lr=3e-3, loss="kl", targets=["q_proj"],
                                                          layers="all"), **QUIET)
    changed = {k for k in before if not torch.equal(before[k], out.state_dict()[k])}
    assert changed == {f"model.layers.{i}.self_attn.q_proj.weight" for i in range(4)}
    assert rep["lora"]["layers"] == list(range(4))
    # the KL reference was the original softmax model: its held-out perplexity is the same before and after
    assert rep["heldout_ppl_teacher"] > 0
    _plain(out)


def test_chunked_kl_equals_the_logits_kl_with_gradients():
    """KL from final hidden states in chunks (what stage 2 trains on) == KL of the full logits, loss and gradient."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    h_t, h_s = torch.randn(3, 7, 16), torch.randn(3, 7, 16, requires_grad=True)
    full = FT._kl(head(h_t), head(h_s))
    (g_full,) = torch.autograd.grad(full, h_s)
    for rows in (1, 4, 21, 100):
        chunked = FT.chunked_kl(head, h_t, h_s, chunk_rows=rows)
        (g_chunk,) = torch.autograd.grad(chunked, h_s)
        assert torch.allclose(chunked, full, rtol=1e-5, atol=1e-6), rows
        assert torch.allclose(g_chunk, g_full, rtol=1e-4, atol=1e-7), rows


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_evaluate_equals_the_full_logits_computation(monkeypatch):
    """The chunked held-out evaluation (ppl, teacher ppl, KL) == the same numbers from whole logits."""
    from peft import LoraConfig, get_peft_model

    hybrid = _hybrid(layers=2, ratio="1:0", sharp=True)
    peft_model = get_peft_model(hybrid, LoraConfig(r=2, lora_alpha=4, target_modules=FT.lora_target_regex(hybrid, ["q_proj"])))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)  # the adapters change the student: KL > 0
    ids = torch.randint(0, 64, (5, 20))
    monkeypatch.setattr(FT, "KL_CHUNK_VALUES", 64 * 7)  # 7 rows per chunk: several chunks per batch
    got = FT.evaluate(peft_model, hybrid, ids, batch_size=2)
    with torch.no_grad():
        s = peft_model(input_ids=ids, use_cache=False).logits
        with peft_model.disable_adapter():
            hybrid.set_attention_mode("softmax")
            t = peft_model(input_ids=ids, use_cache=False).logits
            hybrid.set_attention_mode("linear")
    ce = lambda x: torch.nn.functional.cross_entropy(x[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))  # noqa: E731
    assert got["ppl"] == pytest.approx(float(torch.exp(ce(s))), rel=1e-5)
    assert got["teacher_ppl"] == pytest.approx(float(torch.exp(ce(t))), rel=1e-5)
    assert got["kl"] == pytest.approx(float(FT._kl(t, s)), rel=1e-4) and got["kl"] > 0


def test_final_hidden_is_what_the_lm_head_reads():
    hybrid = _hybrid()
    ids = torch.randint(0, 64, (2, 24))
    with FT._final_hidden(hybrid) as box, torch.no_grad():
        logits = hybrid(input_ids=ids, use_cache=False).logits
    assert torch.allclose(hybrid.lm_head(box[-1]), logits, atol=1e-5)


def test_xent_lowers_heldout_perplexity(corpus):
    hybrid = _hybrid()
    out, rep = FT.finetune(hybrid, _tokenizer(), _recipe(corpus, steps=30), loss="xent", **QUIET)
    assert out is hybrid
    assert rep["steps"] == 30 and rep["tokens"] == 64 * 2 * 30 and rep["loss"] == "xent"
    assert rep["heldout_ppl_end"] < 0.9 * rep["heldout_ppl_start"]
    assert rep["merged"] and rep["adapter_dir"] is None and len(rep["history"]) == 30
    assert rep["tokens_per_second"] > 0
    _plain(out)


def test_kl_lowers_heldout_kl(corpus):
    hybrid = _hybrid(sharp=True)
    out, rep = FT.finetune(hybrid, _tokenizer(), _recipe(corpus, steps=30, lr=3e-3, loss="kl"), **QUIET)
    assert rep["loss"] == "kl"
    assert rep["heldout_kl_end"] < 0.95 * rep["heldout_kl_start"]
    assert rep["history"][-1]["loss"] < rep["history"][0]["loss"]
    _plain(out)


def test_merge_touches_only_targeted_projections_of_linear_layers(corpus):
    hybrid = _hybrid(layers=4, ratio="3:1")
    assert hybrid.config.layer_types.count("full_attention") == 1
    before = {k: v.clone() for k, v in hybrid.state_dict().items()}
    names = [n for n, _ in hybrid.named_parameters()]
    dtypes = {n: p.dtype for n, p in hybrid.named_parameters()}
    out, rep = FT.finetune(hybrid, _tokenizer(), _recipe(corpus, steps=4, targets=["q_proj", "v_proj"]),
                           progress=True, log=lambda m: None)
    after = out.state_dict()
    assert list(after) == list(before)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {f"model.layers.{i}.self_attn.{p}.weight" for i in hybrid.config.linear_layers
                       for p in ("q_proj", "v_proj")}
    assert [n for n, _ in out.named_parameters()] == names
    assert {n: p.dtype for n, p in out.named_parameters()} == dtypes
    assert rep["lora"]["layers"] == hybrid.config.linear_layers and rep["lora"]["targets"] == ["q_proj", "v_proj"]
    _plain(out)


def test_bf16_model_keeps_dtypes(corpus):
    hybrid = _hybrid(layers=4, ratio="3:1", dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in hybrid.named_parameters()}
    out, rep = FT.finetune(hybrid, _tokenizer(), _recipe(corpus, steps=2, eval_seqs=2), loss="kl", **QUIET)
    assert {n: p.dtype for n, p in out.named_parameters()} == dtypes
    assert torch.bfloat16 in set(dtypes.values())
    _plain(out)


def test_adapter_only_loads_with_peft_and_merged_equals_peft(corpus, tmp_path):
    from peft import PeftModel

    tok, rec, ids = _tokenizer(), _recipe(corpus, steps=8), _ids()
    fresh = _hybrid()
    # adapter only: the adapter is written, the model comes back without it
    a = _hybrid()
    adir = tmp_path / "adapter"
    out_a, rep_a = FT.finetune(a, tok, rec, adapter_only_dir=adir, **QUIET)
    assert not rep_a["merged"] and rep_a["adapter_dir"] == str(adir)
    assert (adir / "adapter_config.json").is_file() and (adir / "adapter_model.safetensors").is_file()
    assert not list(tmp_path.glob(".adapter*"))  # no temporary left behind
    _plain(out_a)
    for (k, v), w in zip(out_a.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(v, w), k
    # load it onto a fresh hybrid with peft
    with warnings.catch_warnings():  # peft probes a deprecated transformers property
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = PeftModel.from_pretrained(_hybrid(), str(adir)).eval()
    peft_logits = _logits(peft_model, ids)
    assert (peft_logits - _logits(fresh, ids)).abs().max() > 1e-4  # the adapter does something
    # the same run merged gives the peft model's logits
    merged, rep_m = FT.finetune(_hybrid(), tok, rec, **QUIET)
    assert rep_m["merged"]
    assert torch.allclose(_logits(merged, ids), peft_logits, atol=1e-5, rtol=0)
    assert rep_m["heldout_ppl_end"] == pytest.approx(rep_a["heldout_ppl_end"], rel=1e-6)


def test_resume_matches_uninterrupted(corpus, monkeypatch, tmp_path):
    tok = _tokenizer()
    rec = _recipe(corpus, steps=8, checkpoint_every=2, lora_dropout=0.1)  # dropout: the RNG must resume too
    a, rep_a = FT.finetune(_hybrid(), tok, rec, state_dir=tmp_path / "a", **QUIET)

    real_save = interrupt_after_save(monkeypatch, L, step=4)
    b = _hybrid()
    with pytest.raises((KeyboardInterrupt, TrainingInterrupted)):
        FT.finetune(b, tok, rec, state_dir=tmp_path / "b", **QUIET)
    _plain(b)  # an interrupted run leaves the model without adapter layers
    monkeypatch.setattr(L, "_save_state", real_save)
    logs = []
    c, rep_c = FT.finetune(_hybrid(), tok, rec, state_dir=tmp_path / "b", resume=True, progress=False,
                           log=logs.append)
    assert any("resumed at step 4/8" in m for m in logs)
    assert rep_c["steps"] == 8 and rep_c["tokens"] == rep_a["tokens"]
    assert [h["loss"] for h in rep_c["history"]] == pytest.approx([h["loss"] for h in rep_a["history"]], rel=1e-5)
    assert rep_c["heldout_ppl_start"] == rep_a["heldout_ppl_start"]
    for (k, pa), pc in zip(a.state_dict().items(), c.state_dict().values()):
        assert torch.allclose(pa, pc, atol=1e-6), k


def test_ctrl_c_mid_step_saves_and_resumes_exactly(corpus, tmp_path):
    """Ctrl-C inside a step (after some dropout draws) saves the last completed step, RNG included."""
    tok = _tokenizer()
    rec = _recipe(corpus, steps=16, checkpoint_every=100, grad_accum=2, lora_dropout=0.1)  # 8 optimizer steps
    a, _ = FT.finetune(_hybrid(), tok, rec, **QUIET)
    b = _hybrid()
    calls = {"n": 0}

    def ctrl_c(module, args, output):  # second micro-batch of step 5, after two forwards measuring memory
        if module.training:
            calls["n"] += 1
            if calls["n"] == 14:
                raise KeyboardInterrupt
        return output

    handle = b.lm_head.register_forward_hook(ctrl_c)
    with pytest.raises(TrainingInterrupted, match="interrupted at step 5/8") as e:
        FT.finetune(b, tok, rec, state_dir=tmp_path, **QUIET)
    assert e.value.exit_code == 130
    handle.remove()
    _plain(b)
    assert torch.load(tmp_path / "finetune-state.pt", weights_only=False)["step"] == 5
    c, rep = FT.finetune(_hybrid(), tok, rec, state_dir=tmp_path, resume=True, **QUIET)
    assert rep["steps"] == 8
    for (k, pa), pc in zip(a.state_dict().items(), c.state_dict().values()):
        assert torch.allclose(pa, pc, atol=1e-6), k


def test_fingerprint_mismatch_refuses(corpus, tmp_path):
    tok = _tokenizer()
    rec = _recipe(corpus, steps=2, checkpoint_every=1)
    FT.finetune(_hybrid(), tok, rec, state_dir=tmp_path, **QUIET)
    assert (tmp_path / "finetune-state.pt").is_file()
    for other, kw in [(_recipe(corpus, steps=2, checkpoint_every=1, seed=1), {}),
                      (_recipe(corpus, steps=2, checkpoint_every=1, lora_r=4), {}),
                      (rec, {"loss": "kl"}), (rec, {"tokens": 64 * 2 * 3})]:
        model = _hybrid()
        with pytest.raises(TrainingError, match="fingerprint") as e:
            FT.finetune(model, tok, other, state_dir=tmp_path, resume=True, **QUIET, **kw)
        assert "\n" not in str(e.value)
        assert not any("lora" in n for n, _ in model.named_parameters())  # refused before any change
    # checkpoint_every, activation checkpointing (memory knobs) and the loss guard's max_loss_ratio are not part
    # of the fingerprint
    _, rep = FT.finetune(_hybrid(), tok, _recipe(corpus, steps=2, checkpoint_every=5, activation_checkpointing=True,
                                                 max_loss_ratio=50), state_dir=tmp_path,
                         resume=True, **QUIET)
    assert rep["steps"] == 2 and rep["activation_checkpointing"] is True


def test_non_finite_loss_names_step_and_keeps_checkpoint(corpus, tmp_path):
    hybrid = _hybrid()
    calls = {"n": 0}

    def poison(module, args, output):  # training forwards only; step 3's goes NaN (after two measuring memory)
        if module.training:
            calls["n"] += 1
            if calls["n"] == 6:
                return output * float("nan")
        return output

    handle = hybrid.lm_head.register_forward_hook(poison)
    with pytest.raises(TrainingError, match=r"non-finite loss at step 3"):
        FT.finetune(hybrid, _tokenizer(), _recipe(corpus, steps=8, checkpoint_every=2), state_dir=tmp_path,
                    **QUIET)
    handle.remove()
    state = torch.load(tmp_path / "finetune-state.pt", weights_only=False)
    assert state["step"] == 2
    _plain(hybrid)


def test_budget_smaller_than_one_step(corpus):
    with pytest.raises(TrainingError, match="smaller than one optimizer step"):
        FT.finetune(_hybrid(), _tokenizer(), _recipe(corpus, steps=3, grad_accum=4), **QUIET)


def test_all_softmax_model_is_skipped(corpus):
    hybrid = _hybrid(ratio="0:1")
    assert not hybrid.config.linear_layers
    out, rep = FT.finetune(hybrid, _tokenizer(), _recipe(corpus), **QUIET)
    assert "skipped" in rep and out is hybrid


@pytest.mark.parametrize("loss", ["xent", "kl"])
def test_lengths_train_each_step_at_its_drawn_row_length(corpus, monkeypatch, loss):
    """``finetune.lengths``: both losses take the cut rows (the same tokens), and the run still learns."""
    from linearize.train import loop as L

    rec = _recipe(corpus, steps=12, lengths=[16, 64], loss=loss, lr=3e-3)
    shapes = spy_micro_shapes(monkeypatch, FT.LoRA)
    out, rep = FT.finetune(_hybrid(sharp=True), _tokenizer(), rec, loss=loss, **QUIET)
    draws = [L.step_length(rec["finetune"], s) for s in range(12)]
    assert len(set(draws)) == 2 and shapes[-12:] == [(2 * 64 // n, n) for n in draws]
    assert rep["lengths"] == [16, 64] and rep["tokens"] == 12 * 2 * 64
    key = "heldout_ppl" if loss == "xent" else "heldout_kl"
    assert rep[f"{key}_end"] < rep[f"{key}_start"]

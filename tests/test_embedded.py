"""The end-to-end path on the real embedded model (SmolLM2-135M) and the CLI's error handling."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import run_cli
from linearize import recipe as R
from linearize.convert.selection import select_layout
from linearize.convert.surgery import linearize_model

pytestmark = pytest.mark.slow  # the real embedded model end to end


@pytest.fixture(scope="module")
def converted(tmp_path_factory, embedded_dir):
    out = tmp_path_factory.mktemp("conv") / "OUT"
    res = run_cli("convert", "smollm2-135m", "--ratio", "3:1", "--no-train", "-o", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_convert_writes_design_layout(converted):
    names = {p.name for p in converted.iterdir()}
    for required in ("config.json", "model.safetensors.index.json", "model-00001-of-00001.safetensors",
                     "tokenizer.json", "generation_config.json", "linearize_recipe.yaml", "README.md",
                     "report.json", "report.md"):
        assert required in names, required
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["layer_types"].count("linear_attention") == 23
    assert cfg["layer_types"].count("full_attention") == 7
    # --no-train: the lolcats recipe's auto selection (it trains a probe) gives way to the ratio's pattern
    assert [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"] == [3, 7, 11, 15, 19, 23, 27]


def test_fresh_process_loads_and_generates(converted):
    code = (
        "import torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"p = {str(converted)!r}\n"
        "m = AutoModelForCausalLM.from_pretrained(p, trust_remote_code=True)\n"
        "t = AutoTokenizer.from_pretrained(p)\n"
        "x = t('The capital of France is', return_tensors='pt')\n"
        "out = m.generate(**x, max_new_tokens=5, do_sample=False)\n"
        "print('NEW', out.shape[1] - x.input_ids.shape[1])\n"
        "import linearize\n"
        "m2 = linearize.LinearizeForCausalLM.from_pretrained(p)\n"
        "print('TYPE', type(m2).__name__)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "NEW 5" in res.stdout and "TYPE LinearizeForCausalLM" in res.stdout


@pytest.fixture(scope="module")
def real_model(embedded_dir):
    from linearize.io.sources import load_model

    return load_model("smollm2-135m", dtype="float32", device="cpu")


def _prompt_ids(tokenizer, n):
    from linearize.data.specs import iter_texts

    text = " ".join(t for _, t in zip(range(20), iter_texts("wiki", "heldout")))
    return tokenizer(text, return_tensors="pt").input_ids[:, :n]


def test_all_softmax_reproduces_original_logits(real_model):
    model, tok = real_model
    ids = _prompt_ids(tok, 64)
    with torch.no_grad():
        ref = model(ids).logits
        hybrid = linearize_model(model, select_layout(30, ratio="0:1"), R.load("lolcats"))
        diff = (hybrid(ids).logits - ref).abs().max().item()
    assert diff <= 1e-5


# fp32 for the window hybrid; the untrained elu hybrid amplifies fp32 rounding through 23 layers
# (7.5e-4 measured, while the original softmax model itself differs by 4.3e-5 on this check; linear layers
# computed in float64 with an fp32 state still give 3.8e-4), so its exactness is checked in float64, where both
# paths agree to ~1e-13.
@pytest.mark.parametrize("recipe,dtype,tol", [("lolcats", "float32", 1e-4), ("elu", "float64", 1e-9)])
def test_prefill_100_then_20_steps_equals_full(embedded_dir, recipe, dtype, tol):
    from linearize.io.sources import load_model

    model, tok = load_model(str(embedded_dir), dtype=dtype, device="cpu")
    hybrid = linearize_model(model, select_layout(30, ratio="3:1"), R.load(recipe))
    ids = _prompt_ids(tok, 120)
    assert ids.shape[1] == 120
    with torch.no_grad():
        full = hybrid(ids, use_cache=False).logits
        out = hybrid(ids[:, :100], use_cache=True)
        cache, logits = out.cache if getattr(out, "cache", None) is not None else out.past_key_values, [out.logits]
        for t in range(100, 120):
            out = hybrid(ids[:, t : t + 1], cache=cache, use_cache=True)
            logits.append(out.logits)
    assert (torch.cat(logits, 1) - full).abs().max().item() <= tol


def test_left_padded_batch_generates_each_prompt(converted):
    """The checkpoint as users batch it: the tokenizer pads on the left, and each row generates the tokens (and
    logits) of its prompt alone, the short prompt's window ring holding padding for its first steps."""
    from transformers import AutoTokenizer

    from linearize import LinearizeForCausalLM

    model = LinearizeForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(converted, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    ids = _prompt_ids(tok, 150)[0]
    texts = [tok.decode(ids[:n]) for n in (6, 150, 45)]
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id, return_dict_in_generate=True,
              output_logits=True)
    with torch.no_grad():
        batch = tok(texts, return_tensors="pt", padding=True)
        assert (batch.attention_mask == 0).any()
        out = model.generate(**batch, **kw)
        width = batch.input_ids.shape[1]
        for i, text in enumerate(texts):
            alone = model.generate(**tok(text, return_tensors="pt"), **kw)
            n = alone.sequences.shape[1] - 8
            assert torch.equal(out.sequences[i, width:], alone.sequences[0, n:]), i
            diff = max((a[i] - b[0]).abs().max().item() for a, b in zip(out.logits, alone.logits))
            assert diff <= 3e-4, (i, diff)


BAD_INPUTS = [
    (["convert", "no-such-model", "--no-train"], "unknown model spec"),
    (["convert", "smollm2-135m", "--ratio", "3:0:1", "--no-train"], "--ratio"),
    (["convert", "smollm2-135m", "--ratio", "a:b", "--no-train"], "--ratio"),
    (["convert", "smollm2-135m", "--ratio", "0:0", "--no-train"], "--ratio"),
    (["convert", "smollm2-135m", "--softmax-layers", "3,30", "--no-train"], "out of range"),
    (["convert", "smollm2-135m", "--recipe", "nope", "--no-train"], "unknown recipe"),
    (["convert", "smollm2-135m", "--set", "attention.bogus=1", "--no-train"], "unknown field"),
    (["convert", "smollm2-135m", "--set", "attention.window=-4", "--no-train"], "attention.window"),
]


@pytest.mark.parametrize("args,needle", BAD_INPUTS, ids=[" ".join(a[1:3]) + " " + a[-2] for a, _ in BAD_INPUTS])
def test_bad_input_one_line_no_output(tmp_path, embedded_dir, args, needle):
    out = tmp_path / "OUT"
    res = run_cli(*args, "-o", str(out))
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_existing_output_needs_overwrite(tmp_path, embedded_dir):
    out = tmp_path / "OUT"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    res = run_cli("convert", "smollm2-135m", "--no-train", "-o", str(out))
    assert res.returncode != 0 and "--overwrite" in res.stderr and "Traceback" not in res.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_bad_token_budget(tmp_path, embedded_dir):
    res = run_cli("convert", "smollm2-135m", "--tokens", "0", "-o", str(tmp_path / "OUT"))
    assert res.returncode != 0 and "token count" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "OUT").exists()


def test_short_all_stages_end_to_end(tmp_path, embedded_dir):
    out = tmp_path / "OUT"
    small = []
    for stage in ("distill", "finetune"):
        small += ["--set", f"{stage}.seq_len=64", "--set", f"{stage}.batch_size=2", "--set", f"{stage}.eval_seqs=2"]
    # window 32: the recipe's 64 would cover the whole 64-token training sequence (refused)
    res = run_cli("convert", "smollm2-135m", "--ratio", "3:1", "--tokens", "512", *small, "--set", "attention.window=32",
                  "-o", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    # lolcats' select.method auto does not pay at 512 tokens (scoring alone would take ~1.6M): the ratio's layers
    assert "select: interleave (the recipe's auto selection would score the layers" in res.stdout
    # off a terminal each stage prints plain progress lines (a rich bar would print nothing until it ended)
    assert "distill  2/2 steps (100%)  loss " in res.stdout and "finetune  2/2 steps (100%)  kl " in res.stdout
    report = json.loads((out / "report.json").read_text())
    assert "select" not in report["stages"]
    d, f = report["stages"]["distill"], report["stages"]["finetune"]
    assert d["steps"] == 2 and d["tokens"] == 256 and len(d["per_layer"]) == 23
    assert f["steps"] == 2 and f["tokens"] == 256 and f["merged"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert not any("lora" in k for k in index["weight_map"])  # adapters merged: no peft needed to load
    card = (out / "README.md").read_text()  # the model card summarizes both stages: tokens, time, quality
    assert "| distill | 256 |" in card and "| finetune | 256 |" in card and "teacher" in card
    rc = report["stages"]["recall"]  # the built-in recall check: copy task, same samples for teacher and hybrid
    assert rc["task"] == "copy" and rc["length"] == 64 and rc["span"] == 31 and rc["samples"] == 12
    assert 0 <= rc["hybrid"] <= 1 and rc["teacher"] > rc["hybrid"] and "Recall check" in card
    assert rc["passkey"]["skipped"].startswith("length 64 is too short for this prompt")  # its passkey part
    res = run_cli("finetune", str(out), "--adapter-only", "--tokens", "256", "--loss", "kl", *small[6:])
    assert res.returncode == 0, res.stderr[-3000:]
    adapter = tmp_path / "OUT-adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert not (tmp_path / ".OUT.state").exists()
    res = run_cli("generate", str(out), "Hi", "--max-new-tokens", "3")
    assert res.returncode == 0, res.stderr[-2000:]
    res = run_cli("info", str(out))  # what the conversion reached, from its report
    assert res.returncode == 0 and "held-out perplexity" in res.stdout and "recall check (copy, 64 tokens" in res.stdout


def test_info_and_recipes_commands(converted):
    res = run_cli("info", str(converted))
    assert res.returncode == 0, res.stderr
    assert "23 linear, 7 softmax" in res.stdout and "128K" in res.stdout
    assert "decode bound" in res.stdout and "bounds: hybrid / original speed" in res.stdout
    from linearize.bench.info import model_info

    b = model_info(str(converted))["bounds"]
    # SmolLM2-135M (tied embeddings): the decode bound grows with context as the KV cache outweighs the weights
    assert 1.0 <= b["4K"]["decode"] < b["32K"]["decode"] < b["128K"]["decode"]
    assert 1.0 < b["4K"]["prefill"] < b["32K"]["prefill"] < b["128K"]["prefill"] < 30 / 7
    res = run_cli("recipes")
    assert res.returncode == 0 and "lolcats" in res.stdout
    res = run_cli("recipes", "elu")
    assert res.returncode == 0 and "feature_map: elu" in res.stdout


def test_info_retrieval_finds_the_retrieving_layers(converted):
    """`info --retrieval`: the original's attention onto a hidden pass key, per layer; SmolLM2-135M retrieves in
    layers 20-23 (README). A hybrid is refused with one line, as are --dtype/--device without --retrieval."""
    res = run_cli("info", "smollm2-135m", "--retrieval", "1K", "--dtype", "float32")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "retrieving layers (top 4 by mean): 20,21,22,23" in res.stdout
    res = run_cli("info", str(converted), "--retrieval", "1K")
    assert res.returncode == 2 and "converted hybrid" in res.stderr and "Traceback" not in res.stderr
    res = run_cli("info", "smollm2-135m", "--dtype", "float32")
    assert res.returncode == 2 and "only apply with --retrieval" in res.stderr


def test_generate_command_streams(converted):
    res = run_cli("generate", str(converted), "Name a colour.", "--max-new-tokens", "4")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip()


@pytest.mark.parametrize("args,needle", [
    (["convert", "--bogus"], "No such option: --bogus"),
    (["generate", "smollm2-135m", "hi", "--max-new-tokens", "-1"], "'--max-new-tokens'"),
    (["distill"], "Missing argument"),
])
def test_usage_errors_are_one_line(args, needle):
    res = run_cli(*args)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and needle in lines[0] and "--help" in lines[0], res.stderr


def test_console_script_answers_help_without_model_code():
    """``linearize --help`` (the console script) does not import transformers' model code, which ``import
    linearize`` does for library users (so ``from_pretrained`` knows the hybrid); the module path still does."""
    probe = ("import sys\n{imp}\nsys.argv = ['linearize', '--help']\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
             "print('model code' if 'linearize.model.modeling' in sys.modules else 'no model code', file=sys.stderr)")
    script = subprocess.run([sys.executable, "-c", probe.format(imp="from _linearize_cli import main")],
                            capture_output=True, text=True, timeout=120)
    assert script.returncode == 0 and "Usage: linearize" in script.stdout, script.stderr[-2000:]
    assert script.stderr.strip().endswith("no model code"), script.stderr[-2000:]
    module = subprocess.run([sys.executable, "-c", probe.format(imp="from linearize.cli import main")],
                            capture_output=True, text=True, timeout=120)
    assert module.stderr.strip().endswith("model code") and "no model code" not in module.stderr, module.stderr[-2000:]
    # an unknown spec in `info` is one line before torch or the model code loads
    unknown = subprocess.run([sys.executable, "-c", probe.replace("'--help'", "'info', 'no-such'").format(
        imp="from _linearize_cli import main") + "\nprint('torch' if 'torch' in sys.modules else 'no torch', "
        "file=sys.stderr)"], capture_output=True, text=True, timeout=120)
    lines = unknown.stderr.strip().splitlines()
    assert lines[-2:] == ["no model code", "no torch"], unknown.stderr[-2000:]
    assert len(lines) == 3 and lines[0].startswith("error: unknown model spec 'no-such'"), unknown.stderr[-2000:]

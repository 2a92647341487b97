"""Layer-wise onloading for models that do not fit (``--max-memory`` / ``--offload-dir``): accelerate's
``device_map="auto"`` keeps whole decoder layers in CPU memory or on disk and onloads each for its forward.
CPU only: the execution device is the CPU and the layers that do not fit the CPU budget stay on disk."""

from __future__ import annotations

import gc
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import FAMILIES, char_tokenizer, run_cli, tiny_model

#: the families whose checkpoints are offloaded here: the first thirteen, and of the later ones those whose
#: converted layers read something beyond the Llama layout (a config bound, per-head norm modules, a flag on the
#: original module, the base model's logit scale, routed experts); the rest differ in attention only, which
#: tests/test_hybrid_models.py covers
OFFLOADED = FAMILIES[:13] + ["olmo", "stablelm", "smollm3", "cohere", "glm4_moe"]
from linearize import recipe as R
from linearize.io.checkpoint import save_checkpoint
from linearize.errors import SpecError
from linearize.convert.selection import select_layout
from linearize.io.sources import input_device, load_model, parse_max_memory, placement
from linearize.convert.surgery import linearize_model

WINDOW = {"attention.window": 8}
#: one tiny decoder layer is ~150 KB in fp32: the embedding and a layer or two fit, the rest goes to disk
MIXED = {"cpu": "400KB"}
ALL_DISK = {"cpu": 0}
PROMPT = "the river runs north, the stone stays"


def _tokenizer():
    return char_tokenizer(lowercase=True)


def _base(family: str):
    model = tiny_model(family)
    model.resize_token_embeddings(len(_tokenizer()))  # every generated id decodes to text
    return model


def _hybrid_dir(root: Path, family: str) -> Path:
    hybrid = linearize_model(_base(family), select_layout(4, ratio="1:1"), R.load("lolcats", WINDOW))
    with torch.no_grad():  # non-trivial learned parts, so a weight that failed to onload would show
        for m in hybrid.linear_modules():
            for p in list(m.feature_map_q.parameters()) + [m.window_logit]:
                p.add_(0.1 * torch.randn_like(p))
    out = root / f"hybrid-{family}"
    save_checkpoint(hybrid, _tokenizer(), out, base="tiny", recipe=R.load("lolcats", WINDOW))
    return out


def _plain_dir(root: Path) -> Path:
    out = root / "llama"
    _base("llama").save_pretrained(out)
    _tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    return {"plain": _plain_dir(root), **{f: _hybrid_dir(root, f) for f in OFFLOADED}}


def _ids(tokenizer, model):
    return tokenizer(PROMPT, return_tensors="pt").input_ids.to(input_device(model))


def _check_same(spec: Path, max_memory: dict, offload: Path, expect: set[str]):
    ref, tok = load_model(str(spec), dtype="float32", device="cpu")
    off, _ = load_model(str(spec), dtype="float32", max_memory=max_memory, offload_dir=offload)
    dmap = off.hf_device_map
    assert set(dmap.values()) == expect, dmap
    n_disk = 4 if dmap == {"": "disk"} else sum(k.startswith("model.layers.") and d == "disk" for k, d in dmap.items())
    assert n_disk and f"{n_disk} on disk" in placement(off)
    # decoder layers are never split: no device-map entry below model.layers.N
    assert type(off.model.layers[0]).__name__ in off._no_split_modules
    assert all(re.fullmatch(r"(model\.layers\.\d+|model(\.[a-z_]+)?|lm_head|)", k) for k in dmap), dmap
    ids = _ids(tok, off)
    assert input_device(off) == torch.device("cpu")
    with torch.no_grad():
        a, b = ref(ids).logits, off(ids).logits
    assert b.device.type == "cpu" and (a - b).abs().max().item() <= 1e-5
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    assert torch.equal(ref.generate(ids, **kw), off.generate(ids, **kw))
    private = [p for p in offload.iterdir() if p.name.startswith("linearize-offload-")]
    assert len(private) == 1  # a private folder per load ...
    del off
    gc.collect()
    assert not private[0].exists()  # ... removed when the model is freed


@pytest.mark.parametrize("family", OFFLOADED)
def test_hybrid_offloaded_same_logits_and_tokens(ckpts, tmp_path, family):
    _check_same(ckpts[family], MIXED, tmp_path / "off", {"cpu", "disk"})


def test_hybrid_all_on_disk(ckpts, tmp_path):
    off, _ = load_model(str(ckpts["llama"]), dtype="float32", max_memory=ALL_DISK, offload_dir=tmp_path / "off")
    assert off.device.type == "meta" and input_device(off) == torch.device("cpu")  # model.device misleads here
    del off
    gc.collect()
    _check_same(ckpts["llama"], ALL_DISK, tmp_path / "off", {"disk"})


def test_plain_llama_offloaded_same_logits_and_tokens(ckpts, tmp_path):
    _check_same(ckpts["plain"], MIXED, tmp_path / "off", {"cpu", "disk"})


def test_default_offload_folder_is_under_the_cache_and_removed(ckpts, tmp_path, monkeypatch):
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    off, _ = load_model(str(ckpts["plain"]), dtype="float32", max_memory=MIXED)
    folders = list((tmp_path / "cache" / "offload").iterdir())
    assert len(folders) == 1 and folders[0].name.startswith("linearize-offload-")
    del off
    gc.collect()
    assert not folders[0].exists()
    fits, _ = load_model(str(ckpts["plain"]), dtype="float32", max_memory={"cpu": "1GB"})  # nothing goes to disk
    assert placement(fits) == "cpu" and not list((tmp_path / "cache" / "offload").iterdir())


def test_parse_max_memory(monkeypatch):
    assert parse_max_memory("cpu=200MB") == {"cpu": 200_000_000}
    assert parse_max_memory("CPU=1.5GB") == {"cpu": 1_500_000_000}
    assert parse_max_memory({"cpu": "40GiB"}) == {"cpu": 40 * 2**30}
    assert parse_max_memory("cpu=512mb") == {"cpu": 512_000_000} and parse_max_memory("cpu=2G") == {"cpu": 2 * 10**9}
    assert parse_max_memory({"cpu": 2048}) == {"cpu": 2048} and parse_max_memory("cpu=2KiB") == {"cpu": 2048}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    mm = parse_max_memory("cpu=100GiB,cuda:1=20GiB,0=40GiB")
    assert mm == {0: 40 * 2**30, 1: 20 * 2**30, "cpu": 100 * 2**30} and list(mm) == [0, 1, "cpu"]  # GPUs first
    with pytest.raises(SpecError, match="only 2 CUDA GPU"):
        parse_max_memory("cuda:2=1GB")
    with pytest.raises(SpecError, match="given twice"):
        parse_max_memory("0=1GB,cuda:0=2GB")


def test_load_model_option_errors(ckpts, tmp_path):
    spec = str(ckpts["plain"])
    with pytest.raises(SpecError, match="exclude each other"):
        load_model(spec, device="cpu", max_memory={"cpu": "1GB"})
    with pytest.raises(SpecError, match="needs --max-memory"):
        load_model(spec, offload_dir=tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(SpecError, match="not a directory"):
        load_model(spec, max_memory={"cpu": "1GB"}, offload_dir=tmp_path / "file")


@pytest.mark.slow
def test_cli_generate_same_text(ckpts, tmp_path):
    spec = str(ckpts["llama"])
    base = ["generate", spec, PROMPT, "--max-new-tokens", "5", "--dtype", "float32"]
    ref = run_cli(*base, "--device", "cpu")
    off = run_cli(*base, "--max-memory", "cpu=400KB", "--offload-dir", str(tmp_path / "off"))
    assert ref.returncode == 0 and off.returncode == 0, off.stderr[-2000:]
    assert ref.stdout.strip() and off.stdout == ref.stdout
    assert "Traceback" not in off.stderr and re.search(r"placement: cpu \+ offload \(disk\): decoder layers \d", off.stderr)
    assert not list((tmp_path / "off").iterdir())  # the private folder is gone at exit


def _generate_text(capsys, spec, *args) -> str:
    from linearize.cli import run_app

    code = run_app(["generate", spec, "the stone stays, the river runs north, the stone", "--max-new-tokens", "12",
                    "--dtype", "float32", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


@pytest.mark.slow
def test_cli_generate_sampling_and_prompt_lookup(ckpts, capsys):
    """On a hybrid: prompt-lookup drafts (taken back with HybridCache.crop when wrong) leave greedy text unchanged;
    sampling with a seed repeats itself."""
    spec = str(ckpts["llama"])
    greedy = _generate_text(capsys, spec)
    assert greedy.strip() and _generate_text(capsys, spec, "--prompt-lookup", "3") == greedy
    sampled = [_generate_text(capsys, spec, "--temperature", "1.5", "--top-p", "0.9", "--seed", "7") for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0].strip()
    others = {_generate_text(capsys, spec, "--temperature", "1.5", "--seed", str(seed)) for seed in range(4)}
    assert len(others) > 1  # the seed matters


@pytest.mark.parametrize("args,needle", [
    (["--top-p", "0"], "'--top-p'"),
    (["--top-p", "1.5"], "'--top-p'"),
    (["--temperature", "-1"], "'--temperature'"),
    (["--prompt-lookup", "-2"], "'--prompt-lookup'"),
    (["--max-memory", "gpu=4GB"], "unknown device 'gpu'"),
    (["--max-memory", "cpu=lots"], "bad size 'lots'"),
    (["--max-memory", "cpu"], "expected DEV=SIZE"),
    (["--max-memory", "cuda:99=1GB"], "CUDA GPU"),
    (["--max-memory", "disk=1TB"], "disk needs no budget"),
    (["--offload-dir", "somewhere"], "--offload-dir needs --max-memory"),
    (["--max-memory", "cpu=1GB", "--device", "cpu"], "exclude each other"),
])
def test_cli_bad_placement_is_one_line(ckpts, capsys, args, needle):
    from linearize.cli import run_app

    code = run_app(["generate", str(ckpts["plain"]), "hi", *args])  # in-process: the fresh process is checked below
    err = capsys.readouterr()
    lines = [ln for ln in err.err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], err.err
    assert not err.out.strip()


def test_cli_eval_bad_placement_is_one_line(ckpts, tmp_path):
    res = run_cli("eval", str(ckpts["llama"]), "--task", "ppl", "--against", str(ckpts["plain"]), "--max-memory",
                  "cpu=1.5XB", "-o", str(tmp_path / "ev"))
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "bad size '1.5XB'" in lines[0], res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "ev").exists()


@pytest.mark.slow
def test_eval_ppl_same_with_offload(ckpts, tmp_path):
    from linearize.evals.runner import EvalOptions, LoadOptions, ReportOptions, run_eval

    kw = dict(against=str(ckpts["plain"]), options=EvalOptions(lengths="64"))
    ref = run_eval(str(ckpts["llama"]), "ppl:512", ReportOptions(tmp_path / "ref", progress=False),
                   load=LoadOptions(device="cpu", dtype="float32"), **kw)
    off = run_eval(str(ckpts["llama"]), "ppl:512", ReportOptions(tmp_path / "off", progress=False),
                   load=LoadOptions(dtype="float32", max_memory="cpu=400KB", offload_dir=tmp_path / "offload"), **kw)
    for role in ("tasks", "against"):
        a = ref[role] if role == "tasks" else ref[role]["tasks"]
        b = off[role] if role == "tasks" else off[role]["tasks"]
        assert a["ppl"]["nll_by_length"]["64"] == pytest.approx(b["ppl"]["nll_by_length"]["64"], abs=1e-5)
    assert ref["config"]["device"] == "cpu" and off["config"]["device"].startswith("cpu + offload (disk): decoder layers")
    assert json.loads((tmp_path / "off" / "summary.json").read_text())["tasks"]["ppl"]["score"] == off["tasks"]["ppl"]["score"]


@pytest.mark.slow
def test_embedded_gguf_spec_offloaded(embedded_dir):
    """The embedded GGUF alias is de-quantized into a safetensors directory first, so it offloads like any checkpoint."""
    ref, tok = load_model("smollm2-135m", dtype="float32", device="cpu")
    off, _ = load_model("smollm2-135m", dtype="float32", max_memory={"cpu": "200MB"})
    assert {"cpu", "disk"} <= set(off.hf_device_map.values())
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert (ref(ids).logits - off(ids).logits).abs().max().item() <= 1e-4

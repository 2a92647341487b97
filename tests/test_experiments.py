"""The experiment scripts behind docs/ run: ``experiments/serve_window.py`` serves a hybrid's window layers (all, or
the ``--layers`` it names) at another width, optionally with attention sinks, and the perplexity moves only with the
layers it changed; ``experiments/window_floor.py`` windows every layer but the kept ones; ``prefill_chunks.py`` runs
on a tiny config."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import char_tokenizer, run_cli, tiny_workspace

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    root = tiny_workspace(tmp_path_factory.mktemp("serve"), char_tokenizer("abcdefghijklmnopqrstuvwxyz .,", True), 4)
    res = run_cli("convert", str(root / "tiny"), "--no-train", "--ratio", "1:1", "--set", "attention.window=8",
                  "-o", str(root / "H"))
    assert res.returncode == 0, res.stderr[-2000:]
    return root


def _serve(root, out, *extra):
    cmd = [sys.executable, str(ROOT / "experiments" / "serve_window.py"), str(root / "H"), *extra, "--", "--task",
           "ppl", "--lengths", "128", "--data", str(root / "corpus.txt"), "--dtype", "float32", "-o", str(root / out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    return res, json.loads((root / out / "summary.json").read_text())["tasks"]["ppl"]["score"]


@pytest.mark.slow
def test_serve_window_widens_the_named_layers(hybrid):
    layers = [i for i, t in enumerate(json.loads((hybrid / "H" / "config.json").read_text())["layer_types"])
              if t != "full_attention"]
    assert len(layers) == 2
    _, trained = _serve(hybrid, "E8", "--window", "8")
    res, wide = _serve(hybrid, "E64", "--window", "64")
    assert f"serving 2 window layers of {hybrid / 'H'} at 64 tokens: {layers[0]},{layers[1]}" in res.stderr
    res, one = _serve(hybrid, "E64one", "--window", "64", "--layers", str(layers[0]))
    assert f"serving 1 window layers of {hybrid / 'H'} at 64 tokens: {layers[0]}" in res.stderr
    # the untrained maps differ from softmax, so every widened layer moves the perplexity (128-token rows)
    assert len({round(trained, 6), round(wide, 6), round(one, 6)}) == 3
    res, none = _serve(hybrid, "E64none", "--window", "64", "--layers", "99")
    assert "serving" not in res.stderr and none == pytest.approx(trained)
    # sinks added at serving time: said, and they move the perplexity (the first tokens leave the linear sums)
    res, sunk = _serve(hybrid, "E8s4", "--window", "8", "--sinks", "4")
    assert f"serving 2 window layers of {hybrid / 'H'} at 8 tokens with 4 sinks: {layers[0]},{layers[1]}" in res.stderr
    assert round(sunk, 6) != round(trained, 6)


def test_prefill_chunks_runs_on_a_tiny_config(tmp_path):
    """``experiments/prefill_chunks.py`` builds one random hybrid from a config and prints a row per chunk size (on a
    CPU: that it runs, the rates untimed for any claim)."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 128,
                               "tie_word_embeddings": True}))
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "experiments" / "prefill_chunks.py"), "--model", str(cfg),
                        "--lengths", "96", "--batch", "2", "--chunks", "0,64", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300, cwd=root,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [ln.split(",") for ln in r.stdout.splitlines() if ln.startswith("96,")]
    assert [row[2] for row in rows] == ["0", "64"] and all(float(row[3]) > 0 and row[4] == "n/a" for row in rows)


def _window_floor():
    import importlib.util

    spec = importlib.util.spec_from_file_location("window_floor", ROOT / "experiments" / "window_floor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_window_floor_windows_only_the_layers_it_does_not_keep():
    """``experiments/window_floor.py``'s attention: a kept layer is the model's causal attention; a windowed one sees
    the last W tokens and the sinks (checked against the eager masked softmax), and changes the logits only past W."""
    import torch
    from transformers import AttentionInterface

    from conftest import tiny_model

    wf = _window_floor()
    mask = wf.band_mask(6, 3, 1, "cpu")
    assert mask.int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                   [1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 1, 0], [1, 0, 0, 1, 1, 1]]
    model = tiny_model("llama", layers=2)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        AttentionInterface.register(wf.NAME, wf.windowed_attention)
        model.set_attn_implementation(wf.NAME)
        wf.SETTING.update(window=16, sinks=0, keep=frozenset({0, 1}))
        assert torch.allclose(model(input_ids=ids).logits, ref, atol=1e-5)  # both kept: the original
        wf.SETTING.update(keep=frozenset({0}))
        cut = model(input_ids=ids).logits
        assert torch.allclose(cut[:, :16], ref[:, :16], atol=1e-5) and not torch.allclose(cut[:, 16:], ref[:, 16:])
        # layer 1 windowed by hand: its attention with the band as an eager mask, layer 0 untouched
        att = model.model.layers[1].self_attn
        q = torch.randn(1, 4, 40, 16)
        k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
        wf.SETTING.update(sinks=2)
        got, _ = wf.windowed_attention(att, q, k, v, None, scaling=0.25)  # [B, T, H, D]
        s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.25
        s = s.masked_fill(~wf.band_mask(40, 16, 2, "cpu"), float("-inf"))
        want = (s.softmax(-1) @ v.repeat_interleave(2, 1)).transpose(1, 2)
        assert torch.allclose(got, want, atol=1e-5)
    model.set_attn_implementation("sdpa")
    assert wf.parse_keep("all,none,3+1", 4) == [("all", frozenset(range(4))), ("none", frozenset()),
                                               ("3+1", frozenset({1, 3}))]

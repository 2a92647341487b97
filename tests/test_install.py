"""A fresh install, as a user meets it: the package imports from a clone's root beside transformers' own
dependencies, and a checkpoint loads the usual way with no prompt and no warning.

The repository's top level must not hold anything importable under another distribution's name: a folder
``kernels/`` with an ``__init__.py`` once shadowed the ``kernels`` package that transformers imports, and every
``python -c`` / ``python -m pytest`` started in the clone failed.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
#: the only names a clone's root may make importable
OWN_TOP_LEVEL = {"linearize", "_linearize_cli"}
PRE_MOVE = Path(__file__).parent / "data" / "checkpoint-before-kernels-move"


def _importable_top_level(root: Path) -> set[str]:
    """Names ``import NAME`` would find in ``root`` when it is on ``sys.path`` (packages and modules; a folder
    without ``__init__.py`` is only a namespace portion, which never shadows a regular package)."""
    names = set()
    for p in root.iterdir():
        if p.name.startswith("."):
            continue
        if p.is_dir() and (p / "__init__.py").is_file():
            names.add(p.name)
        elif p.is_file() and p.suffix == ".py":
            names.add(p.stem)
    return names


def test_no_top_level_folder_shadows_an_installed_distribution():
    importable = _importable_top_level(ROOT)
    assert importable <= OWN_TOP_LEVEL, f"importable from the repository root: {sorted(importable - OWN_TOP_LEVEL)}"
    installed = importlib.metadata.packages_distributions()
    ours = {n for n in importable if set(installed.get(n, [])) <= {"linearize"}}
    assert ours == importable, {n: installed[n] for n in importable - ours}
    assert not (ROOT / "kernels" / "__init__.py").exists()  # the kernel lab is not a package


def test_import_from_the_repository_root_beside_transformers():
    """``python -c`` in the clone puts its root first on ``sys.path``; transformers' own imports (the ``kernels``
    hub package among them, where installed) must still resolve to the installed distributions."""
    code = ("import transformers.modeling_utils, linearize, linearize.kernels as k, importlib.util as u\n"
            "s = u.find_spec('kernels')\n"
            "print('KERNELS', s.origin if s else None)\n"
            "print('OURS', k.__file__)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    kernels_line = next(line for line in res.stdout.splitlines() if line.startswith("KERNELS"))
    assert str(ROOT / "kernels") not in kernels_line  # the hub package (or none), never the kernel lab
    assert f"{ROOT / 'linearize' / 'kernels'}" in res.stdout


def test_pytest_collects_from_the_repository_root():
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/test_install.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


# --------------------------------------------------------------------------- loading a checkpoint the usual way

_LOAD = (
    "import sys, torch\n"
    "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
    "p = sys.argv[1]\n"
    "t = AutoTokenizer.from_pretrained(p)\n"
    "m = AutoModelForCausalLM.from_pretrained(p, trust_remote_code=True)\n"
    "with torch.no_grad():\n"
    "    logits = m(torch.tensor([t('abc de').input_ids])).logits\n"
    "print('LOADED', type(t).__name__, type(m).__name__, tuple(logits.shape))\n"
)
#: what transformers prints when it would ask, or warns about the config
_NOISE = ("Do you wish to run the custom code", "trust_remote_code", "You are using a model of type", "warn")


def _tiny_checkpoint(tmp_path: Path) -> Path:
    from conftest import char_tokenizer, tiny_model

    from linearize import recipe as R
    from linearize.io.checkpoint import save_checkpoint
    from linearize.convert.surgery import linearize_model

    rec = R.load("lolcats", {"attention.window": 4})
    model = tiny_model("llama", layers=2)
    hybrid = linearize_model(model, ["linear_attention", "full_attention"], rec)
    out = tmp_path / "ckpt"
    save_checkpoint(hybrid, char_tokenizer(), out, base="tiny", recipe=rec)
    return out


def _quiet_env(tmp_path: Path) -> dict[str, str]:
    # a private module cache, so that transformers copies the checkpoint's code as on a new machine
    return {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}


def _run_with_terminal(args: list[str], env: dict[str, str], timeout: float = 300) -> tuple[int, str]:
    """Run ``args`` with a pseudo-terminal as standard input and output (as in an interactive shell); return its
    exit status and everything it printed. A prompt would wait for an answer: the child is killed at
    ``timeout`` and the output so far returned."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(args, stdin=follower, stdout=follower, stderr=follower, env=env, close_fds=True)
    os.close(follower)
    out, deadline = b"", time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                chunk = b""
            if not chunk and proc.poll() is not None:
                break
            out += chunk
        elif proc.poll() is not None:
            break
        if time.monotonic() > deadline:
            proc.kill()
            break
    os.close(leader)
    return proc.wait(), out.decode(errors="replace")


def test_tokenizer_and_model_load_without_prompt_or_warning(tmp_path):
    """``AutoTokenizer.from_pretrained(OUT)`` (no trust_remote_code, as every tokenizer is loaded) and
    ``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)``, in a fresh process with standard input
    closed and again on a terminal: nothing asked, nothing warned."""
    out = _tiny_checkpoint(tmp_path)
    env = _quiet_env(tmp_path)
    res = subprocess.run([sys.executable, "-c", _LOAD, str(out)], stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=300, env=env)
    printed = res.stdout + res.stderr
    assert res.returncode == 0, printed[-3000:]
    assert "LOADED" in res.stdout and "LinearizeForCausalLM" in res.stdout
    assert not [n for n in _NOISE if n.lower() in printed.lower()], printed[-3000:]
    code, printed = _run_with_terminal([sys.executable, "-c", _LOAD, str(out)], env, timeout=120)
    assert code == 0 and "LOADED" in printed, printed[-3000:]
    assert not [n for n in _NOISE if n.lower() in printed.lower()], printed[-3000:]


def test_config_names_the_base_family_and_the_hybrid(tmp_path):
    """On disk ``model_type`` is the base family's (what lets the tokenizer load as the original's);
    ``architectures`` and ``auto_map`` name the hybrid; the package reads it back as the hybrid's config."""
    from linearize.model.modeling import LinearizeConfig
    from linearize.io.outputs import is_hybrid_dir
    from linearize.io.sources import read_config

    out = _tiny_checkpoint(tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == cfg["base_model_type"] == "llama"
    assert cfg["architectures"] == ["LinearizeForCausalLM"]
    assert set(cfg["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}
    assert is_hybrid_dir(out)
    back = read_config(out)
    assert isinstance(back, LinearizeConfig) and back.model_type == "linearize" and back.base_model_type == "llama"
    assert back.layer_types == ["linear_attention", "full_attention"]


def test_checkpoint_written_before_the_kernels_moved_still_loads(tmp_path):
    """A checkpoint written by the layout with a top-level kernels package (``model_type: linearize``, its own
    copy of the code) loads with trust_remote_code=True without the package, and with the package's loader,
    giving the logits it was written with."""
    ckpt = tmp_path / "old"
    shutil.copytree(PRE_MOVE, ckpt)
    expected = json.loads((ckpt / "expected.json").read_text())
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "linearize"
    code = (
        "import sys, json, torch\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'linearize':\n"
        "            raise ImportError('linearize is not installed here')\n"
        "sys.meta_path.insert(0, _Block())\n"
        "from transformers import AutoModelForCausalLM\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "e = json.load(open(sys.argv[1] + '/expected.json'))\n"
        "with torch.no_grad():\n"
        "    got = m(torch.tensor(e['ids'])).logits[0, -3:]\n"
        "print('DIFF', (got - torch.tensor(e['last_logits'])).abs().max().item())\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(ckpt)], capture_output=True, text=True, timeout=300,
                         env=_quiet_env(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    assert float(res.stdout.split("DIFF")[1]) <= 1e-5

    from linearize.io.sources import load_model

    model, _ = load_model(str(ckpt), dtype="float32", device="cpu")
    assert "fused_feature_maps" not in json.loads((ckpt / "config.json").read_text())  # written before the field
    assert {(m.fused_feature_maps, m.rotary_backend) for m in model.linear_modules()} == {("maps", None)}
    with torch.no_grad():
        got = model(torch.tensor(expected["ids"])).logits[0, -3:]
    assert (got - torch.tensor(expected["last_logits"])).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_every_family_tokenizer_loads_quietly(tmp_path):
    """Under the base family's model_type, transformers builds that family's config for the tokenizer: for every
    supported family the hybrid's extra fields (layer_types with linear layers among them) must not upset it."""
    from conftest import _TINY_FAMILIES, char_tokenizer, tiny_model

    from linearize import recipe as R
    from linearize.io.checkpoint import save_checkpoint
    from linearize.convert.surgery import linearize_model

    rec = R.load("elu")
    dirs = []
    for family in _TINY_FAMILIES:
        hybrid = linearize_model(tiny_model(family, layers=2), ["linear_attention", "full_attention"], rec)
        save_checkpoint(hybrid, char_tokenizer(), tmp_path / family, base="tiny", recipe=rec)
        dirs.append(str(tmp_path / family))
    code = ("import sys\nfrom transformers import AutoConfig, AutoTokenizer\n"
            "for p in sys.argv[1:]:\n"
            "    t = AutoTokenizer.from_pretrained(p)\n"
            "    c = AutoConfig.from_pretrained(p)\n"
            "    print('OK', p.rsplit('/', 1)[1], type(t).__name__, c.model_type)\n")
    res = subprocess.run([sys.executable, "-c", code, *dirs], stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=600, env=_quiet_env(tmp_path))
    printed = res.stdout + res.stderr
    assert res.returncode == 0, printed[-3000:]
    assert res.stdout.count("OK ") == len(dirs), printed[-3000:]
    assert not [n for n in _NOISE if n.lower() in printed.lower()], printed[-3000:]

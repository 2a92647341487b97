"""Write and verify hybrid checkpoint directories.

A checkpoint is written into a temporary sibling directory and renamed into place only when
complete, so an interrupted run never leaves a directory that looks finished. Layout:
``config.json`` (+ ``auto_map``), ``model-0000k-of-0000N.safetensors`` + ``model.safetensors.index.json``
(with per-shard sizes and sha256), tokenizer files, ``generation_config.json``,
``configuration_linearize.py``/``modeling_linearize.py`` and the ``linearize_*.py`` they import (the bundled
modeling code, :mod:`linearize.bundle`: ``trust_remote_code=True`` without the package),
``linearize_recipe.yaml``, ``README.md`` (model card) and stage reports.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

from ..atomic import atomic_write
from ..bundle import remote_code_files
from ..convert.selection import describe_layout, scores_markdown
from ..errors import OutputError
from ..recipe import resolved_yaml
from ..version import __version__
from .aliases import ALIASES
from .outputs import check_output, current_scope, normalize_modes, write_marker

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3


def check_output_dir(out: Path, overwrite: bool, *, command: str | None = None) -> None:
    """Refuse an existing output unless ``overwrite``, a model checkpoint (or a folder inside one) and, on the
    command line, a folder another command wrote (:func:`linearize.io.outputs.check_output`); check the parent is
    writable. Writes nothing."""
    check_output(out, overwrite=overwrite, command=command)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def recover_output(out: Path) -> None:
    """Clean up after a run that was killed while writing ``out`` (only leftovers of dead processes).

    ``.NAME.tmp-PID`` (a half-written checkpoint) is removed. ``.NAME.old-PID`` is the previous
    complete ``out``, moved aside just before the new one was renamed into place: it is put back when
    the kill came between the two renames (``out`` missing), removed otherwise."""
    out = Path(out)
    if not out.parent.is_dir():
        return
    for p in sorted(out.parent.glob(f".{glob.escape(out.name)}.*-*")):
        kind, _, pid = p.name[len(out.name) + 2:].rpartition("-")
        if kind not in ("tmp", "old") or not pid.isdigit() or _pid_alive(int(pid)):
            continue
        if kind == "old" and not out.exists():
            os.replace(p, out)
        else:
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(out: Path, overwrite: bool = False, *, marker: str | None = None) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``out`` only if the block completes
    (:func:`linearize.atomic.atomic_write`), after the leftovers of a killed run are cleaned up
    (:func:`recover_output`) and ``out`` is checked (:func:`check_output_dir`). With ``marker`` (a command name), the
    finished directory carries the marker naming it (:data:`linearize.io.outputs.MARKER`); its files get the usual
    modes (0644 / 0755 under umask 022) whatever their writer used."""
    out = Path(out)
    recover_output(out)
    check_output_dir(out, overwrite)
    with atomic_write(out, directory=True) as tmp:
        yield tmp
        if marker is not None:
            write_marker(tmp, marker)
        normalize_modes(tmp)


def _state_dict_for_save(model, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    sd = dict(state_dict) if state_dict is not None else model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    seen: dict[int, str] = {}
    out = {}
    for k, v in sd.items():
        ptr = (v.data_ptr(), v.numel())
        if v.numel() and hash(ptr) in seen:
            continue
        if v.numel():
            seen[hash(ptr)] = k
        out[k] = v.detach().to("cpu").contiguous()
    return out


def write_shards(model, directory: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Write sharded safetensors and an index carrying total size and per-shard size + sha256; ``state_dict``
    (e.g. the full weights gathered from an FSDP-sharded model) replaces ``model.state_dict()``."""
    sd = _state_dict_for_save(model, state_dict)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in sd.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    total = len(shards)
    weight_map: dict[str, str] = {}
    files: dict[str, dict[str, Any]] = {}
    total_size = 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{total:05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        files[name] = {"size": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
        for k in shard:
            weight_map[k] = name
        total_size += sum(v.numel() * v.element_size() for v in shard.values())
    index = {"metadata": {"total_size": total_size, "shards": files}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return index


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def verify_checkpoint(directory: Path, hashes: bool = False) -> None:
    """Fail with one line naming the file if a shard is missing, truncated or (optionally) altered."""
    directory = Path(directory)
    index_path = directory / INDEX_NAME
    if not index_path.is_file():
        raise OutputError(f"{directory}: missing {INDEX_NAME} (not a complete linearize checkpoint)")
    try:
        index = json.loads(index_path.read_text())
        shards = index.get("metadata", {}).get("shards") or {n: {} for n in set(index["weight_map"].values())}
        shards = {str(n): dict(meta) for n, meta in shards.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise OutputError(f"{index_path}: not a valid shard index (edited or corrupt)") from None
    for name, meta in sorted(shards.items()):
        p = directory / name
        if not p.is_file():
            raise OutputError(f"{p}: shard missing")
        size = meta.get("size")
        if size is not None and p.stat().st_size != size:
            raise OutputError(f"{p}: size {p.stat().st_size} != {size} in the index (truncated or edited)")
        if hashes and meta.get("sha256") and sha256_file(p) != meta["sha256"]:
            raise OutputError(f"{p}: sha256 does not match the index (edited or corrupt)")


def stage_summary(reports: dict[str, Any]) -> list[str]:
    """A markdown table of the training stages: tokens, time, throughput and what each stage reached."""
    rows = []
    for stage, rep in reports.items():
        if stage not in ("distill", "finetune") or "tokens" not in rep:
            continue
        if stage == "distill" and "heldout_mse_end_mean" in rep:
            result = (f"held-out attention MSE {rep['heldout_mse_start_mean']:.4g} → {rep['heldout_mse_end_mean']:.4g} "
                      f"({rep['heldout_mse_reduction_mean']:.1f}× per layer)")
        elif stage == "finetune" and "heldout_ppl_end" in rep:
            ratio = rep["heldout_ppl_end"] / rep["heldout_ppl_teacher"]
            result = (f"held-out ppl {rep['heldout_ppl_start']:.2f} → {rep['heldout_ppl_end']:.2f}, teacher "
                      f"{rep['heldout_ppl_teacher']:.2f} ({ratio:.3f}×); loss {rep.get('loss')}")
        else:
            result = ""
        rows.append(f"| {stage} | {rep['tokens']:,} | {rep.get('train_seconds', '')} s | "
                    f"{rep.get('tokens_per_second', 0):,.0f} | {result} |")
    if not rows:
        return []
    return ["| stage | tokens | training time | tokens/s | result |", "|---|---:|---:|---:|---|", *rows, "",
            "Every field of each stage's report:", ""]


def base_model_id(base: str, source: str | Path | None = None) -> str:
    """The original's Hugging Face id for a model card's ``base_model``: an alias's hub id (``smollm2-135m`` ->
    ``HuggingFaceTB/SmolLM2-135M-Instruct``), the id a hybrid ``source`` folder recorded, the id of a hub-cache
    snapshot ``source`` (``.../models--ORG--NAME/snapshots/...``), else ``base`` as given."""
    if base in ALIASES:
        return ALIASES[base]
    if source:
        src = Path(str(source))
        try:
            recorded = json.loads((src / "report.json").read_text()).get("base_model_id")
        except (OSError, ValueError, AttributeError):
            recorded = None
        if isinstance(recorded, str) and recorded:
            return recorded
        for part in src.parts:
            if part.startswith("models--") and part.count("--") >= 2:
                return part[len("models--"):].replace("--", "/", 1)
    return base


def model_card(model, *, base: str, recipe_name: str, reports: dict[str, Any], base_id: str | None = None) -> str:
    """The checkpoint's README.md: metadata front matter, layer map, how to load, scores. ``base_id``: the
    original's hub id for ``base_model`` (default: :func:`base_model_id` of ``base``)."""
    cfg = model.config
    base_id = base_id or base_model_id(base)
    named = f"`{base_id}`" + (f" (alias `{base}`)" if base_id != base else "")
    lines = [
        "---",
        "library_name: transformers",
        f"base_model: {base_id}",
        "tags: [linearize, linear-attention, hybrid-attention]",
        "---",
        "",
        f"# {base_id} → linear-attention hybrid",
        "",
        f"Converted with [linearize](https://pypi.org/project/linearize/) {__version__} using recipe `{recipe_name}`.",
        "",
        f"- base model: {named} ({cfg.base_model_type}, {cfg.num_hidden_layers} layers)",
        f"- layer map (L = linear, S = softmax): `{describe_layout(cfg.layer_types)}`",
        f"- linear attention: `{json.dumps(cfg.linear_attention, sort_keys=True)}`",
        "",
        "## Load",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("PATH", trust_remote_code=True)',
        'tokenizer = AutoTokenizer.from_pretrained("PATH")',
        "```",
        "",
        "The directory carries its modeling code (`modeling_linearize.py`, `linearize_*.py`), so it loads without "
        "the `linearize` package; with it, `linearize.LinearizeForCausalLM.from_pretrained(\"PATH\")` loads "
        "the same model from the package's code. `config.json` names the base family as its `model_type` (the "
        "tokenizer loads as the original's, with no custom code) and the hybrid as its architecture: without "
        "`trust_remote_code=True` transformers would build the plain base architecture and report the linear "
        "layers' weights as unexpected.",
        "",
        "## Stages",
        "",
    ]
    if not reports:
        lines.append("Surgery only: the linear layers are untrained (run `linearize distill`).")
    rc = reports.get("recall") or {}
    if "hybrid" in rc:  # the conversion's built-in recall check (linearize.convert.pipeline.RecallCheck)
        lines += [f"Recall check (`linearize eval --task copy`: a held-out {rc['span']}-token span repeated at the end "
                  f"of {rc['length']}-token sequences, {rc['samples']} samples): teacher {100 * rc['teacher']:.1f}% → "
                  f"hybrid **{100 * rc['hybrid']:.1f}%** of the copied tokens predicted exactly.", ""]
        pk = rc.get("passkey") or {}
        if "hybrid" in pk:
            lines += [f"Passkey check (`linearize eval --task passkey`, {pk['prompts']} prompts of {pk['length']} "
                      f"tokens, the key read off the argmax): teacher {100 * pk['teacher']:.0f}% → hybrid "
                      f"**{100 * pk['hybrid']:.0f}%**"
                      + (f" (the hybrid found {pk['better']} keys the teacher missed and missed {pk['worse']} it "
                         f"found; sign test p = {pk['p']:.2g})" if "p" in pk else "") + ".", ""]
    lines += stage_summary(reports)
    for stage, rep in reports.items():
        lines.append(f"- **{stage}**: " + ", ".join(f"{k}={v}" for k, v in rep.items() if not isinstance(v, (dict, list))))
    if "select" in reports:  # --select auto: the per-layer scores behind the layout

        lines += ["", *scores_markdown(reports["select"])]
    return "\n".join(lines) + "\n"


def save_checkpoint(model, tokenizer, out: Path, *, base: str, recipe, overwrite: bool = False,
                    reports: dict[str, dict] | None = None, resolved: dict[str, Any] | None = None,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, state_dict: dict[str, torch.Tensor] | None = None,
                    command: str | None = None) -> Path:
    """Write the complete checkpoint directory atomically; return its path. ``state_dict`` replaces the
    model's own (``--fsdp``: the full weights gathered on rank 0 by :func:`linearize.train.fsdp.full_state_dict`).
    ``command``: what the output marker names (default: the running command line command, else convert)."""
    out = Path(out)
    reports = reports or {}
    t0 = time.time()
    scope = current_scope()
    command = command or (scope.command if scope is not None else "convert")
    base_id = base_model_id(base, getattr(tokenizer, "name_or_path", None))  # the source folder it was loaded from
    with atomic_dir(out, overwrite, marker=command) as tmp:
        cfg = model.config
        cfg.architectures = ["LinearizeForCausalLM"]
        cfg.auto_map = {"AutoConfig": "configuration_linearize.LinearizeConfig",
                        "AutoModelForCausalLM": "modeling_linearize.LinearizeForCausalLM"}
        cfg.save_pretrained(tmp)
        write_shards(model, tmp, max_shard_bytes, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        for name, text in remote_code_files().items():  # trust_remote_code=True without the package
            (tmp / name).write_text(text)
        (tmp / "linearize_recipe.yaml").write_text(resolved_yaml(recipe, {"base_model": base, **(resolved or {})}))
        (tmp / "README.md").write_text(model_card(model, base=base, recipe_name=recipe.name, reports=reports,
                                                  base_id=base_id))
        for stage, rep in reports.items():
            (tmp / f"report_{stage}.json").write_text(json.dumps(rep, indent=2, default=str) + "\n")
        summary = {"base_model": base, "base_model_id": base_id, "recipe": recipe.name, "layer_types": cfg.layer_types,
                   "stages": reports, "save_seconds": round(time.time() - t0, 2)}
        (tmp / "report.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        (tmp / "report.md").write_text(_report_md(summary))
    return out


def _report_md(summary: dict[str, Any]) -> str:
    lines = [f"# Conversion report: {summary['base_model']}", "",
             f"- recipe: `{summary['recipe']}`",
             f"- layers: `{describe_layout(summary['layer_types'])}`", ""]
    if not summary["stages"]:
        lines.append("Surgery only (no training stage ran).")
    for stage, rep in summary["stages"].items():
        lines += [f"## {stage}", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in rep.items() if not isinstance(v, (dict, list))]
        lines.append("")
        if stage == "select":  # --select auto: the per-layer scores

            lines += scores_markdown(rep)
    return "\n".join(lines) + "\n"

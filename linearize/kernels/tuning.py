"""Per-GPU launch configurations: measured by ``linearize bench kernels --tune``, saved, reloaded.

The shipped defaults in ``triton_linear.CONFIG`` / ``triton_window.CONFIG`` / ``triton_step.CONFIG`` were picked
on an H200. A sweep on
another GPU (:func:`linearize.bench.tune_kernels`) ends with :func:`save`, which writes
``$LINEARIZE_CACHE/kernels/<gpu>.json`` (GPU name, Triton version, the three configurations). The first Triton
launch on a CUDA device calls :func:`ensure_applied`, which loads that file when it was written for the same
GPU name and Triton version and holds only known keys, and updates the configurations in place; otherwise the
defaults stay. ``LINEARIZE_KERNEL_TUNING=0`` ignores saved files (e.g. to benchmark the shipped defaults).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from ..atomic import atomic_write

__all__ = ["tuned_path", "save", "load", "ensure_applied", "applied_from"]

_STATE: dict = {"checked": False, "source": None, "tuned": None}
#: name -> a kernel module's ``CONFIG`` dict, registered by the module when it is imported (``register``)
_CONFIGS: dict[str, dict] = {}


def register(name: str, config: dict) -> dict:
    """Make ``config`` (a kernel module's ``CONFIG``) tunable under ``name``; tuned values already loaded for this
    process apply to it at once. Returns ``config``."""
    _CONFIGS[name] = config
    tuned = _STATE["tuned"]
    if tuned is not None and isinstance(tuned.get(name), dict) and set(tuned[name]) <= set(config):
        config.update(tuned[name])
    return config


def _triton_version() -> str:
    import triton  # triton is optional: only asked once a kernel launches

    return str(triton.__version__)


def _gpu_name(device=None) -> str:
    return torch.cuda.get_device_name(device)


def tuned_path(gpu_name: str) -> Path:
    """``$LINEARIZE_CACHE/kernels/<gpu name as a slug>.json``."""
    root = Path(os.environ.get("LINEARIZE_CACHE", Path.home() / ".cache" / "linearize"))
    return root / "kernels" / (re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-").lower() + ".json")


def save(gpu_name: str) -> Path:
    """Write the current configurations as the tuned ones for ``gpu_name`` (atomically); return the path."""
    path = tuned_path(gpu_name)
    blob = {"gpu": gpu_name, "triton": _triton_version(),
            **{name: dict(cfg) for name, cfg in _CONFIGS.items()}}
    with atomic_write(path) as tmp, open(tmp, "w") as f:
        json.dump(blob, f, indent=1, sort_keys=True)
    return path


def load(gpu_name: str) -> dict | None:
    """The saved configurations for ``gpu_name`` if usable (same GPU and Triton version, only known keys in the
    modules registered so far), by module name; a module the file does not name keeps its defaults (files
    written before it was tuned), and the sections of modules not yet imported are kept for :func:`register`
    (the decode steps' module is imported at the first decode step, after the prefill's kernels ran)."""
    path = tuned_path(gpu_name)
    try:
        blob = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(blob, dict) or blob.get("gpu") != gpu_name or blob.get("triton") != _triton_version():
        return None
    out = {name: cfg for name, cfg in blob.items() if name not in ("gpu", "triton")}
    for name, cfg in out.items():
        if not isinstance(cfg, dict) or (name in _CONFIGS and not set(cfg) <= set(_CONFIGS[name])):
            return None  # written by another version of the kernels
    return out


def ensure_applied(device) -> None:
    """Apply the saved configurations for ``device``'s GPU once per process (no-op off CUDA or when opted out)."""
    if _STATE["checked"]:
        return
    _STATE["checked"] = True
    if getattr(device, "type", None) != "cuda" or os.environ.get("LINEARIZE_KERNEL_TUNING", "1") == "0":
        return
    name = _gpu_name(device)
    tuned = load(name)
    if tuned is None:
        return
    _STATE["tuned"] = tuned
    for key, cfg in _CONFIGS.items():
        cfg.update(tuned.get(key, {}))
    _STATE["source"] = str(tuned_path(name))


def applied_from() -> str | None:
    """The file whose configurations are in use, or None (the shipped defaults)."""
    return _STATE["source"]

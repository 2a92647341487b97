"""The original's results from an earlier eval report: ``--against REPORT_DIR`` instead of a model.

Evaluating several hybrids against one original re-runs the original every time (on a GPU, minutes of needle
prompts). A report written by ``linearize eval`` already holds the original's rows (its ``against`` role, or its
``model`` role when the original itself was evaluated); :func:`load_earlier` takes them when the report was made
with the same grid (tasks, lengths, depths, seeds, data, generation length). Prompts are compared row by row once
the model has run (``prompt_sha1``), and the dtype once it has loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from linearize.io.outputs import read_marker

from .common import EvalConfig, EvalError

#: tasks whose original results depend on this run: speed (this machine), agreement (the original's text now)
NOT_REUSABLE = ("speed", "agreement")


@dataclass
class EarlierOriginal:
    """What an earlier report says of the original: its spec, chat-template flag, per-task summaries and rows."""

    path: Path
    spec: str
    chat_template: bool
    tasks: dict[str, dict]
    rows: list[dict]
    dtype: str | None


def is_report(path: str | Path | None) -> bool:
    """Whether ``path`` is a folder ``linearize eval`` wrote (its marker names eval and it has ``summary.json``)."""
    if not path:
        return False
    p = Path(path)
    marker = read_marker(p) if p.is_dir() else None
    return bool(marker and marker.get("command") == "eval" and (p / "summary.json").is_file())


def load_earlier(path: str | Path, labels: list[str], cfg: EvalConfig) -> EarlierOriginal:
    """The original's results in the report at ``path`` for the tasks ``labels`` (``["passkey", "ppl:16K"]``);
    one-line :class:`EvalError` when the report cannot stand for this run."""
    path = Path(path)
    try:
        summary = json.loads((path / "summary.json").read_text(encoding="utf-8"))
        conf = summary["config"]
    except (OSError, ValueError, KeyError, TypeError):
        raise EvalError(f"--against {path}: its summary.json is unreadable; evaluate the original again") from None
    blocked = [t for t in labels if t.partition(":")[0] in NOT_REUSABLE]
    if blocked:
        raise EvalError(f"--against {path}: an earlier report cannot stand for the original in {blocked[0]!r} "
                        f"(measured on this run's machine and model): pass the original model instead")
    want = {"lengths": cfg.lengths, "depths": cfg.depths, "seeds": cfg.seeds, "data": cfg.data or "wiki",
            "max_new_tokens": cfg.max_new_tokens}
    for key, value in want.items():
        if conf.get(key) != value:
            raise EvalError(f"--against {path}: that report's {key} is {conf.get(key)!r}, this run's {value!r}; "
                            f"run with the same grid or evaluate the original again")
    role = "against" if summary.get("against") else "model"
    block: dict[str, Any] = summary["against"] if role == "against" else summary
    missing = [t for t in labels if t not in conf.get("tasks", [])]
    if missing:
        raise EvalError(f"--against {path}: that report has no {missing[0]!r} (it ran {', '.join(conf['tasks'])})")
    names = [t.partition(":")[0] for t in labels]
    rows = []
    with open(path / "results.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row.pop("model", None) == role and row.get("task") in names:
                row.pop("spec", None)
                rows.append(row)
    chat = (conf.get("chat_template") or {}).get(role)
    return EarlierOriginal(path=path, spec=str(block.get("model") or path), chat_template=bool(chat),
                           tasks={n: block["tasks"][n] for n in names}, rows=rows, dtype=conf.get("dtype"))

"""Progress and console output that read well both on a terminal and in a log file.

On a terminal (or in Jupyter) long loops show rich progress bars. Written to a file, a pipe or a batch
scheduler's log (nohup, SLURM, CI), a rich bar prints nothing until it ends, so a multi-hour stage would look
hung; there :class:`LineProgress` prints one plain line per task every ``LINEARIZE_LOG_EVERY`` seconds (default
30) and when it completes: ``distill 40/1221 steps (3%)  loss 0.0312 ...  elapsed 0:04:10  eta 2:03:11``.
:func:`make_console` gives such output unwrapped lines (rich breaks them at 80 columns when it cannot measure a
terminal), so a log line stays one line for ``grep``.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.text import Text

from .settings import log_every


def _interactive(console) -> bool:
    return bool(console.is_terminal or getattr(console, "is_jupyter", False))


def make_console(stderr: bool = False, width: int = 200):
    """A rich Console; off a terminal (and without ``COLUMNS``) ``width`` columns and unwrapped text."""
    console = Console(stderr=stderr)
    if _interactive(console) or os.environ.get("COLUMNS"):
        return console
    return Console(stderr=stderr, width=width, soft_wrap=True)


def _clock(seconds: float) -> str:
    return str(_dt.timedelta(seconds=int(max(0.0, seconds))))


class LineProgress:
    """The subset of :class:`rich.progress.Progress` this package uses (``add_task``, ``update``, ``advance``,
    ``console``, context manager), printing plain lines: at a task's start, at most every ``every`` seconds
    while it runs, and once when it completes. ``unit`` (a task field) names what is counted (``"steps"``);
    ``info`` (a task field) is appended as given."""

    def __init__(self, console=None, every: float | None = None, disable: bool = False):
        self.console = console if console is not None else make_console()
        self.every = log_every() if every is None else every
        self.disable = disable
        self._tasks: dict[int, dict[str, Any]] = {}

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, completed: float = 0, **fields) -> int:
        tid = len(self._tasks)
        now = time.monotonic()
        self._tasks[tid] = {"description": description, "total": total, "completed": completed,
                            "start_completed": completed, "t0": now, "last": now, "done": False, "fields": fields}
        self._print(tid)
        return tid

    def update(self, task_id: int, *, completed: float | None = None, advance: float | None = None,
               total: float | None = None, description: str | None = None, **fields) -> None:
        t = self._tasks[task_id]
        if completed is not None:
            t["completed"] = completed
        if advance is not None:
            t["completed"] += advance
        if total is not None:
            t["total"] = total
        if description is not None:
            t["description"] = description
        t["fields"].update(fields)
        finished = t["total"] is not None and t["completed"] >= t["total"]
        if finished and not t["done"]:
            t["done"] = True
            self._print(task_id)
        elif not finished and time.monotonic() - t["last"] >= self.every:
            self._print(task_id)

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def line(self, task_id: int) -> str:
        """The task's progress line as it would be printed now."""
        t = self._tasks[task_id]
        done, total = t["completed"], t["total"]
        unit = t["fields"].get("unit", "")
        parts = [t["description"]]
        if total:
            parts.append(f"{done:,.0f}/{total:,.0f}{' ' + unit if unit else ''} ({100.0 * done / total:.0f}%)")
        else:
            parts.append(f"{done:,.0f}{' ' + unit if unit else ''}")
        info = str(t["fields"].get("info", "") or "").strip()
        if info:
            parts.append(info)
        elapsed = time.monotonic() - t["t0"]
        parts.append(f"elapsed {_clock(elapsed)}")
        left = eta_seconds(elapsed, done, t["start_completed"], total)
        if left is not None:
            parts.append(f"eta {_clock(left)}")
        return "  ".join(parts)

    def _print(self, task_id: int) -> None:
        self._tasks[task_id]["last"] = time.monotonic()
        if not self.disable:
            self.console.print(self.line(task_id), highlight=False, markup=False, soft_wrap=True)
            stream = getattr(self.console, "file", None) or sys.stdout
            if hasattr(stream, "flush"):
                stream.flush()


def eta_seconds(elapsed: float | None, done: float, start: float, total: float | None) -> float | None:
    """Seconds left at this run's average pace: ``elapsed`` seconds for ``done - start`` units (None before the
    first unit, without a total, or when finished)."""
    ran = done - start
    if elapsed is None or not total or ran <= 0 or done >= total:
        return None
    return elapsed / ran * (total - done)


def _eta_column():
    """A rich column with :func:`eta_seconds`, the estimate of the plain lines. rich's ``TimeRemainingColumn`` needs
    two updates within its 30 s window, so a run whose steps take longer (a large model on a CPU) never showed one."""
    class EtaColumn(ProgressColumn):
        max_refresh = 0.5

        def render(self, task) -> Text:
            if task.finished:
                return Text(f"elapsed {_clock(task.finished_time or task.elapsed or 0.0)}", style="progress.elapsed")
            left = eta_seconds(task.elapsed, task.completed, task.fields.get("start_completed", 0), task.total)
            return Text(f"eta {_clock(left)}" if left is not None else "eta -:--:--", style="progress.remaining")

    return EtaColumn()


def _rich_progress(*columns, **kwargs):
    """rich's ``Progress`` whose tasks remember where they started (a resumed run's first step), which the ETA
    column reads; rich's own time-remaining columns are replaced by it."""
    class StepProgress(Progress):
        def add_task(self, description, start=True, total=100.0, completed=0, visible=True, **fields):
            fields.setdefault("start_completed", completed)
            return super().add_task(description, start=start, total=total, completed=completed, visible=visible,
                                    **fields)

    columns = tuple(_eta_column() if isinstance(c, TimeRemainingColumn) else c for c in columns)
    return StepProgress(*columns, **kwargs)


def make_progress(*columns, disable: bool = False, console=None, transient: bool = False):
    """A rich ``Progress(*columns)`` on a terminal (its time remaining as the plain lines estimate it), else a
    :class:`LineProgress` (same calls)."""
    console = console if console is not None else make_console()
    if _interactive(console):
        return _rich_progress(*columns, disable=disable, console=console, transient=transient)
    return LineProgress(console, disable=disable)


def step_progress(label: str, *, disable: bool = False, console=None):
    """The training stages' bar: ``label``, the bar, ``completed/total steps``, the task's ``info`` field and the
    time remaining; lines off a terminal (add the task with ``unit="steps"``)."""
    return make_progress(TextColumn(label), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                         TextColumn("{task.fields[info]}"), TimeRemainingColumn(), disable=disable, console=console)

"""Evaluation suite: needle-in-a-haystack, passkey, perplexity, recall capacity, agreement
with the original, speed, and an lm-evaluation-harness pass-through; rendered as a report
with the original side by side.

Entry point: :func:`run_eval`. Tasks live in one module each (``niah``, ``passkey``, ``ppl``,
``recall``, ``agreement``, ``speed``, ``swapback``, ``lm_eval``); ``report`` renders ``summary.json`` into
``report.md``, PNG heatmaps and a rich table.
"""

from .common import EvalError, parse_batch_sizes, parse_depths, parse_lengths, parse_seeds
from .runner import ALLOWED as TASK_HELP
from .runner import TASKS, EvalOptions, LoadOptions, ReportOptions, parse_tasks, run_eval

TASK_NAMES = tuple(TASKS)

__all__ = [
    "EvalError",
    "EvalOptions",
    "LoadOptions",
    "ReportOptions",
    "TASK_HELP",
    "TASK_NAMES",
    "parse_batch_sizes",
    "parse_depths",
    "parse_lengths",
    "parse_seeds",
    "parse_tasks",
    "run_eval",
]

"""Progress off a terminal: plain lines a log file can show while a stage runs (linearize.progress)."""

import io

import pytest
from rich.console import Console

from linearize import progress as P
from linearize import settings


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(P.time, "monotonic", c)
    return c


def _lines(buf: io.StringIO) -> list[str]:
    return [line for line in buf.getvalue().splitlines() if line]


def test_line_progress_prints_at_start_every_interval_and_once_at_the_end(clock):
    buf = io.StringIO()
    bar = P.LineProgress(Console(file=buf, width=200, soft_wrap=True), every=30)
    with bar:
        task = bar.add_task("distill", total=100, completed=0, info="", unit="steps")
        for step in range(1, 101):
            clock.now += 1.0  # one step per second: a line every 30 steps, then the last
            bar.update(task, completed=step, info=f"loss {1.0 / step:.4f}")
        bar.update(task, completed=100, info="again")  # a finished task prints nothing more
    lines = _lines(buf)
    assert lines[0] == "distill  0/100 steps (0%)  elapsed 0:00:00"
    assert lines[1] == "distill  30/100 steps (30%)  loss 0.0333  elapsed 0:00:30  eta 0:01:10"
    assert [line.split()[1] for line in lines] == ["0/100", "30/100", "60/100", "90/100", "100/100"]
    assert lines[-1] == "distill  100/100 steps (100%)  loss 0.0100  elapsed 0:01:40"


def test_line_progress_eta_counts_only_this_runs_steps(clock):
    buf = io.StringIO()
    bar = P.LineProgress(Console(file=buf, width=200, soft_wrap=True), every=0)
    task = bar.add_task("finetune", total=10, completed=6, unit="steps")  # resumed at step 6
    clock.now += 20.0
    bar.update(task, completed=8)
    assert _lines(buf)[-1] == "finetune  8/10 steps (80%)  elapsed 0:00:20  eta 0:00:20"
    bar.advance(task)
    clock.now += 5.0
    assert bar.line(task).startswith("finetune  9/10 steps (90%)")


def test_disabled_line_progress_prints_nothing(clock):
    buf = io.StringIO()
    bar = P.LineProgress(Console(file=buf), every=0, disable=True)
    task = bar.add_task("distill", total=2)
    bar.update(task, completed=2)
    assert buf.getvalue() == ""


def test_progress_is_a_rich_bar_only_on_a_terminal():
    from rich.progress import Progress

    off = Console(file=io.StringIO())
    on = Console(file=io.StringIO(), force_terminal=True)
    assert isinstance(P.make_progress(console=off), P.LineProgress)
    assert isinstance(P.make_progress(console=on), Progress)
    assert isinstance(P.step_progress("distill"), P.LineProgress)  # pytest captures stdout: no terminal


def test_log_console_keeps_long_lines_whole(monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    console = P.make_console()
    assert console.width == 200
    line = "distill: held-out attention MSE 0.09093 -> 0.05109 (mean per-layer reduction 2.2x), " + "x" * 150
    console.print(line, highlight=False)
    assert capsys.readouterr().out == line + "\n"


def test_log_every_reads_the_environment(monkeypatch):
    monkeypatch.setenv("LINEARIZE_LOG_EVERY", "5")
    assert settings.log_every() == 5.0
    monkeypatch.setenv("LINEARIZE_LOG_EVERY", "often")
    assert settings.log_every() == settings.DEFAULT_LOG_EVERY
    monkeypatch.delenv("LINEARIZE_LOG_EVERY")
    assert settings.log_every() == settings.DEFAULT_LOG_EVERY

"""The Typer app of the ``linearize`` command line, its error handling and its exit codes.

A usage error (unknown option, bad value, missing argument) is one line and exit 2; an error a user can cause
(:class:`~linearize.errors.LinearizeError`) one line and its ``exit_code``; running out of memory one line and
exit 3; Ctrl-C exit 130. The commands live in the modules beside this one and register themselves on :data:`app`
(and :data:`bench_app`) when :mod:`linearize.cli` is imported.
"""

from __future__ import annotations

import errno
import functools
import os
import sys
from typing import Callable, List, Optional

import typer
from rich.markup import escape

from ..errors import LinearizeError
from ..progress import make_console
from ..version import __version__

try:  # a Typer internal: the value type --help prints beside each option
    from typer.core import TyperOption
except ImportError:  # pragma: no cover - another Typer layout: its own help
    TyperOption = None

app = typer.Typer(
    help="Convert softmax-attention LLMs into fast linear-attention hybrids.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks: kernels (vs fla and SDPA), model speed vs the original, training throughput.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

console = make_console()
err_console = make_console(stderr=True)


def _plain_flags() -> None:
    """Show on/off options as bare flags in ``--help``: this Typer prints a value type (``<bool>``) beside every
    option, flags included, which reads as if ``--no-train`` took a value."""
    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_linearize_plain_flags", False):
        return

    def display_type_rich(self, ctx):
        if getattr(self, "is_flag", False) and not getattr(self, "count", False):
            return None
        return shown(self, ctx)

    display_type_rich._linearize_plain_flags = True
    TyperOption.display_type_rich = display_type_rich


_plain_flags()


def _print_version(value: bool) -> None:
    if value:
        console.print(f"linearize {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print the version and exit.")):
    """Convert softmax-attention LLMs into fast linear-attention hybrids."""


def fail(message: str, code: int = 2) -> None:
    """Print one line on stderr and exit non-zero."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def user_errors(fn: Callable) -> Callable:
    """Turn errors a user can cause into one line and a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LinearizeError as e:
            fail(str(e), e.exit_code)
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130)
        except Exception as e:
            # start-up time: the guards import torch and the recipe schema, needed only once something failed
            from ..train.guards import is_oom, oom_error

            if is_oom(e):  # CUDA, MemoryError or the CPU allocator: stage, layer, batch from the traceback
                fail(str(oom_error(e)), 3)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                fail(f"{e.filename or 'output'}: {e.strerror} (disk full); free some space or write elsewhere (-o)")
            if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                fail(f"{e.filename or 'file'}: {e.strerror}")
            raise

    return wrapper


def log(message: str) -> None:
    """A progress line on stdout; under torchrun only rank 0 prints."""
    from ..distributed import is_main  # start-up time: torch, which --help and option errors never need

    if is_main():
        console.print(message, highlight=False)


def main() -> None:
    """Console-script entry point."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging  # after the two settings above, which it reads on import

    hf_logging.disable_progress_bar()
    sys.exit(run_app())


def _kind(e: BaseException, name: str) -> bool:
    """Whether ``e`` is a click exception called ``name`` (click itself or the copy newer typer vendors)."""
    return any(c.__name__ == name for c in type(e).__mro__)


def run_app(args: Optional[List[str]] = None) -> int:
    """Run the CLI; a usage error (unknown option, bad value, missing argument) is one line, exit 2."""
    try:
        code = app(args=args, standalone_mode=False)
    except Exception as e:  # click's exceptions, matched by name (see _kind)
        if _kind(e, "NoArgsIsHelpError"):
            e.show()  # a bare command prints its help
            return e.exit_code
        if _kind(e, "UsageError"):
            ctx = getattr(e, "ctx", None)
            where = " ".join(["linearize", *ctx.command_path.split()[1:]]) if ctx is not None else "linearize"
            err_console.print(f"[bold red]error:[/] {escape(e.format_message())} (see `{where} --help`)",
                              highlight=False, soft_wrap=True)
            return 2
        if _kind(e, "Abort"):
            err_console.print("interrupted")
            return 130
        raise
    return code if isinstance(code, int) else 0

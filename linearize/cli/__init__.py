"""The ``linearize`` command line: every command is a thin wrapper over a library function.

:mod:`.app` holds the Typer app, its error handling and exit codes, :mod:`.options` the options several
commands share, and one module per command group defines its commands; importing this package registers them,
in the order ``linearize --help`` lists them.
"""

from . import convert, train, info, generate, eval, recipes, bench  # noqa: F401, I001  (registers the commands, in this order)
from .app import app, main, run_app

__all__ = ["app", "main", "run_app"]

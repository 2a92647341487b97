"""The ``linearize`` console script.

It is imported before the ``linearize`` package, so the package can tell that it runs as the command line and skip
what ``import linearize`` does for library users: registering the hybrid with transformers' Auto classes, which
imports transformers' model code (about 5 s on 2 CPU cores). Each command imports what it needs; a hybrid
checkpoint registers itself when it is opened (:func:`linearize.io.sources.local_dir`). ``linearize --help`` and
option errors answer in about a second instead of seven.
"""


def main():
    from linearize.cli import main as run

    return run()

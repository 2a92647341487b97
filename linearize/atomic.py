"""Write a file or a folder so that it appears complete or not at all.

:func:`atomic_write` yields a temporary path beside the target, ``.NAME.tmp-PID`` (the same folder, so the final
rename stays on one file system and is atomic); the caller writes there. When the block completes the temporary
path is renamed over the target, when it raises the temporary path is removed and the target is left as it was.
A folder that is replaced is first moved aside to ``.NAME.old-PID`` and removed after the rename
(:func:`linearize.io.checkpoint.recover_output` puts it back when a run was killed between the two renames).

Standard library only: the kernels' tuning file (:mod:`linearize.kernels.tuning`) uses it inside the remote code
a checkpoint bundles (:mod:`linearize.bundle`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_write"]


def _sibling(path: str | Path, kind: str) -> Path:
    """``.NAME.KIND-PID`` beside ``path`` (``kind``: ``tmp`` or ``old``)."""
    path = Path(path)
    return path.parent / f".{path.name}.{kind}-{os.getpid()}"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_write(path: str | Path, *, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path that becomes ``path`` only if the block completes (the parent folder is created).

    ``directory=False``: the caller creates the file at the yielded path (``tmp.write_text(...)``,
    ``open(tmp, "wb")``). ``directory=True``: the yielded path is an empty folder; an existing folder at ``path``
    is replaced as a whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(path, "tmp")
    _remove(tmp)  # left by an earlier process that had this id
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        if directory and path.is_dir() and not path.is_symlink():
            old = _sibling(path, "old")
            _remove(old)
            os.replace(path, old)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(old, path)
                raise
            _remove(old)
        else:
            os.replace(tmp, path)
    finally:
        _remove(tmp)

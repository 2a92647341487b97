"""Rules for the folders linearize writes: never into or over a model checkpoint, ``--overwrite`` only over an
earlier output of the same command, normal file modes.

Every output folder carries :data:`MARKER` (``{"command": "eval", "version": ...}``), naming the command that
wrote it. :func:`check_output` decides, before any model is loaded, whether a folder may be written:

- a model checkpoint (a folder with ``config.json`` or ``adapter_config.json`` and weights, hybrid or not) is
  never replaced, and nothing is written inside one; the one exception is the checkpoint a command updates in
  place (``distill`` / ``finetune`` without ``-o``), or an earlier output of the same command (``convert
  --overwrite`` over a folder ``convert`` wrote);
- an existing folder is replaced only with ``overwrite``; on the command line (inside :func:`command_scope`)
  only when its marker names the same command (or it is empty).

Library calls outside a :func:`command_scope` are lenient about the marker (``overwrite=True`` replaces an
unmarked folder that is not a model checkpoint) but never replace a model checkpoint they did not write.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as _dt
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import OutputError
from ..version import __version__

MARKER = ".linearize-output.json"
#: files that make a folder with ``config.json`` (or ``adapter_config.json``) a model checkpoint
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.bin.index.json", "*.gguf",
                   "*.pt", "*.pth", "tf_model.h5", "flax_model.msgpack", "model.ckpt*")
#: commands without ``--overwrite`` (they update their checkpoint in place unless ``-o`` names a new folder)
_NO_OVERWRITE_FLAG = ("distill", "finetune")


@dataclass(frozen=True)
class Scope:
    """The command line command being run: its name and, for distill / finetune, the checkpoint it updates."""

    command: str
    in_place: Path | None = None


_SCOPE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("linearize_output_scope", default=None)


@contextlib.contextmanager
def command_scope(command: str, *, in_place: str | Path | None = None) -> Iterator[Scope]:
    """Run a command's library call under the command line's rules: output checks are strict about the
    marker (``--overwrite`` replaces only this command's outputs) and the marker names ``command``.
    ``in_place``: the checkpoint the command may update in place (distill / finetune without ``-o``)."""
    scope = Scope(command, Path(in_place) if in_place is not None else None)
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def current_scope() -> Scope | None:
    return _SCOPE.get()


# ----------------------------------------------------------------------------- what a folder is

def is_model_dir(path: str | Path) -> bool:
    """A model checkpoint: a folder holding ``config.json`` (or ``adapter_config.json``) and weights."""
    p = Path(path)
    try:
        if not p.is_dir() or not ((p / "config.json").is_file() or (p / "adapter_config.json").is_file()):
            return False
        return any(next(p.glob(pattern), None) is not None for pattern in WEIGHT_PATTERNS)
    except OSError:
        return False


def enclosing_model_dir(path: str | Path) -> Path | None:
    """The model checkpoint ``path`` is or lies inside (the nearest one), else None."""
    p = _absolute(path)
    for q in (p, *p.parents):
        if is_model_dir(q):
            return q
    return None


def config_json(path) -> dict:
    """``path/config.json`` read as plain JSON (no transformers); ``{}`` if unreadable."""
    try:
        d = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def is_hybrid_dir(path: Path) -> bool:
    """True when ``path`` holds a linearize hybrid checkpoint (its ``config.json`` names the hybrid class; ones
    written before 0.1.0 also said ``model_type: linearize``)."""
    d = config_json(path)
    return d.get("model_type") == "linearize" or "LinearizeForCausalLM" in (d.get("architectures") or ())


def read_marker(path: str | Path) -> dict | None:
    """The marker of an output folder (``{"command": ..., "version": ...}``), None if it has none."""
    try:
        d = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and isinstance(d.get("command"), str) else None


def write_marker(directory: str | Path, command: str) -> Path:
    """Write the marker saying ``command`` wrote ``directory``."""
    p = Path(directory) / MARKER
    p.write_text(json.dumps({"command": command, "version": __version__,
                             "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}) + "\n")
    return p


def _absolute(path: str | Path) -> Path:
    return Path(os.path.abspath(Path(path).expanduser().resolve()))


def _same(a: str | Path, b: str | Path) -> bool:
    return _absolute(a) == _absolute(b)


# ----------------------------------------------------------------------------- the rule

def check_output(out: str | Path, *, overwrite: bool, command: str | None = None, in_place: str | Path | None = None,
                 strict: bool | None = None, error: type[Exception] = OutputError) -> None:
    """Fail in one line (``error``) unless ``out`` may be written by ``command``; writes nothing.

    ``command`` and ``in_place`` default to the active :func:`command_scope`'s; ``strict`` (default: inside a
    scope) makes ``overwrite`` replace only a folder whose marker names ``command`` (or an empty one)."""
    scope = current_scope()
    if scope is not None:
        command = command or scope.command
        in_place = in_place if in_place is not None else scope.in_place
    if strict is None:
        strict = scope is not None and command == scope.command
    out = Path(out)
    who = f"`linearize {command}`" if command else "linearize"
    if out.exists() and not out.is_dir():
        raise error(f"output {out} exists and is not a directory")
    if in_place is not None and _same(out, in_place):
        return  # the checkpoint the command updates in place: its documented behaviour
    marker = read_marker(out) if out.is_dir() else None
    own = marker is not None and (command is None or marker["command"] == command)
    model = enclosing_model_dir(out)
    if model is not None and model != _absolute(out):
        raise error(f"output {out} is inside the model checkpoint {model}: {who} never writes into a model "
                    f"checkpoint; choose an output outside it (-o)")
    if model is not None and not own:
        # outside the command line, a hybrid's rerun in place (pipeline.rerun_stage) comes here with overwrite
        if not (command is None and overwrite and is_hybrid_dir(out)):
            raise error(f"output {out} is a model checkpoint: {who} never replaces one; choose another output (-o)")
    if not out.exists():
        return check_writable(out)
    if command in _NO_OVERWRITE_FLAG and strict:
        raise error(f"output {out} already exists: choose a new folder for -o (without -o, {command} updates its "
                    f"checkpoint in place)")
    empty = not any(out.iterdir())
    if marker is not None and not own:
        raise error(f"output {out} was written by `linearize {marker['command']}`: --overwrite only replaces an "
                    f"earlier output of {who}; choose another output (-o)")
    if not overwrite:
        raise error(f"output {out} already exists (pass --overwrite to replace it)")
    if strict and not own and not empty:
        raise error(f"output {out} already exists and was not written by {who} (it has no {MARKER}): --overwrite "
                    f"only replaces an earlier output of {who}; choose another output (-o) or remove it yourself")
    check_writable(out)


def check_writable(out: Path) -> None:
    """Fail in one line unless ``out`` can be created: its nearest existing ancestor must be a directory
    in which a file can be made (probed for real: permission bits lie to root, read-only mounts do not).
    The probe file is removed at once; nothing else is written."""
    out = Path(out)
    probe = out.resolve().parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise OutputError(f"output {out}: {probe} is not a directory")
    try:
        fd, name = tempfile.mkstemp(prefix=".linearize-probe-", dir=probe)
    except OSError as e:
        raise OutputError(f"output {out}: {probe} is not writable ({e.strerror})") from None
    os.close(fd)
    os.unlink(name)


# ----------------------------------------------------------------------------- file modes

def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: read it by setting it (and put it back at once)
    os.umask(mask)
    return mask


def normalize_modes(directory: str | Path) -> None:
    """Give ``directory`` and everything in it the modes a plain ``open`` / ``mkdir`` would (0644 / 0755 under
    umask 022): temporary folders (``mkdtemp``: 0700) and some writers (safetensors: 0600) are private."""
    mask = _umask()
    root = Path(directory)
    os.chmod(root, 0o777 & ~mask)
    for base, dirs, files in os.walk(root):
        for d in dirs:
            p = os.path.join(base, d)
            if not os.path.islink(p):
                os.chmod(p, 0o777 & ~mask)
        for name in files:
            p = os.path.join(base, name)
            if os.path.islink(p):
                continue
            executable = os.stat(p).st_mode & 0o100
            os.chmod(p, (0o777 if executable else 0o666) & ~mask)


def finish_output(directory: str | Path, command: str) -> None:
    """Mark a finished folder written by another library's writer (a LoRA adapter) and normalize its modes."""
    write_marker(directory, command)
    normalize_modes(directory)

"""linearize.atomic.atomic_write: a file or folder appears complete or not at all, and nothing temporary is left."""

from __future__ import annotations

import os

import pytest

from linearize import atomic, bundle
from linearize.atomic import atomic_write


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_file_is_renamed_into_place(tmp_path):
    target = tmp_path / "sub" / "a.json"  # the parent is created
    with atomic_write(target) as tmp:
        assert tmp.parent == target.parent and tmp.name == f".a.json.tmp-{os.getpid()}" and not target.exists()
        tmp.write_text("new")
    assert target.read_text() == "new" and _names(target.parent) == ["a.json"]
    with atomic_write(target) as tmp:
        tmp.write_text("newer")
    assert target.read_text() == "newer" and _names(target.parent) == ["a.json"]


def test_failed_file_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "a.json"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_write(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("boom")
    assert target.read_text() == "old" and _names(tmp_path) == ["a.json"]


def test_folder_replaces_the_old_one_whole(tmp_path):
    target = tmp_path / "OUT"
    with atomic_write(target, directory=True) as tmp:
        assert tmp.is_dir() and not any(tmp.iterdir())
        (tmp / "one.txt").write_text("1")
    assert _names(target) == ["one.txt"]
    with atomic_write(target, directory=True) as tmp:
        (tmp / "two.txt").write_text("2")
    assert _names(target) == ["two.txt"] and _names(tmp_path) == ["OUT"]  # no .OUT.old-PID left


def test_failed_folder_write_keeps_the_old_folder(tmp_path):
    target = tmp_path / "OUT"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(target, directory=True) as tmp:
            (tmp / "new.txt").write_text("new")
            raise KeyboardInterrupt
    assert _names(target) == ["old.txt"] and _names(tmp_path) == ["OUT"]


def test_failed_final_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    target = tmp_path / "OUT"
    target.mkdir()
    (target / "old.txt").write_text("old")
    real = os.replace

    def replace(src, dst):
        if str(src).endswith(f".OUT.tmp-{os.getpid()}"):
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(OSError, match="No space"):
        with atomic_write(target, directory=True) as tmp:
            (tmp / "new.txt").write_text("new")
    assert _names(target) == ["old.txt"] and _names(tmp_path) == ["OUT"]


def test_a_stale_temporary_of_this_process_id_is_replaced(tmp_path):
    stale = tmp_path / f".OUT.tmp-{os.getpid()}"
    stale.mkdir()
    (stale / "stale.txt").write_text("from a dead run with this pid")
    with atomic_write(tmp_path / "OUT", directory=True) as tmp:
        assert tmp == stale and not any(tmp.iterdir())
        (tmp / "new.txt").write_text("new")
    assert _names(tmp_path / "OUT") == ["new.txt"] and _names(tmp_path) == ["OUT"]


def test_bundled_with_the_kernels_tuning_module():
    """The kernels' tuning file writes through atomic_write inside a checkpoint's remote code."""
    files = bundle.remote_code_files()
    assert "from .linearize_atomic import atomic_write" in files["linearize_kernels_tuning.py"]
    assert "from ." not in files["linearize_atomic.py"].replace("from __future__", "")

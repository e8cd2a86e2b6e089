"""Atomic files and directories: published whole or not at all, a unique temporary per writer, nothing left."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from clover.atomic_files import atomic_directory, atomic_path, atomic_write_text


def hidden(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def test_durable_directory_and_text_writes_replace_whole_and_leave_nothing_behind(tmp_path: Path) -> None:
    target = tmp_path / "step"
    for text in ("old", "new"):
        with atomic_directory(target, durable=True) as tmp:
            (tmp / "sub").mkdir()
            (tmp / "sub" / "f.txt").write_text(text)
            assert not target.exists() or (target / "sub" / "f.txt").read_text() == "old"  # not yet published
    assert (target / "sub" / "f.txt").read_text() == "new"
    with pytest.raises(KeyboardInterrupt), atomic_directory(target, durable=True) as tmp:
        (tmp / "half").write_text("x")
        raise KeyboardInterrupt
    assert sorted(p.name for p in target.iterdir()) == ["sub"]
    atomic_write_text(tmp_path / "latest", "step-1\n", durable=True)
    atomic_write_text(tmp_path / "latest", "step-2\n")
    assert (tmp_path / "latest").read_text() == "step-2\n"
    assert hidden(tmp_path) == []


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "table.json"  # the parent is made
    atomic_write_text(path, "old")
    with pytest.raises(OSError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise OSError(28, "No space left on device")
    assert path.read_text() == "old" and hidden(path.parent) == []


def test_writers_of_one_file_never_share_a_temporary(tmp_path: Path) -> None:
    """Two writers at once (two processes calibrating the same cost table): each stages into its own file, so the
    result is one writer's whole text, never a mix and never a rename of a file another one is still writing."""
    path = tmp_path / "costs.json"
    inside = threading.Barrier(2)
    staged: list[Path] = []

    def write(text: str) -> None:
        with atomic_path(path) as tmp:
            staged.append(tmp)
            tmp.write_text(text[: len(text) // 2])
            inside.wait(timeout=10)  # both are half-way through at once
            tmp.write_text(text)

    threads = [threading.Thread(target=write, args=(c * 1000,)) for c in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(staged)) == 2 and all(p.parent == tmp_path for p in staged)
    assert path.read_text() in ("a" * 1000, "b" * 1000)
    assert hidden(tmp_path) == []


def test_a_published_file_has_ordinary_permissions(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    atomic_write_text(path, "{}\n")
    reference = tmp_path / "plain"
    reference.write_text("x")
    assert path.stat().st_mode == reference.stat().st_mode  # not mkstemp's private 0600


def test_the_temporary_gets_ordinary_permissions_without_touching_the_process_umask(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """`os.umask` sets the mask of the whole process: a file another thread created while it was 0 would be
    world-writable. The temporary is created with the ordinary mode instead, the umask applied by the kernel."""
    def forbidden(mask: int) -> int:
        raise AssertionError("atomic_files changed the process umask")

    monkeypatch.setattr(os, "umask", forbidden)
    path = tmp_path / "out.json"
    atomic_write_text(path, "{}")
    reference = tmp_path / "plain"
    reference.write_text("x")
    assert path.read_text() == "{}" and path.stat().st_mode == reference.stat().st_mode


def test_an_empty_clover_cache_means_the_default(monkeypatch) -> None:
    """`CLOVER_CACHE=""` (a variable set but empty, as shells and CI templates leave it) is unset, not the current
    directory."""
    from clover.paths import cache_root

    monkeypatch.setenv("CLOVER_CACHE", "")
    assert cache_root() == Path.home() / ".cache" / "clover"
    monkeypatch.setenv("CLOVER_CACHE", "/tmp/elsewhere")
    assert cache_root() == Path("/tmp/elsewhere")

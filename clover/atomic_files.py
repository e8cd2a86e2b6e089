"""Files and directories written whole or not at all: a unique hidden temporary beside the destination, renamed
onto it only once complete (`os.replace` is atomic within a filesystem), deleted on any error.

Every cache, log and checkpoint Clover writes goes through here, so two processes writing the same file never
share a temporary (each gets its own name) and a reader never sees half of one: a kill leaves the old file or the
new one, and at worst a hidden `.NAME.tmp-XXXXXXXX` for its owner's next start to remove.

`durable`: also fsync the new file or tree before the rename and the parent directory after it, so that once the
call returns the new version survives a power loss (needed where a pointer written next names it: a training
checkpoint's `latest`).

The bottom of the package: imports nothing of Clover's.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | Path, *, durable: bool = False) -> Iterator[Path]:
    """Yield the path of a new empty file beside `path` (a unique hidden name, the permissions of any new file);
    once the block ends without error it is renamed onto `path`, on any error (KeyboardInterrupt included) it is
    deleted. For writers that open the file themselves (a GGUF writer, a stream of lines)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_file(path.parent, f".{path.name}.tmp-")
    try:
        yield tmp
        if durable:
            _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str, *, durable: bool = False) -> None:
    """Replace the file `path` by one holding `text` (UTF-8), atomically (`durable`: and durably)."""
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextmanager
def atomic_directory(directory: str | Path, *, durable: bool = False) -> Iterator[Path]:
    """Yield a fresh hidden sibling of `directory`; on success move it onto `directory`, on any error
    (KeyboardInterrupt included) delete it. An existing `directory` is swapped out, then removed."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:8]
    tmp = directory.parent / f".{directory.name}.tmp-{token}"
    tmp.mkdir()
    try:
        yield tmp
        if durable:
            _fsync_tree(tmp)
        old = None
        if directory.exists():
            old = directory.parent / f".{directory.name}.old-{token}"
            os.replace(directory, old)
        try:
            os.replace(tmp, directory)
        except BaseException:
            if old is not None:  # put the previous version back
                os.replace(old, directory)
            raise
        if durable:
            _fsync_dir(directory.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _new_file(directory: Path, prefix: str) -> Path:
    """A new empty file in `directory` named `prefix` + a random token, with the mode of any new file (0666 less
    the umask, which the kernel applies: reading the umask would mean setting it, for the whole process), never
    through a link (`O_EXCL`: an existing name, a dangling symlink included, is another try)."""
    while True:
        tmp = directory / f"{prefix}{uuid.uuid4().hex[:8]}"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync_file(Path(dirpath) / name)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    """fsync a directory (its entries); a no-op where the platform cannot open or sync one."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

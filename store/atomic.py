"""Atomic writes: readers see the old file (or folder) or the whole new one, never a part.

Every shared write of layerdiv goes through :func:`atomic_path`: the content is written to a
temporary path beside the target (named with this host and process id, so that another process
can tell a live writer's temporary from a dead one's), fsynced, and renamed into place; on failure
the temporary is removed.

A folder that replaces another is swapped with it in one step where the system can (Linux
``renameat2`` with ``RENAME_EXCHANGE``), then the old one, now under the temporary name, is
deleted. Elsewhere it takes two renames: the old folder goes aside to :func:`kept_path` (a name
with this host and process id), the new one takes its place, then the old one is deleted; a
process killed between the two leaves the old folder complete under that name, and
:func:`restore` (run by each writer of such a folder before it reads it, and by ``Store``) puts
it back. Either way, at every instant the old folder or the new one is found complete, never
neither.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_HOST = re.sub(r"[^A-Za-z0-9-]+", "-", socket.gethostname()) or "host"
_TMP = re.compile(r"^\..+\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[0-9a-f]+\.tmp$")
_KEPT = re.compile(r"^\.(?P<name>.+)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.kept$")


def host() -> str:
    """This machine's name as it appears in temporary and run-record file names."""
    return _HOST


def temp_path(target: Path) -> Path:
    """A fresh temporary path beside ``target``: ``.<name>.<host>.<pid>.<random>.tmp``."""
    return target.parent / f".{target.name}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def kept_path(target: Path) -> Path:
    """Where a folder being replaced waits while its replacement is renamed in:
    ``.<name>.<host>.<pid>.kept`` beside it (never taken for a temporary)."""
    return target.parent / f".{target.name}.{_HOST}.{os.getpid()}.kept"


def restore(target: Path) -> None:
    """Finish what a dead process of this host left between the two renames of a folder
    replacement of ``target``: put its kept old folder back where ``target`` is missing, delete
    it where ``target`` (the new folder) is in place. A live process's kept folder is left. A
    ``target`` that is a symbolic link is followed, as :func:`atomic_path` does."""
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    if not target.parent.is_dir():
        return
    for kept in sorted(target.parent.glob(".*.kept")):
        m = _KEPT.match(kept.name)
        if m is None or m.group("name") != target.name or m.group("host") != _HOST:
            continue
        if pid_alive(int(m.group("pid"))) and int(m.group("pid")) != os.getpid():
            continue
        if target.exists() or target.is_symlink():
            _remove(kept)
        else:
            os.rename(kept, target)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale_temp(path: Path) -> bool:
    """A temporary of :func:`temp_path` left by a process of this host that no longer runs
    (the temporaries of live processes, or of other hosts, are never stale)."""
    m = _TMP.match(path.name)
    return m is not None and m.group("host") == _HOST and not pid_alive(int(m.group("pid")))


def remove_stale_temps(folder: Path, name: str = "") -> None:
    """Delete the stale temporaries (:func:`is_stale_temp`) in ``folder``; with ``name``, only
    those for ``folder / name``."""
    if not folder.is_dir():
        return
    for path in folder.glob(f".{name}.*.tmp" if name else ".*.tmp"):
        if is_stale_temp(path):
            _remove(path)


@contextmanager
def atomic_path(target: Path, exclusive: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; the caller writes a file or a folder there.
    On success it is fsynced and renamed to ``target`` (replacing it, a non-empty folder too, or
    with ``exclusive`` raising :class:`FileExistsError` if ``target`` exists); on failure it is
    removed. A ``target`` that is a symbolic link is followed (the folder or file it names is
    replaced, the link kept)."""
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(target)
    try:
        yield tmp
        fsync_tree(tmp)
        if not exclusive:
            _replace(tmp, target)
        elif tmp.is_dir():
            try:
                os.rename(tmp, target)  # fails on an existing non-empty folder
            except OSError as err:
                if target.exists():
                    raise FileExistsError(target) from err
                raise
        else:
            os.link(tmp, target)  # raises FileExistsError
        fsync(target.parent)
    finally:
        _remove(tmp)


def write_bytes(path: Path, data: bytes, exclusive: bool = False) -> bool:
    """Atomically write ``data`` to ``path``; with ``exclusive`` only if ``path`` does not exist
    yet (returns False then)."""
    try:
        with atomic_path(path, exclusive) as tmp:
            tmp.write_bytes(data)
    except FileExistsError:
        return False
    return True


def _replace(tmp: Path, target: Path) -> None:
    """:func:`os.replace`, also of a non-empty folder: that is renamed aside to
    :func:`kept_path` first (put back if the rename fails, else removed; :func:`restore` puts it
    back if the process dies in between)."""
    if not (tmp.is_dir() and target.is_dir() and any(target.iterdir())):
        os.replace(tmp, target)
        return
    if _exchange(tmp, target):  # the old folder is now at tmp, which the caller removes
        return
    old = kept_path(target)
    _remove(old)
    os.replace(target, old)
    try:
        os.replace(tmp, target)
    except OSError:
        os.replace(old, target)
        raise
    _remove(old)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the folders ``a`` and ``b`` in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``); False where the C library, the kernel or the file system cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def fsync(path: Path) -> None:
    """fsync the file or folder ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync ``path`` and, a folder, every file under it."""
    if path.is_dir():
        for child in path.rglob("*"):
            if child.is_file():
                fsync(child)
    fsync(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)

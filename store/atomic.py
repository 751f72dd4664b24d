"""Atomic writes: readers see the old file (or folder) or the whole new one, never a part.

Every shared write of layerdiv goes through :func:`atomic_path`: the content is written to a
temporary path beside the target (named with this host and process id, so that another process
can tell a live writer's temporary from a dead one's), fsynced, and renamed into place; on failure
the temporary is removed.
"""

from __future__ import annotations

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


def host() -> str:
    """This machine's name as it appears in temporary and run-record file names."""
    return _HOST


def temp_path(target: Path) -> Path:
    """A fresh temporary path beside ``target``: ``.<name>.<host>.<pid>.<random>.tmp``."""
    return target.parent / f".{target.name}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


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


def remove_stale_temps(folder: Path) -> None:
    """Delete the stale temporaries (:func:`is_stale_temp`) in ``folder``."""
    if not folder.is_dir():
        return
    for path in folder.glob(".*.tmp"):
        if is_stale_temp(path):
            _remove(path)


@contextmanager
def atomic_path(target: Path, exclusive: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; the caller writes a file or a folder there.
    On success it is fsynced and renamed to ``target`` (replacing it, or with ``exclusive``
    raising :class:`FileExistsError` if ``target`` exists); on failure it is removed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(target)
    try:
        yield tmp
        _fsync_tree(tmp)
        if not exclusive:
            os.replace(tmp, target)
        elif tmp.is_dir():
            try:
                os.rename(tmp, target)  # fails on an existing non-empty folder
            except OSError as err:
                if target.exists():
                    raise FileExistsError(target) from err
                raise
        else:
            os.link(tmp, target)  # raises FileExistsError
        _fsync(target.parent)
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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    if path.is_dir():
        for child in path.rglob("*"):
            if child.is_file():
                _fsync(child)
    _fsync(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)

"""One writer per output folder: a lock file naming its owner (pid, host, start time), stale locks detected.

``train.py`` (``out_dir``), ``python -m core_kv.teacher`` (``out_dir``) and ``eval.py`` (``output_dir``) hold
``<folder>/.core_kv.lock`` while they write; a second run into the same folder is refused with the owner's pid and
host instead of interleaving its files with the first one's, and so is a folder holding another writer's finished
work (a teacher dataset as a training run's ``out_dir``...: their ``config.yaml``/``report.md`` would collide). The lock is created atomically with its content (a
hard link of a written temporary file), removed on exit, and a lock whose process is gone (same host: the pid is not
running, or runs a later process than the one that took it) is stale: it is replaced, with a message.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from core_kv.files import plain_modes

LOCK_NAME = ".core_kv.lock"
# what each writer leaves in its folder: a folder holding another writer's marker is refused (the names collide)
MARKERS = {
    "training run": ("run.json", "a CORE training run"),
    "teacher run": ("manifest.json", "a teacher dataset"),
    "evaluation": ("results.json", "evaluation results"),
}


class FolderLocked(RuntimeError):
    """Another live run writes the folder."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), to tell a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(owner: dict) -> bool:
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user holds that pid: alive
        return True
    started = owner.get("started")
    now = _start_time(pid)
    return started is None or now is None or started == now


def _owner() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": _start_time(os.getpid()),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv)[:300],
    }


def acquire(folder: str | os.PathLike, what: str = "run") -> Path:
    """Take ``folder``'s lock (creating the folder) or raise :class:`FolderLocked` naming the owner; returns the lock
    file. A stale lock (its process is gone, on this host) is replaced with a message on stderr."""
    folder = Path(folder)
    for other, (marker, holds) in MARKERS.items():
        if other != what and (folder / marker).is_file():
            raise FolderLocked(
                f"{folder} holds {holds} ({marker}); this {what} would overwrite files it shares names with "
                "(config.yaml, report.md, metrics.json): use another folder"
            )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    fd, tmp = tempfile.mkstemp(prefix=f"{LOCK_NAME}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({**_owner(), "what": what}, f)
        plain_modes(tmp)  # readable by other users as a plain file (who holds the folder)
        for _ in range(3):
            try:
                os.link(tmp, path)  # atomic: fails if the lock exists
                return path
            except FileExistsError:
                pass
            try:
                owner = json.loads(path.read_text(encoding="utf-8"))
                if not isinstance(owner, dict):
                    raise ValueError("not a JSON object")
            except FileNotFoundError:
                continue  # released meanwhile: try again
            except (OSError, ValueError) as e:
                raise FolderLocked(
                    f"{path}: unreadable lock file ({e}); if no run is writing {folder}, delete it and rerun"
                ) from None
            here = owner.get("host") == socket.gethostname()
            if here and not _alive(owner):
                print(f"[core_kv] {path}: removing the stale lock of pid {owner.get('pid')} (no longer running)",
                      file=sys.stderr)  # fmt: skip
                path.unlink(missing_ok=True)
                continue
            raise FolderLocked(
                f"{folder} is being written by another {owner.get('what', 'run')} (pid {owner.get('pid')} on "
                f"{owner.get('host')}, since {owner.get('since')}: {str(owner.get('command', ''))[:100]!r}); wait for it to "
                f"finish or use another folder" + ("" if here else f"; if that run is gone, delete {path}")
            )
        raise FolderLocked(f"{path}: could not take the lock (it keeps changing); retry")
    finally:
        os.unlink(tmp)


def release(path: Path) -> None:
    """Remove a lock this process holds (another owner's lock is left alone)."""
    try:
        owner = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(owner, dict) and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)


@contextmanager
def folder_lock(folder: str | os.PathLike, what: str = "run"):
    """Hold ``folder``'s lock for the block (see :func:`acquire`)."""
    path = acquire(folder, what)
    try:
        yield path
    finally:
        release(path)


@contextmanager
def main_process_lock(folder: str | os.PathLike, what: str, state):
    """:func:`folder_lock` taken by the main process of ``state`` (an Accelerate ``PartialState``/``Accelerator``);
    every process raises :class:`FolderLocked` when it cannot be taken (so none waits for the others forever)."""
    status, path = [None], None
    if state.is_main_process:
        try:
            path = acquire(folder, what)
            status[0] = "ok"
        except FolderLocked as e:
            status[0] = str(e)
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(status)
    if status[0] != "ok":
        raise FolderLocked(status[0])
    try:
        yield path
    finally:
        if path is not None:
            release(path)

"""Atomic file writes: a reader never sees a half-written checkpoint or result file."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def umask() -> int:
    """The process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_modes(path: str | os.PathLike) -> None:
    """Give ``path`` (a file, or a folder and everything in it) the mode a plain ``open(..., "w")``/``mkdir`` would:
    ``0o666``/``0o777`` less the umask. Temporary files and folders (``mkstemp``, ``mkdtemp``, safetensors'
    writer) are owner-only; renamed into place they would keep that, and another user could not read the result."""
    path, mask = Path(path), umask()
    for p in [path, *(sorted(path.rglob("*")) if path.is_dir() else ())]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` then rename the temporary file onto ``path`` (same directory, so atomic); the file
    gets the mode a plain write would (the umask's, not ``mkstemp``'s owner-only ``0600``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with writing(path):  # a full disk is named as such, with the path
            write(tmp)
            plain_modes(tmp)
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def swap_in(tmp: str | os.PathLike, final: str | os.PathLike, old: str | os.PathLike | None = None) -> Path:
    """Replace the folder ``final`` by the fully written folder ``tmp`` (same parent): the old ``final`` is renamed
    aside to ``old`` (default ``<final>.old``), ``tmp`` renamed into place, then the old one removed. There is no
    moment without a complete folder: an interruption between the two renames leaves the old one at ``old``. The new
    folder gets the modes a plain write would (:func:`plain_modes`)."""
    tmp, final = Path(tmp), Path(final)
    old = Path(old) if old is not None else final.with_name(final.name + ".old")
    plain_modes(tmp)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def save_figure(fig, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Save a matplotlib figure as PNG at ``path``, atomically (:func:`atomic_write`): a reader never sees half a
    plot, and a failed draw leaves the previous one."""
    return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png", bbox_inches="tight"))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    def _write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    return atomic_write(path, _write)


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=True, ensure_ascii=False) + "\n")


def atomic_write_jsonl(path: str | os.PathLike, rows: list[dict]) -> Path:
    return atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL file; a truncated last line (interrupted append) raises a clear error."""
    rows = []
    with open(path, encoding="utf-8") as f:
        try:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: corrupt JSONL line ({e}); delete the file to regenerate it") from e
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}): not a JSONL file") from None
    return rows


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """Read a JSON file; a missing, binary or malformed one raises naming the file (``what`` says what it is)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: {what} not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable {what} ({type(e).__name__}: {e})") from None


def read_json_object(path: str | os.PathLike, what: str, error: type[Exception] = ValueError) -> dict:
    """:func:`read_json` of a file that must hold a JSON object (a config); unreadable or not an object, it raises
    ``error`` naming the file and ``what`` it should be."""
    try:
        stored = read_json(path, what)
    except ValueError as e:
        raise error(str(e)) from None
    if not isinstance(stored, dict):
        raise error(f"{path}: not a {what} (a JSON object), got a {type(stored).__name__}")
    return stored


LOW_SPACE = 64 * 2**20  # bytes: below this, a failed write is taken as a full disk


def _free_bytes(path: Path) -> int | None:
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def disk_full(error: BaseException, path: str | os.PathLike) -> bool:
    """Whether ``error``, raised while writing under ``path``, is a full disk: ``ENOSPC``/``EDQUOT`` (also inside
    safetensors' messages), or any failure when the disk holding ``path`` has under :data:`LOW_SPACE` left (torch's
    writer reports a full disk as ``unexpected pos``)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    if "No space left" in text or "StorageFull" in text or "Disk quota exceeded" in text:
        return True
    free = _free_bytes(Path(path))
    return free is not None and free < LOW_SPACE


@contextmanager
def writing(path: str | os.PathLike, what: str = "file") -> Iterator[None]:
    """Re-raise a write that fails under ``path`` on a full disk as ``OSError(ENOSPC)`` naming ``what`` and the path
    (other errors pass unchanged)."""
    try:
        yield
    except Exception as e:
        if not disk_full(e, path):
            raise
        free = _free_bytes(Path(path))
        raise OSError(
            errno.ENOSPC,
            f"the disk is full: cannot write the {what} {path} ({free if free is not None else '?'} bytes free); free "
            f"some space and rerun the same command (it resumes from the last complete checkpoint) [{type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}]",
        ) from e

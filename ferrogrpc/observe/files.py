"""Writing the observers' files (traces, flight records) into a directory
that other users may also reach, without ever following their links.

[Note: files in a shared directory]
``FERROGRPC_TRACE`` and ``FERROGRPC_FLIGHT_DIR`` often name a directory
under a shared temporary one. Another local user who got there first, and
planted a symlink where the job was about to write, would make the job
overwrite any file its own user can write. So:

- the directory is opened once (:func:`open_directory`) and checked on the
  open descriptor: it must belong to this process's user, and if any user
  may write in it, it must have the sticky bit (then no other user can
  rename or delete what the job wrote). Anything else is an
  :class:`UnsafeDirectoryError` (its callers raise a ConfigError), naming
  the directory and why;
- every file is created relative to that descriptor, with ``O_CREAT |
  O_EXCL | O_NOFOLLOW`` (a name that exists, link or not, is never
  written through), under a fresh random name, then renamed onto its own
  name: a rename over a planted link replaces the link itself;
- an existing file is reopened (appended to, read) with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeDirectoryError(ValueError):
    """A directory that is no place for this process's files: the message
    names it and says why. (Its callers raise it as a ConfigError; this
    module stays free of the package's own names, so that the flight
    recorder, low in every import chain, can use it.)"""


def _refusal(folder: Path, what: str, st: os.stat_result) -> str | None:
    """Why ``folder`` (whose status is ``st``) is no place for this
    process's files; None when it is."""
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        return f"{what} {folder}: not a directory"
    me = os.geteuid()
    if st.st_uid != me:
        return (
            f"{what} {folder}: refused: it belongs to uid {st.st_uid}, not to this "
            f"process's user (uid {me}): its owner could plant links where ferrogrpc writes; "
            "name a directory of your own"
        )
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        return (
            f"{what} {folder}: refused: every user may write in it (mode "
            f"{mode:04o}) and it has no sticky bit, so another user could replace what "
            "ferrogrpc writes there; chmod o-w (or +t) it, or name another"
        )
    return None


def check_directory(path: str | Path, what: str) -> None:
    """Raise :class:`UnsafeDirectoryError` if ``path`` exists and is no
    place for this process's files (see [Note: files in a shared
    directory]); ``what`` names it in the message (the setting it came
    from). A missing directory passes: it is made, and checked, when first
    written."""
    folder = Path(path)
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UnsafeDirectoryError(f"{what} {folder}: cannot be used ({exc.strerror})") from None
    why = _refusal(folder, what, st)
    if why is not None:
        raise UnsafeDirectoryError(why)


def open_directory(path: str | Path, what: str) -> int:
    """A descriptor of the directory ``path`` (made if missing), checked on
    that descriptor (see [Note: files in a shared directory]). The caller
    closes it. Raises :class:`UnsafeDirectoryError` naming the directory and why."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise UnsafeDirectoryError(f"{what} {folder}: cannot be used ({exc.strerror})") from None
    why = _refusal(folder, what, os.fstat(fd))
    if why is not None:
        os.close(fd)
        raise UnsafeDirectoryError(why)
    return fd


@contextlib.contextmanager
def directory(path: str | Path, what: str) -> Iterator[int]:
    """:func:`open_directory`, closed on exit."""
    fd = open_directory(path, what)
    try:
        yield fd
    finally:
        os.close(fd)


def write_new(folder_fd: int, name: str, parts: Iterable[str]) -> None:
    """Write ``parts`` to ``name`` in the directory ``folder_fd``: into a
    fresh file under a random name, then renamed onto ``name`` (a reader
    never sees half a file; a link planted at ``name`` is replaced, never
    followed). Raises OSError; leaves nothing behind when it does."""
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, _CREATE, 0o666, dir_fd=folder_fd)
    try:
        with os.fdopen(fd, "w") as f:
            for part in parts:
                f.write(part)
        os.replace(tmp, name, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder_fd)
        raise


def open_append(folder_fd: int, name: str, *, new: bool) -> TextIO:
    """``name`` in ``folder_fd`` opened to append: created (``new``; it must
    not exist yet) or reopened, never through a link."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    if new:
        flags |= os.O_CREAT | os.O_EXCL
    return os.fdopen(os.open(name, flags, 0o666, dir_fd=folder_fd), "a")


def open_read(folder_fd: int, name: str) -> TextIO:
    """``name`` in ``folder_fd`` opened to read, never through a link."""
    return os.fdopen(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder_fd))


def unlink(folder_fd: int, name: str) -> None:
    """Remove ``name`` from ``folder_fd`` (a link is removed, not followed);
    nothing if it is gone."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=folder_fd)

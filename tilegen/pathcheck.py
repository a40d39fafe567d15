"""Path checks for the command line: one line naming the user's own path and what is wrong.

Commands check their path options when they start, before any compile, capture synthesis or
tuning worker, so a typo costs nothing. Every problem is a `PathError` (an `OSError`) whose text
is the whole line, e.g. ``--out /etc/passwd/x: cannot be created: /etc/passwd is a file, not a
directory``; the CLIs print it and exit with status 2.

A place counts as writable only when a probe file can really be created there (and removed
again): permission bits say nothing when running as root, nor on /proc or a read-only mount.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path


class PathError(OSError):
    """A path the user gave cannot be used; ``str(exc)`` is one line naming it."""

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else Path(path)

    def __str__(self) -> str:  # OSError would format errno/filename instead
        return str(self.args[0])


def _error(path: str | os.PathLike[str], what: str, problem: str) -> PathError:
    shown = os.fspath(path)  # as the user typed it (no expanduser, no normalizing)
    return PathError(f"{what} {shown}: {problem}" if what else f"{shown}: {problem}",
                     path=path)


def blocking_file(path: str | os.PathLike[str]) -> Path | None:
    """The nearest existing ancestor of `path` when it is not a directory (so nothing can be
    created under it), else None."""
    for parent in Path(path).parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def _existing_ancestor(path: Path) -> Path:
    for parent in path.parents:
        if parent.is_dir():
            return parent
    return Path(".")


def cannot_create_in(folder: str | os.PathLike[str]) -> str | None:
    """Why no file can be created in `folder`, or None (a probe file is created and removed)."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".tilegen-probe-")
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return None


def _missing(path: str | os.PathLike[str], what: str) -> PathError:
    """The error for a path that does not exist: under a file, or simply missing."""
    block = blocking_file(Path(path).expanduser())
    if block is not None:
        return _error(path, what, f"{block} is a file, not a directory")
    return _error(path, what, "does not exist")


def readable_file(path: str | os.PathLike[str], what: str = "") -> Path:
    """`path` as a Path if it is a file this process can read; else `PathError`."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise _missing(path, what) from None
    except OSError as exc:
        raise _error(path, what, f"cannot be read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise _error(path, what, "is a directory, not a file")
    try:
        with open(p, "rb"):
            pass
    except OSError as exc:
        raise _error(path, what, f"cannot be read ({exc.strerror or exc})") from None
    return p


def readable_dir(path: str | os.PathLike[str], what: str = "") -> Path:
    """`path` as a Path if it is a directory this process can list; else `PathError`."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise _missing(path, what) from None
    except OSError as exc:
        raise _error(path, what, f"cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise _error(path, what, "is a file, not a directory")
    try:
        os.listdir(p)
    except OSError as exc:
        raise _error(path, what, f"cannot be read ({exc.strerror or exc})") from None
    return p


def capture_dir(path: str | os.PathLike[str], what: str = "--captures") -> Path:
    """`path` as a Path if it is a readable directory holding capture ``.pt`` files."""
    folder = readable_dir(path, what)
    if not any(folder.glob("*.pt")):
        raise _error(path, what, "holds no capture .pt files (or pass 'synthetic')")
    return folder


def sqlite_url_file(url: str) -> Path | None:
    """The file of a ``sqlite:///FILE`` URL (``sqlite:////abs`` is absolute), None for another
    URL or an in-memory database."""
    if not url.startswith("sqlite:///"):
        return None
    name = url.removeprefix("sqlite:///").split("?", 1)[0]
    return Path(name) if name and name != ":memory:" else None


def writable_file(path: str | os.PathLike[str], what: str = "") -> Path:
    """`path` as a Path if a file can be written there (replaced atomically through a temp file
    beside it; missing folders created); else `PathError`. Nothing is left behind."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise _error(path, what, "is a directory; name a file to write")
    block = blocking_file(p)
    if block is not None:
        raise _error(path, what, f"cannot be created: {block} is a file, not a directory")
    if p.exists():
        if not stat.S_ISREG(p.stat().st_mode):
            # replacing a device or FIFO with a regular file is never what was meant
            raise _error(path, what, "is not a regular file")
        if not os.access(p, os.W_OK):
            raise _error(path, what, "cannot be written (no write permission on the file)")
        folder = p.parent
    else:
        folder = _existing_ancestor(p)
    why = cannot_create_in(folder)
    if why is not None:
        raise _error(path, what, f"cannot be written (no file can be created in {folder}: {why})")
    return p


def writable_dir(path: str | os.PathLike[str], what: str = "", *,
                 staging: bool = False) -> Path:
    """`path` as a Path if files can be written into it (created with its parents when
    missing); else `PathError`. ``staging``: the command also creates a folder beside `path`
    (`tilegen build` compiles into one), so its parent must take files too."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise _error(path, what, "is a file, not a directory")
    block = blocking_file(p)
    if block is not None:
        raise _error(path, what, f"cannot be created: {block} is a file, not a directory")
    folders = [p] if p.is_dir() else [_existing_ancestor(p)]
    if staging and p.is_dir() and p.parent != p:
        folders.append(p.parent)
    for folder in folders:
        why = cannot_create_in(folder)
        if why is not None:
            verb = "written into" if p.is_dir() else "created"
            raise _error(path, what, f"cannot be {verb} (no file can be created in {folder}: "
                                  f"{why})")
    return p


def write_error(path: str | os.PathLike[str], exc: OSError, *,
                creating_in: str | os.PathLike[str] | None = None) -> PathError:
    """A `PathError` naming `path`, the file a write was for, for `exc` raised while writing it
    (through a temp file or folder whose name the user never gave). ``creating_in``: the
    folder the failed step was creating that temp file in."""
    p = Path(path)
    if isinstance(exc, PathError):
        return exc
    if p.is_dir():
        return PathError(f"cannot write {p}: it is a directory", path=p)
    block = blocking_file(p)
    if block is not None:
        return PathError(f"cannot write {p}: {block} is a file, not a directory", path=p)
    why = exc.strerror or type(exc).__name__
    if creating_in is not None:
        return PathError(f"cannot write {p} (no file can be created in {creating_in}: {why})",
                         path=p)
    return PathError(f"cannot write {p} ({why})", path=p)



def check_spec_option(args: object) -> None:
    """``--spec``, when given, must be a readable file; shared by every command that takes
    one."""
    if getattr(args, "spec", None):
        readable_file(args.spec, "--spec")  # type: ignore[attr-defined]


def check_captures_option(args: object) -> None:
    """``--captures``: 'synthetic', or a readable directory holding capture .pt files."""
    raw = getattr(args, "captures", None)
    if raw and raw != "synthetic":
        capture_dir(raw, "--captures")


__all__ = [
    "PathError",
    "blocking_file",
    "cannot_create_in",
    "capture_dir",
    "check_captures_option",
    "check_spec_option",
    "readable_dir",
    "readable_file",
    "sqlite_url_file",
    "writable_dir",
    "writable_file",
    "write_error",
]

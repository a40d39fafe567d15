"""Opening the tuning DB file: where it is, whether it is one, read-only or read-write.

- **Where**: an explicit path (the CLI's ``--db``), else ``$TILEGEN_DB``, else
  ``$XDG_CACHE_HOME/tilegen/tuning.sqlite`` (``~/.cache/tilegen/tuning.sqlite``).
- **Whether it is one**: `inspect_file` reads the first 100 bytes and the size *before* SQLite
  opens anything, so a text file, random bytes or a truncated copy is reported in one line
  naming the path and the cause (`TuningDBError`), and is never written to.
- **Read-only** (`make_engine(..., readonly=True)`): SQLite URI ``mode=ro``; no pragma that
  writes (no WAL switch) runs on connect. A WAL file on a read-only mount cannot create its
  ``-shm`` index, so `open_readonly` falls back to ``immutable=1`` (SQLite then reads the file
  as a snapshot without locks).
- **Read-write**: `check_writable` first (a regular file above the path is a `TuningDBError`
  naming the path and the setting it came from, ``--db`` or ``TILEGEN_DB``; a read-only mount,
  a file without write permission or a folder where no file can be created is a
  `DBReadOnlyError` naming the path); then WAL, ``busy_timeout``, ``BEGIN IMMEDIATE`` for
  write transactions (two writers queue on the busy handler instead of failing on a lock
  upgrade) and a retry with backoff on "database is locked".
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, OperationalError

from tilegen.db.errors import DBReadOnlyError, TuningDBError
from tilegen.pathcheck import blocking_file, cannot_create_in

DB_FILENAME = "tuning.sqlite"
DB_ENV_VAR = "TILEGEN_DB"
DEFAULT_BUSY_TIMEOUT_MS = 30_000
SQLITE_MAGIC = b"SQLite format 3\x00"
#: execution option marking a write transaction (BEGIN IMMEDIATE)
WRITE_OPTION = "tilegen_write"


def default_db_path() -> Path:
    """``$XDG_CACHE_HOME/tilegen/tuning.sqlite``, else ``~/.cache/tilegen/tuning.sqlite``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tilegen" / DB_FILENAME


def resolve_db_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The DB file to use: ``path`` if given, else ``$TILEGEN_DB``, else ``default_db_path()``."""
    if path is not None and str(path) != "":
        return Path(path).expanduser()
    env = os.environ.get(DB_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return default_db_path()


def db_setting(path: str | os.PathLike[str] | None = None) -> str:
    """Which setting names the DB file `resolve_db_path(path)` gives: ``"--db"``,
    ``"TILEGEN_DB"`` or ``""`` (the default path), for error messages."""
    if path is not None and str(path) != "":
        return "--db"
    return DB_ENV_VAR if os.environ.get(DB_ENV_VAR) else ""


def _guess_setting(path: Path) -> str:
    env = os.environ.get(DB_ENV_VAR)
    return DB_ENV_VAR if env and Path(env).expanduser() == path else ""


def check_location(path: Path, setting: str | None = None) -> None:
    """Raise `TuningDBError` when no DB file can ever be at `path`: a regular file above it
    (SQLite and mkdir would only say "[Errno 17] File exists" about that file). ``setting``
    (``"--db"``, ``"TILEGEN_DB"``; None: TILEGEN_DB when it names `path`) is named too."""
    block = blocking_file(path)
    if block is None:
        return
    setting = _guess_setting(path) if setting is None else setting
    where = f" (the path comes from {setting})" if setting else ""
    raise TuningDBError(path, f"{block} is a file, not a directory, so no DB file can be "
                              f"under it{where}")


def _describe(head: bytes) -> str:
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return "binary data"
    if any(ord(c) < 32 and c not in "\t\r\n" for c in text):
        return "binary data"
    first = text.strip().splitlines()[0][:40] if text.strip() else ""
    return f"text ({first!r} ...)" if first else "blank text"


def inspect_file(path: Path) -> None:
    """Raise `TuningDBError` unless `path` is (the start of) a whole SQLite file.

    Reads only: the first 100 bytes (the SQLite header) and the size. Checks the magic string,
    the page size, and that the file holds every page the header counts (a truncated copy does
    not). A missing file is not checked here (callers decide whether to create one).
    """
    try:
        size = path.stat().st_size
        if path.is_dir():
            raise TuningDBError(path, "is a directory, not a SQLite file")
        with open(path, "rb") as f:
            head = f.read(100)
    except TuningDBError:
        raise
    except OSError as exc:
        raise TuningDBError(path, f"cannot read it ({exc.strerror or exc})") from None
    if size == 0:
        raise TuningDBError(path, "empty file (0 bytes), not a SQLite database; left untouched")
    if not head.startswith(SQLITE_MAGIC):
        raise TuningDBError(path, f"not a SQLite database (the file holds {_describe(head)}, "
                                  f"{size} bytes); left untouched")
    if len(head) < 100:
        raise TuningDBError(path, f"truncated SQLite file ({size} bytes, shorter than its "
                                  "100-byte header); left untouched")
    page = int.from_bytes(head[16:18], "big")
    page = 65536 if page == 1 else page  # SQLite's encoding; not a hardware fact
    if page < 512 or page & (page - 1):
        raise TuningDBError(path, f"damaged SQLite header (page size {page}); left untouched")
    pages = int.from_bytes(head[28:32], "big")
    valid = head[24:28] == head[92:96]  # "in-header database size" is valid (SQLite >= 3.7.0)
    wal = Path(f"{path}-wal")
    if size % page or (valid and pages and size < pages * page and not wal.exists()):
        raise TuningDBError(path, f"truncated SQLite file ({size} bytes; its header counts "
                                  f"{pages} pages of {page} bytes); left untouched")


def _readonly_reason(path: Path) -> str | None:
    """Why `path` (or the folder it would be created in) cannot be written, or None."""
    probe = path if path.exists() else path.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        if os.statvfs(probe).f_flag & os.ST_RDONLY:
            return "read-only file system"
    except OSError:
        pass
    if path.exists() and not os.access(path, os.W_OK):
        return "no write permission on the file"
    # WAL needs to create <db>-wal and <db>-shm next to the file.
    folder = probe if probe.is_dir() else probe.parent
    if not os.access(folder, os.W_OK):
        return f"no write permission on {folder}"
    # Permission bits say nothing as root or on /proc: only creating a file tells.
    why = cannot_create_in(folder)
    if why is not None:
        return f"no file can be created in {folder}: {why}"
    return None


def check_writable(path: Path, setting: str | None = None) -> None:
    """Raise `TuningDBError` when a write command cannot write the DB at `path`: a regular
    file above it (`check_location`), or `DBReadOnlyError` for a read-only place."""
    check_location(path, setting)
    reason = _readonly_reason(path)
    if reason is not None:
        raise DBReadOnlyError(path, f"is read-only ({reason}); this command writes to the DB: "
                                    "point --db or TILEGEN_DB at a writable file")


def make_engine(path: Path, *, readonly: bool, immutable: bool = False,
                busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS) -> Engine:
    """A SQLAlchemy engine on `path`: read-only (``mode=ro``, or ``immutable=1``) or
    read-write (WAL, NORMAL sync). Connections are opened lazily."""
    if readonly:
        flag = "immutable=1" if immutable else "mode=ro"
        url = f"sqlite+pysqlite:///file:{quote(str(path))}?{flag}&uri=true"
    else:
        url = f"sqlite+pysqlite:///{path}"
    engine = create_engine(url)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control from the sqlite3 module (it would BEGIN lazily and run DDL
        # outside transactions); "_on_begin" emits BEGIN itself.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        # busy_timeout first: switching to WAL needs a lock another process may hold.
        cur.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        cur.execute("PRAGMA foreign_keys = ON")
        if not readonly:
            cur.execute("PRAGMA journal_mode = WAL")
            # In WAL mode NORMAL is corruption-safe; it only risks the last commits on power
            # loss.
            cur.execute("PRAGMA synchronous = NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        write = conn.get_execution_options().get(WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write and not readonly else "BEGIN")

    return engine


def is_locked(exc: BaseException) -> bool:
    """True for SQLite's "database is locked / busy" (retry the transaction)."""
    orig = getattr(exc, "orig", None)
    msg = str(orig if orig is not None else exc).lower()
    return "database is locked" in msg or "database is busy" in msg or "table is locked" in msg


def translate(exc: BaseException, path: Path) -> TuningDBError | None:
    """The `TuningDBError` for a driver error about the file itself, or None for others."""
    orig = getattr(exc, "orig", None) if isinstance(exc, DBAPIError) else exc
    msg = str(orig if orig is not None else exc)
    low = msg.lower()
    if "readonly database" in low or "read-only" in low or (
            isinstance(orig, OSError) and orig.errno == errno.EROFS):
        return DBReadOnlyError(path, f"is read-only ({msg}); this command writes to the DB")
    if any(m in low for m in ("file is not a database", "malformed", "disk image",
                              "unable to open database file", "disk i/o error",
                              "file is encrypted")):
        return TuningDBError(path, f"cannot be read by SQLite ({msg})")
    return None


__all__ = [
    "DB_ENV_VAR",
    "DB_FILENAME",
    "DEFAULT_BUSY_TIMEOUT_MS",
    "WRITE_OPTION",
    "OperationalError",
    "check_location",
    "check_writable",
    "db_setting",
    "default_db_path",
    "inspect_file",
    "is_locked",
    "make_engine",
    "resolve_db_path",
    "translate",
]

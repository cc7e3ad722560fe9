"""Where an Optuna study lives: a SQLite file, a journal file or a database URL, opened for many workers.

    storage = open_storage("study.db")   # or study.log, sqlite:///..., postgresql://..., mysql://...

Several `planner tune` processes share one study through it (docs/tune.md, "Storage, resuming and
several workers"); `planner report --storage` reads one.
"""
from __future__ import annotations

from pathlib import Path

from planner.errors import UserError


def open_storage(url: str):
    """An Optuna storage from a URL or a file path.

    '*.db' / '*.sqlite' paths become SQLite; '*.log' / '*.journal' / '*.jsonl' paths a journal
    file (safe for many processes on one machine or a shared file system); anything with '://'
    (sqlite:///, postgresql://, mysql://) is handed to Optuna as it is.
    """
    import optuna

    if "://" in url:
        if url.startswith("sqlite:///"):
            Path(url[len("sqlite:///"):]).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
        try:
            return _rdb_storage(url)
        except (ImportError, ModuleNotFoundError) as e:
            raise UserError(f"--storage {url}: the database driver is not installed ({e})") from None
        except Exception as e:  # sqlalchemy errors: bad URL, unreachable server
            raise UserError(f"--storage {url}: cannot open ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    path = Path(url).expanduser()
    suffix = path.suffix.lower()
    path.resolve().parent.mkdir(parents=True, exist_ok=True)
    if suffix in (".db", ".sqlite", ".sqlite3"):
        return open_storage(f"sqlite:///{path.resolve()}")
    if suffix in (".log", ".journal", ".jsonl"):
        from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

        return optuna.storages.JournalStorage(JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path))))
    raise UserError(f"--storage {url}: expected a URL (sqlite:///FILE, postgresql://...) or a .db or .log file")


def _rdb_storage(url: str, attempts: int = 6):
    """RDBStorage, retried: workers started together race to create the schema of a new database."""
    import time

    import optuna
    from sqlalchemy.exc import IntegrityError, OperationalError

    for i in range(attempts):
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url))
            break
        except (OperationalError, IntegrityError):
            if i == attempts - 1:
                raise
            time.sleep(0.3 * (i + 1))
    if storage.engine.dialect.name == "sqlite" and storage.engine.url.database not in (None, "", ":memory:"):
        _begin_immediate(storage.engine)  # a file other processes may share (in memory: this process alone)
    return storage


def _begin_immediate(engine) -> None:
    """Every transaction on this SQLite engine takes the write lock when it begins.

    Optuna hands each waiting (enqueued) trial to one worker by reading it WAITING and setting it
    RUNNING in one transaction under SELECT ... FOR UPDATE, which SQLite ignores; and Python's sqlite3
    begins a transaction only at the first write. So two workers could both read a trial WAITING, both
    run it, and the second to finish failed with "Cannot tell a COMPLETE trial". BEGIN IMMEDIATE makes
    the read and the write one step across processes (the others wait, up to the connect timeout)."""
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _driver_autocommit(dbapi_connection, _record):
        dbapi_connection.isolation_level = None  # the driver's own deferred BEGIN off: ours below

    @event.listens_for(engine, "begin")
    def _begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections pooled while the schema was made predate the hook


def _engine_kwargs(url: str) -> dict:
    # Several worker processes on one SQLite file: wait for the lock instead of failing at once.
    return {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}

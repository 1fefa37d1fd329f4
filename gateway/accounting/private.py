"""State files only the gateway's own user can read: the state directory 0700, its files 0600.

The idempotency store keeps whole response bodies and the usage table says who asked what and
when, so neither may be readable by other users of the machine, whatever the umask. A database
is created 0600 before SQLite opens it (the directory 0700 by ``StateConfig.path``); SQLite gives
the ``-wal`` and ``-shm`` files it creates later the database's own mode. Files or a directory
left wider by an older version or by hand are tightened at start-up, with one warning line each
(a name and a mode, nothing they hold).
"""

from __future__ import annotations

import logging
import os
import stat

log = logging.getLogger("ferry.state")

DIR_MODE = 0o700
FILE_MODE = 0o600
SQLITE_COMPANIONS = ("", "-wal", "-shm", "-journal")  # the database and the files SQLite keeps beside it


def private_database(path: str) -> str:
    """Make a SQLite database at ``path`` private before it is opened: its directory (which must
    exist) 0700, the database (created empty if missing) and any companion file 0600. Returns
    ``path``."""
    _tighten(os.path.dirname(os.path.abspath(path)), DIR_MODE)
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT, FILE_MODE))  # a new file is born private
    for suffix in SQLITE_COMPANIONS:
        if os.path.exists(path + suffix):
            _tighten(path + suffix, FILE_MODE)
    return path


def _tighten(path: str, mode: int) -> None:
    current = stat.S_IMODE(os.stat(path).st_mode)
    if current & ~mode:
        os.chmod(path, current & mode)
        log.warning(
            "state %s had mode %04o, readable by others: tightened to %04o", path, current, current & mode
        )

"""Directories made once per test run, whichever pytest-xdist worker asks first.

A plain module (tests/ is on sys.path): conftest.py and export_fixtures.py build their
costliest session fixtures (the tiny trained run, its exports) with it.
"""

import fcntl
import os
import shutil


def made_once(tmp_path_factory, name, make):
    """A directory `make(directory)` filled, made once for all of a test run's workers.

    Session fixtures are per process: under pytest-xdist each worker would train or
    export its own copy. The workers share the directory above their own temporary
    directories; the first to take `name`'s lock makes `name` there, the others wait
    for the lock and reuse what it made. A make that fails is not marked done: the
    next worker to ask starts afresh. Treat the directory as read-only.
    """
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        directory = tmp_path_factory.mktemp(name, numbered=False)
        make(directory)
        return directory
    root = tmp_path_factory.getbasetemp().parent
    directory, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # Released when the file closes.
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            make(directory)
            done.touch()
    return directory

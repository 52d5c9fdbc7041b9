"""The lock around a model's conversion into the cache (models/cache.py): a wait with a bound and an error
naming the lock, only for a lock another process holds; a cache that cannot be written named at once, whatever
the lock library makes of a lock file it cannot open (these tests may run as root, whom a permission does not stop:
the file system's refusal is simulated where it is not real)."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import time

import pytest

from grpo_lightning.models import cache as sources


def test_a_lock_held_by_another_process_stops_the_wait_naming_it(tmp_path, monkeypatch, caplog):
    target = tmp_path / "model"
    holder = subprocess.Popen(  # another process converting, for longer than the bound
        [sys.executable, "-c", f"import time; from filelock import FileLock; l = FileLock({str(target)!r} + '.lock');"
         " l.acquire(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(sources, "CONVERSION_LOCK_TIMEOUT_S", 2)
        start = time.monotonic()
        stayed = r"paths.cache_dir: .*model.lock stayed locked for 2 s by another"
        with caplog.at_level(logging.INFO, logger=sources.__name__), pytest.raises(ValueError, match=stayed):
            sources.acquire_conversion_lock(target)
        assert time.monotonic() - start < 15
        assert "another process is converting this model" in caplog.text  # true here: it is held
    finally:
        holder.kill()
        holder.wait()
    sources.acquire_conversion_lock(target).release()  # released with its holder: taken at once


class LooksHeld:
    """A lock that never comes free, as a lock file one may not open looks to the lock library on some versions and
    platforms (it retries): code that asked it first would wait its whole bound."""

    acquired = 0

    def __init__(self, lock_file: str) -> None:
        self.lock_file = lock_file

    def acquire(self, timeout: float) -> None:
        LooksHeld.acquired += 1
        time.sleep(min(timeout, 1))
        raise sources.Timeout(self.lock_file)


def refuse_writes(monkeypatch, under, error: int) -> None:
    """Every open for writing or creating of a path under `under` fails with `error` (EROFS: a read-only file system;
    EACCES: no write permission), as the kernel answers a user it stops."""
    real_open = os.open

    def opened(path, flags, *args, **kwargs):
        if str(path).startswith(str(under)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(error, os.strerror(error), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", opened)


@pytest.mark.parametrize(("error", "words"), [(errno.EROFS, "Read-only file system"), (errno.EACCES, "Permission")])
def test_a_cache_that_cannot_be_written_is_named_at_once(tmp_path, monkeypatch, caplog, error, words):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setattr(sources, "FileLock", LooksHeld)
    monkeypatch.setattr(sources, "CONVERSION_LOCK_TIMEOUT_S", 30)
    LooksHeld.acquired = 0
    refuse_writes(monkeypatch, cache, error)
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger=sources.__name__), pytest.raises(ValueError) as err:
        sources.acquire_conversion_lock(cache / "model")
    message = str(err.value)
    assert message.startswith(f"paths.cache_dir: {cache} is not writable ({words}")
    assert "GRPO_LIGHTNING_CACHE" in message and "\n" not in message
    assert time.monotonic() - start < 5 and LooksHeld.acquired == 0  # no wait: the lock was never asked
    assert "another process" not in caplog.text + message


def test_a_lock_file_that_cannot_be_opened_is_named_at_once(tmp_path, monkeypatch, caplog):
    """A lock file left by another user (the folder writable, the file not): named, not waited on as held."""
    (tmp_path / "model.lock").write_text("")
    monkeypatch.setattr(sources, "FileLock", LooksHeld)
    monkeypatch.setattr(sources, "CONVERSION_LOCK_TIMEOUT_S", 30)
    LooksHeld.acquired = 0
    refuse_writes(monkeypatch, tmp_path / "model.lock", errno.EACCES)
    start = time.monotonic()
    unwritable = r"^paths.cache_dir: .*model.lock is not writable \(Permission denied\)"
    with caplog.at_level(logging.INFO, logger=sources.__name__), pytest.raises(ValueError, match=unwritable):
        sources.acquire_conversion_lock(tmp_path / "model")
    assert time.monotonic() - start < 5 and LooksHeld.acquired == 0
    assert "another process" not in caplog.text


def test_a_cache_under_a_file_is_named_at_once(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match=r"^paths.cache_dir: cannot create .*a_file.* GRPO_LIGHTNING_CACHE"):
        sources.acquire_conversion_lock(blocker / "cache" / "model")
    assert blocker.read_text() == "not a folder"

"""The lock around a model's conversion into the cache (models/sources.py): a wait with a bound and an error
naming the lock, and a cache that cannot be written named before any wait."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from grpo_lightning.models import cache as sources


def test_a_lock_held_by_another_process_stops_the_wait_naming_it(tmp_path, monkeypatch):
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
        with pytest.raises(ValueError, match=r"paths.cache_dir: .*model.lock stayed locked for 2 s"):
            sources.acquire_conversion_lock(target)
        assert time.monotonic() - start < 15
    finally:
        holder.kill()
        holder.wait()
    sources.acquire_conversion_lock(target).release()  # released with its holder: taken at once


def test_a_cache_that_cannot_be_written_is_named_before_any_wait(tmp_path, monkeypatch):
    monkeypatch.setattr(sources.os, "access", lambda path, mode: False)  # (root may write anywhere: simulated)
    with pytest.raises(ValueError, match=r"paths.cache_dir: .* is not writable; set paths.cache_dir"):
        sources.acquire_conversion_lock(tmp_path / "model")

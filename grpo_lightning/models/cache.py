"""Converted models kept in `paths.cache_dir`: written once, checked at each use, rebuilt when found damaged.

An entry is a `save_pretrained` folder that a conversion writes into `<name>.tmp-<pid>`, syncs to disk, and
renames into place, all under a file lock beside it: readers see either no folder or a complete one, two
processes starting at once convert once, and a crash cannot leave a renamed folder whose data never reached the
disk. Each use checks the entry's structure (models/integrity.py: the safetensors headers against the file sizes,
the JSON files parse; milliseconds, where a checksum of the weights would cost a second on every run); an entry
found damaged (a disk fault, a file cut short by hand or by a copy) is removed and converted again from its
source, with one warning saying so, and one damaged again right after that is an error naming the file.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from contextlib import contextmanager, suppress
from pathlib import Path

from filelock import FileLock, Timeout

from grpo_lightning.errors import RunInterrupted
from grpo_lightning.models.integrity import DamagedFile, check_saved_folder

log = logging.getLogger(__name__)

CONVERSION_LOCK_TIMEOUT_S = 900
"""How long a process waits for another one converting the same model (the embedded one takes well under a
minute) before it stops naming the lock."""
FIX = "set paths.cache_dir or GRPO_LIGHTNING_CACHE to a writable directory"


def ensure_cached(target: Path, write: Callable[[Path], None], origin: str) -> Path:
    """`target`, a whole entry: as found, else written by `write(folder)` (a complete `save_pretrained` folder,
    converted from `origin`, the file named in messages). A damaged entry is rebuilt once (module docstring);
    a first conversion is checked at its next use."""
    if whole_without_lock(target):
        return target
    lock = acquire_conversion_lock(target)
    try:
        found = damage(target) if target.exists() else None
        if target.exists() and found is None:
            return target  # another process converted it while this one waited for the lock
        for stale in target.parent.glob(f"{target.name}.tmp-*"):  # a killed conversion's leftovers
            shutil.rmtree(stale, ignore_errors=True)  # (we hold the lock: nobody else writes one now)
        if found is None:
            write_entry(target, write)
        else:
            rebuild(target, write, origin, found)
    finally:
        lock.release()
    return target


def whole_without_lock(target: Path) -> bool:
    """Whether the entry is whole, asked without the lock: another process may be moving a damaged entry aside
    while this one reads it (a file that vanishes mid-check); the answer is then no, and the caller asks again
    under the lock, where nobody writes."""
    try:
        return target.is_dir() and damage(target) is None
    except FileNotFoundError:
        return False


def damage(target: Path) -> DamagedFile | None:
    """What is wrong with the entry `target`, or None when it is whole."""
    try:
        check_saved_folder(target)
    except DamagedFile as err:
        return err
    return None


def rebuild(target: Path, write: Callable[[Path], None], origin: str, found: DamagedFile) -> None:
    """Replace the damaged entry `target` by a new conversion of `origin`; a failure is one line naming the file."""
    log.warning("%s: %s; converting %s into %s again", found.path, found.reason, origin, target)
    discard(target)
    try:
        write_entry(target, write)
    except Exception as err:
        if isinstance(err, ValueError) and str(err).startswith(("model.", "paths.")):  # ours: names its key
            raise
        reason = str(err).splitlines()[0] if str(err) else ""
        raise ValueError(
            f"paths.cache_dir: {found.path} was damaged ({found.reason}) and converting {origin} again failed "
            f"({type(err).__name__}: {reason}); free space under {target.parent}, or {FIX}"
        ) from None
    again = damage(target)
    if again is not None:
        raise ValueError(
            f"paths.cache_dir: {again.path} is damaged again right after converting {origin} anew ({again.reason});"
            f" the disk under {target.parent} may be failing: {FIX} on another disk"
        )


def discard(target: Path) -> None:
    """Move the entry out of the way at once (a rename: a reader finds no folder, then waits for the lock), then
    delete it; a delete cut short leaves a `.tmp-` folder that the next conversion removes."""
    trash = target.with_name(f"{target.name}.tmp-damaged-{os.getpid()}")
    os.replace(target, trash)
    if trash.is_dir():
        shutil.rmtree(trash, ignore_errors=True)
    else:
        trash.unlink(missing_ok=True)


def write_entry(target: Path, write: Callable[[Path], None]) -> None:
    with removed_on_signal(target.with_name(f"{target.name}.tmp-{os.getpid()}")) as tmp:
        shutil.rmtree(tmp, ignore_errors=True)
        write(tmp)
        sync_folder(tmp)
        os.replace(tmp, target)  # atomic: readers see either nothing or a complete folder
        sync_folder(target.parent, files=False)


def sync_folder(folder: Path, files: bool = True) -> None:
    """Flush `folder`'s files (when `files`) and its directory entries to the disk (a rename is only durable
    after its data is)."""
    for path in [p for p in folder.iterdir() if p.is_file()] if files else []:
        with path.open("rb") as file:
            os.fsync(file.fileno())
    with suppress(OSError):  # a platform that cannot open a directory (Windows) syncs it with its files
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def acquire_conversion_lock(target: Path) -> FileLock:
    """The lock beside the converted folder `target`, held. A cache that cannot be written (a folder without write
    permission, a read-only file system, a lock file of another user) is one error naming `paths.cache_dir` at
    once, found by writing there (`check_writable`), since `os.access` answers for root what root may do and some
    filelock versions take a lock file they may not open for one held by another process. Only a lock that another
    process holds is waited on (saying so), at most CONVERSION_LOCK_TIMEOUT_S."""
    lock_file = target.with_name(f"{target.name}.lock")
    check_writable(target.parent, lock_file)
    lock = FileLock(str(lock_file))
    try:
        lock.acquire(timeout=1)
        return lock
    except Timeout:
        check_writable(target.parent, lock_file)  # a lock file another process created meanwhile, checked too
        log.info("waiting for %s: another process is converting this model", lock.lock_file)
    except OSError as err:
        raise ValueError(f"paths.cache_dir: cannot lock {lock.lock_file} ({err.strerror}); {FIX}") from None
    try:
        lock.acquire(timeout=CONVERSION_LOCK_TIMEOUT_S)
    except Timeout:
        raise ValueError(
            f"paths.cache_dir: {lock.lock_file} stayed locked for {CONVERSION_LOCK_TIMEOUT_S} s by another process; "
            f"if no process converts this model, remove {lock.lock_file}, or {FIX}"
        ) from None
    return lock


def check_writable(folder: Path, lock_file: Path | None = None) -> None:
    """Raise one line naming `paths.cache_dir` unless a file can be created in `folder` (created when missing) and
    the existing `lock_file`, where given, opened for writing: the operations a conversion needs, tried."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"paths.cache_dir: cannot create {folder} ({err.strerror}); {FIX}") from None
    path = folder
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=folder)
        os.close(fd)
        os.unlink(probe)
        if lock_file is not None and lock_file.exists():
            path = lock_file
            os.close(os.open(lock_file, os.O_RDWR))
    except OSError as err:
        raise ValueError(f"paths.cache_dir: {path} is not writable ({err.strerror}); {FIX}") from None


@contextmanager
def removed_on_signal(tmp: Path):
    """Yield `tmp`; remove it if the block fails or is interrupted, SIGTERM included.

    Python's default SIGTERM handling ends the process without unwinding, which used to leave a half-written
    470 MB `<name>.tmp-<pid>` folder in the cache. Here SIGTERM raises RunInterrupted (the CLI exits 143), so the
    folder is removed first; a SIGKILL's leftovers are removed by the next conversion.
    """

    def on_sigterm(signum, frame):
        raise RunInterrupted(signum, f"interrupted while converting the model into {tmp.parent}; nothing was kept")

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main else None
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)

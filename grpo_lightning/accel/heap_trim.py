"""Hand memory that Python and PyTorch have freed back to the operating system between phases of a round.

glibc keeps freed heap memory for reuse, and a phase's freed blocks are scattered among live ones, so the
process's resident size after a training round stays near its peak (~2 GB here) even though ~1 GB is live.
The next phase (generation, with its merged and packed weights) then adds its own memory on top of that
retained memory, and the run's peak RSS climbs from round to round. `malloc_trim(0)` returns every free page
(tens of ms); with it at the two phase boundaries a 4-round benchmark run peaked at 2.49 GB instead of 2.98 GB,
for 0.3-0.5 s per round of page faults when the next phase takes the pages again (benchmarks/README.md).
Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): no malloc_trim
        return None


def release_freed_memory() -> bool:
    """Return freed heap pages to the OS; True where glibc's `malloc_trim` ran."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True

"""release_freed_memory hands freed heap pages back to the OS (measured by the process's resident size)."""

from pathlib import Path

import pytest
import torch

from grpo_lightning.accel.heap_trim import _malloc_trim, release_freed_memory


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(_malloc_trim() is None or not Path("/proc/self/status").exists(), reason="needs glibc + /proc")
def test_freed_heap_blocks_leave_the_resident_set():
    blocks = [torch.ones(16 * 1024) for _ in range(8000)]  # 8000 x 64 KiB = 500 MiB of heap (below mmap size)
    keep = blocks[::50]  # a few live blocks scattered through the heap: nothing trims from its top alone
    del blocks
    before = rss_mb()
    assert release_freed_memory()
    after = rss_mb()
    assert before - after > 200, (before, after)
    assert all(float(b[0]) == 1.0 for b in keep)  # live memory untouched

"""What this machine has for a run: one GPU's memory and the RAM this process may use (the plan checks its
estimate against them, app/memory.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def gpu_memory() -> int | None:
    """Total bytes of one visible CUDA GPU (the first: a run's GPUs are taken to be alike), None without one."""
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def machine_memory() -> int:
    """Bytes of RAM this process may use: the cgroup's limit where one is set, else the machine's."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(int(text), physical)
    return physical

"""Shared by the disk benchmarks (checkpoint.py, spill.py)."""

import os
import time


def drop_caches() -> bool:
    """Writes dirty pages back and drops the page cache (root only); False
    if it could not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed_write(path: str, data) -> float:
    """Seconds to write `data` (a buffer) to a new file at `path` and fsync
    it: the disk's write limit the benchmarks compare against."""
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(data).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t


def timed_read(path: str) -> float:
    """Seconds to read the file at `path` to its end (64 MiB at a time)."""
    t = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    return time.perf_counter() - t

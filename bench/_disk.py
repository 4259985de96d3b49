"""Shared by the disk benchmarks (checkpoint.py, spill.py)."""

import os


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

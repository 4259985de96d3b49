"""Process memory readings shared by the benchmark programs (Linux)."""


def status(pid):
    """{"VmRSS": bytes, "VmHWM": bytes} of process `pid`."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out


def reset_peak(pid):
    """Resets VmHWM (the peak RSS) of process `pid` to its current RSS."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")

"""bench/pgo_train.py, the training run of the wheel's profile-guided
build (`cargo xtask wheel`), against the real stowd and plugins: it must
run every part, check what it reads back, and stop each stowd cleanly
(an instrumented stowd writes its profile only on a clean exit)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "pgo_train.py"
PLUGINS = REPO / "target" / "plugins"


def run(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_the_training_run_drives_every_part_and_stops_stowd_cleanly(stowd_bin):
    if not any(PLUGINS.glob("*.wasm")):
        pytest.fail(f"no plugins in {PLUGINS}: build them with `cargo xtask plugins`")
    out = run("--stowd", stowd_bin, "--plugins", PLUGINS, "--scale", "0.05")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert f"pgo_train: the client from {REPO / 'clients' / 'python' / 'stowage'}" in lines
    for part in ("bundled plugins", "built-in", "same node"):
        assert any(line.startswith(f"pgo_train: {part}: ") and line.endswith(" calls") for line in lines), lines
    # With each policy: 9 shapes x 5 calls x 3 (put, get, get_into), 9 clears and a stats;
    # 2 row widths x (3 rounds x 3 calls + a clear); 4 async shapes x (5 x 2 calls + a clear).
    # Same node: a put, 4 gets of all rows and 200 small ones.
    assert lines[-1].startswith("pgo_train: ") and " calls in " in lines[-1]
    total = int(lines[-1].split()[1])
    assert total == 2 * (9 * 5 * 3 + 9 + 1 + 2 * (3 * 3 + 1) + 4 * (5 * 2 + 1)) + 1 + 4 + 200


def test_a_stowd_that_does_not_start_is_an_error_not_a_profile(tmp_path):
    fake = tmp_path / "stowd"
    fake.write_text("#!/bin/sh\necho 'no such config' >&2\nexit 3\n")
    os.chmod(fake, 0o755)
    out = run("--stowd", fake, "--plugins", PLUGINS, "--scale", "0.05", timeout=120)
    assert out.returncode != 0
    assert "stowd did not start" in out.stderr and "no such config" in out.stderr, out.stderr


def test_a_client_directory_without_the_package_is_refused(stowd_bin, tmp_path):
    out = run("--stowd", stowd_bin, "--plugins", PLUGINS, "--client-dir", tmp_path, timeout=120)
    assert out.returncode != 0
    assert f"no stowage package in {tmp_path}" in out.stderr, out.stderr

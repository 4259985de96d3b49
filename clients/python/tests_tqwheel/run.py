"""Runs TransferQueue 0.1.11's own wheel tests that go through a storage unit
against stowd (see README.md here):

    $TQ_VENV/bin/python clients/python/tests_tqwheel/run.py                    # --backend units
    $TQ_VENV/bin/python clients/python/tests_tqwheel/run.py --backend native   # the Stowage adapter

Extra arguments go to pytest (`-k lifecycle`, `-x`, `-v`, ...). The tests run
from the installed wheel's `tests/` folder, unmodified; `tqwheel_plugin`
swaps the storage. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE_ROOT = HERE.parent  # clients/python
REPO = PACKAGE_ROOT.parents[1]


def wheel_tests() -> Path:
    import transfer_queue

    path = Path(transfer_queue.__file__).resolve().parent.parent / "tests"
    if not (path / "test_simple_storage_unit.py").is_file():
        sys.exit(f"TransferQueue's wheel tests not found at {path} (transferqueue 0.1.11 ships them)")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["units", "native"], default="units",
                    help="units: stowd units stand in for SimpleStorageUnit (default); "
                         "native: transfer_queue.init() gets the Stowage backend (stowage/1)")
    ap.add_argument("--stowd", help="stowd binary (default: $STOWD_BIN, else target/debug/stowd)")
    ap.add_argument("--workdir", help="where stowd logs and endpoints files go (default: a temporary directory)")
    args, pytest_args = ap.parse_known_args()

    sys.path.insert(0, str(HERE))
    from tqwheel_plugin import FILES

    tests = wheel_tests()
    env = dict(os.environ)
    env["TQWHEEL_BACKEND"] = args.backend
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(PACKAGE_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["TQWHEEL_WORKDIR"] = args.workdir or tempfile.mkdtemp(prefix="tqwheel-")
    Path(env["TQWHEEL_WORKDIR"]).mkdir(parents=True, exist_ok=True)
    if args.stowd:
        env["STOWD_BIN"] = str(Path(args.stowd).resolve())
    env.setdefault("STOWD_BIN", str(REPO / "target" / "debug" / "stowd"))
    if not os.access(env["STOWD_BIN"], os.X_OK):
        sys.exit(f"stowd not found at {env['STOWD_BIN']}: cargo build -p stowage-host (and cargo xtask plugins)")
    cmd = [sys.executable, "-m", "pytest", "-p", "tqwheel_plugin", "-p", "no:cacheprovider",
           "--rootdir", str(tests), "-rfEs", *[str(tests / f) for f in FILES[args.backend]], *pytest_args]
    print(f"tqwheel: backend={args.backend} stowd={env['STOWD_BIN']} workdir={env['TQWHEEL_WORKDIR']}",
          flush=True)
    return subprocess.call(cmd, env=env, cwd=env["TQWHEEL_WORKDIR"])


if __name__ == "__main__":
    sys.exit(main())

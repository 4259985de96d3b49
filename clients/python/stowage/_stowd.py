"""The `stowd` command of an installed wheel: a console entry point that
execs the binary the wheel carries (`stowage/_bin/stowd`, with the bundled
policy plugins in `stowage/plugins`, which stowd finds beside its own
folder). `stowage.ray` runs the same binary.

Nothing of Python stays between the shell and stowd: `exec` replaces this
process, so signals, the exit status and the process id are stowd's own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
BINARY = PACKAGE_DIR / "_bin" / "stowd"
"""Where a wheel built by `cargo xtask wheel` (or from the sdist) puts stowd."""
PLUGINS = PACKAGE_DIR / "plugins"
"""... and its bundled policy plugins (`<binary dir>/../plugins`)."""


def missing(binary: Path) -> str | None:
    """Why `binary` cannot run (None if it can)."""
    if binary.is_file():
        return None if os.access(binary, os.X_OK) else f"{binary} is not executable"
    return f"{binary} is missing"


def main() -> None:
    why = missing(BINARY)
    if why is not None:
        sys.stderr.write(
            f"stowd: this stowage installation has no stowd binary ({why}).\n"
            "A wheel from `cargo xtask wheel`, or one pip builds from the sdist, carries it;\n"
            "`pip install ./clients/python -C stowd=skip` installs the client alone.\n"
            "From a checkout: `cargo xtask run`, or build it with `cargo build --release -p stowage-host --bin stowd`.\n"
        )
        raise SystemExit(127)
    os.execv(BINARY, [str(BINARY), *sys.argv[1:]])


if __name__ == "__main__":
    main()

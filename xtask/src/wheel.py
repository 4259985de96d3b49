"""Builds the `stowage` wheel with `stowd` inside: run by `cargo xtask wheel`
(standard library only, no network, no setuptools).

    python3 - --package clients/python --stowd target/release/stowd \
              --plugins target/plugins --out target/wheels  < wheel.py

The wheel holds the package's modules (`stowage/**/*.py`), the binary at
`stowage/_bin/stowd` and the policy plugins at `stowage/plugins/*.wasm`:
`<binary dir>/../plugins`, where stowd looks for its bundled plugins, so
the installed binary works on its defaults. Metadata comes from
`pyproject.toml`. A binary makes the wheel platform specific: it is tagged
`py3-none-<this platform>` and installs where that binary runs.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import sys
import sysconfig
import zipfile
from pathlib import Path

# Fixed timestamp: the same inputs give the same wheel.
EPOCH = (2020, 1, 1, 0, 0, 0)


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def metadata(project: dict, readme: str | None) -> str:
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {project['name']}",
        f"Version: {project['version']}",
    ]
    if project.get("description"):
        lines.append(f"Summary: {project['description']}")
    if project.get("requires-python"):
        lines.append(f"Requires-Python: {project['requires-python']}")
    for dep in project.get("dependencies", []):
        lines.append(f"Requires-Dist: {dep}")
    for extra, deps in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        for dep in deps:
            lines.append(f'Requires-Dist: {dep}; extra == "{extra}"')
    if readme:
        lines.append("Description-Content-Type: text/markdown")
        return "\n".join(lines) + "\n\n" + readme
    return "\n".join(lines) + "\n"


def platform_tag() -> str:
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--package", required=True, type=Path, help="clients/python")
    ap.add_argument("--stowd", required=True, type=Path)
    ap.add_argument("--plugins", required=True, type=Path)
    ap.add_argument("--core", required=True, type=Path, help="the built lib_core.so (stowage._core)")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args()

    try:
        import tomllib
    except ImportError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ImportError:
            sys.exit("wheel.py: needs Python 3.11+ (tomllib) or the tomli package to read pyproject.toml")
    pyproject = tomllib.loads((a.package / "pyproject.toml").read_text())
    project = pyproject["project"]
    name, version = project["name"], project["version"]
    dist = name.replace("-", "_")
    readme = (a.package / project["readme"]).read_text() if project.get("readme") else None
    tag = f"py3-none-{platform_tag()}"

    files: list[tuple[str, bytes, int]] = []  # (path in the wheel, bytes, unix mode)
    pkg = a.package / "stowage"
    for src in sorted(pkg.rglob("*.py")):
        if "__pycache__" in src.parts or "_bin" in src.parts:
            continue
        files.append((src.relative_to(a.package).as_posix(), src.read_bytes(), 0o644))
    if not a.stowd.is_file():
        sys.exit(f"wheel.py: no stowd binary at {a.stowd}")
    files.append(("stowage/_bin/stowd", a.stowd.read_bytes(), 0o755))
    if not a.core.is_file():
        sys.exit(f"wheel.py: no Rust core at {a.core}")
    files.append(("stowage/_core.abi3.so", a.core.read_bytes(), 0o755))
    wasm = sorted(a.plugins.glob("*.wasm"))  # not hostile/: test plugins stay out
    if not wasm:
        sys.exit(f"wheel.py: no plugins (*.wasm) in {a.plugins}")
    for w in wasm:
        files.append((f"stowage/plugins/{w.name}", w.read_bytes(), 0o644))

    info = f"{dist}-{version}.dist-info"
    files.append((f"{info}/METADATA", metadata(project, readme).encode(), 0o644))
    files.append((
        f"{info}/WHEEL",
        f"Wheel-Version: 1.0\nGenerator: stowage xtask wheel\nRoot-Is-Purelib: false\nTag: {tag}\n".encode(),
        0o644,
    ))
    record = "".join(f"{p},{record_hash(d)},{len(d)}\n" for p, d, _ in files) + f"{info}/RECORD,,\n"
    files.append((f"{info}/RECORD", record.encode(), 0o644))

    a.out.mkdir(parents=True, exist_ok=True)
    wheel = a.out / f"{dist}-{version}-{tag}.whl"
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for path, data, mode in files:
            zi = zipfile.ZipInfo(path, EPOCH)
            zi.external_attr = (0o100000 | mode) << 16  # regular file + permissions
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data)
    os.replace(tmp, wheel)

    for path, data, _ in files:
        if not path.endswith(".py"):
            print(f"  {path:<44} {len(data):>11,} bytes")
    print(f"  ({sum(p.endswith('.py') for p, _, _ in files)} Python modules)")
    print(f"{wheel}  {wheel.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

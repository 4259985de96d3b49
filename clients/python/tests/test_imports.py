"""The package's imports point one way (issue 18): no module of `stowage`
imports, at module level, a module that imports it back (directly or
through others); no function imports a `stowage` module to dodge such a
circle (a function may import only an optional dependency: torch, ray);
each module imports on its own in a fresh interpreter; and the client
works without torch.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "stowage"
OPTIONAL = {"torch", "ray", "ml_dtypes"}  # what a function may import: optional dependencies only


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> list[str]:
    """The `stowage` modules an ImportFrom names (the module, and any names
    in it that are modules themselves)."""
    if node.level:
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    # (`from . import x` names the package being imported already: only x counts)
    return ([target] if node.module else []) + [f"{target}.{a.name}" for a in node.names]


def _top_level_imports(module: str, path: Path, known: set[str]) -> set[str]:
    """`stowage` modules imported when `module` is imported: module-level
    statements (inside a top-level try too), not `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found |= set(_resolve(module, path.name == "__init__.py", node))
    return {m for m in found if m in known and m != module}


def _graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports at module level. (A
    package's `__init__` importing its own modules to re-export them is not
    a circle: Python imports a package before its modules.)"""
    mods = _modules()
    return {m: _top_level_imports(m, p, set(mods)) for m, p in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_the_checker_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_module_imports_point_one_way():
    graph = _graph()
    assert "stowage._dtypes" in graph["stowage._torch"] and "stowage._torch" in graph["stowage._codec"]
    assert "stowage._codec" not in graph["stowage._torch"]
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_functions_import_only_optional_dependencies():
    bad = []
    for module, path in _modules().items():
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = ["." * node.level + (node.module or "")]
                else:
                    continue
                if any(n.split(".")[0] not in OPTIONAL for n in names):
                    bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {ast.unparse(node)}")
    assert not bad, "imports inside functions (not an optional dependency): " + "; ".join(bad)


def _python_without_torch(code: str, *args: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter where torch is hidden: `import
    torch` fails and importlib.util.find_spec("torch") is None."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PACKAGE.parent), *sys.path]))
    code = "import sys; sys.modules['torch'] = None\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("module", sorted(m for m in _modules() if not m.startswith("stowage.ray")))
def test_each_module_imports_first_on_its_own_without_torch(module):
    out = _python_without_torch(f"import importlib; importlib.import_module({module!r})")
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_client_works_without_torch(endpoint, fresh):
    """A fresh interpreter where torch cannot be imported: put and get of
    every kind of field (bfloat16 as BFloat16Bits, as_torch=None gives its
    uint16 bits), the async put, and as_torch=True says torch is missing."""
    out = _python_without_torch("""
        import asyncio, json, sys
        import numpy as np, stowage
        from stowage import _torch
        assert not _torch.available()
        ep, idx = sys.argv[1], json.loads(sys.argv[2])
        bits = np.arange(6, dtype=np.uint16).reshape(3, 2)
        data = {"x": np.ones((3, 4), np.float32), "n": [np.arange(k, dtype=np.int64) for k in (1, 0, 5)],
                "v": ["a", b"b", "ü"], "bf": stowage.BFloat16Bits(bits)}
        with stowage.Client(ep, timeout=20) as c:
            assert c.put(idx, data) == 3
            got = c.get(idx, ["x", "n", "v", "bf"])
            assert np.array_equal(got["x"], data["x"]) and [r.tolist() for r in got["n"]] == [[0], [], [0, 1, 2, 3, 4]]
            assert got["v"] == ["a", b"b", "ü"] and got["bf"].dtype == np.uint16 and np.array_equal(got["bf"], bits)
            try:
                c.get(idx, ["x"], as_torch=True)
                raise SystemExit("as_torch=True worked without torch")
            except ImportError as e:
                assert "needs torch" in str(e)
            c.clear(idx)

        async def main():
            async with stowage.AsyncClient(ep, timeout=20) as c:
                assert await c.put(idx, {"x": data["x"]}) == 3
                assert np.array_equal((await c.get(idx, ["x"]))["x"], data["x"])
                await c.clear(idx)

        asyncio.run(main())
        assert sys.modules["torch"] is None
        print("ok")
    """, endpoint, str(fresh(3)).replace(" ", ""))
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-3000:]


def _copy_without_core(tmp_path: Path, core: bytes | None) -> Path:
    """The package copied into `tmp_path` with no Rust core (`core` None) or
    with `core` as a `_core.abi3.so` that cannot load."""
    import shutil
    dest = tmp_path / "stowage"
    shutil.copytree(PACKAGE, dest, ignore=shutil.ignore_patterns("_core*.so", "__pycache__", "_bin"))
    assert not list(dest.glob("_core*"))
    if core is not None:
        (dest / "_core.abi3.so").write_bytes(core)
    return tmp_path


@pytest.mark.parametrize("core", [None, b"not a shared object\n" * 256], ids=["missing", "unloadable"])
def test_import_without_the_core_fails_saying_how_to_get_it(tmp_path, core):
    """There is no pure-Python client: without its core (missing, or a file
    that does not load), `import stowage` fails at once, saying how to get
    one, rather than falling back."""
    root = _copy_without_core(tmp_path, core)
    env = dict(os.environ, PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, "-c", "import stowage"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0, r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: stowage cannot import its Rust core"), r.stderr
    assert str(root / "stowage") in last, last
    for how in ("cargo xtask wheel", "pip install ./clients/python -C stowd=skip", "cargo xtask test"):
        assert how in last, (how, last)
    if core is not None:
        assert "_core.abi3.so" in last and "invalid ELF header" in last, last

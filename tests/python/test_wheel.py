"""The wheel as a user installs it: `cargo xtask wheel` builds it (debug
profile, to reuse the suite's build; `STOWAGE_TEST_WHEEL=path` tests a given
wheel instead, e.g. a release one), pip installs it into a fresh venv with
no Rust toolchain on PATH, and the venv's own `stowd` command serves the
venv's own client over tcp and same node and checks a bundled plugin.

The venv sees the system's site-packages for numpy, pyzmq, msgpack and
tomli-w (pip installs with `--no-index`: nothing comes from the network),
never this tree's `clients/python`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    given = os.environ.get("STOWAGE_TEST_WHEEL")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("wheels")
    # (In `cargo xtask test`'s environment, so the suite's debug stowd is reused.)
    subprocess.run(["cargo", "xtask", "wheel", "--debug", "--out", str(out)], cwd=ROOT, check=True, timeout=1800)
    (built,) = out.glob("stowage-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """(venv dir, env for its commands): the wheel installed into a fresh venv."""
    home = tmp_path_factory.mktemp("venv")
    env_dir = home / "env"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index", "-q",
                    "--disable-pip-version-check", str(wheel)], check=True, timeout=600)
    # No cargo, no rustc: only the venv and the system's own directories.
    path = os.pathsep.join([str(env_dir / "bin"), "/usr/local/sbin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
    for tool in ("cargo", "rustc", "rustup"):
        assert shutil.which(tool, path=path) is None, f"{tool} is on the test's PATH {path}"
    env = {k: v for k, v in os.environ.items()
           if k not in ("STOWD_BIN", "STOWAGE_PLUGIN_DIR", "STOWD_PLUGIN_DIR", "PYTHONPATH")}
    env.update(PATH=path, HOME=str(home), RUST_LOG="warn")
    return env_dir, env


def test_the_wheel_is_manylinux_and_holds_stowd_its_plugins_and_the_core(wheel):
    name = wheel.name
    assert "-cp311-abi3-manylinux_2_" in name, name
    with zipfile.ZipFile(wheel) as z:
        infos = {i.filename: i for i in z.infolist()}
        entry_points = z.read("stowage-0.1.0.dist-info/entry_points.txt").decode()
    assert "stowd=stowage._stowd:main" in entry_points.replace(" ", "")
    assert "stowage/_core.abi3.so" in infos
    stowd = infos["stowage/_bin/stowd"]
    assert (stowd.external_attr >> 16) & 0o111, "stowd is not executable in the wheel"
    plugins = sorted(n for n in infos if n.startswith("stowage/plugins/") and n.endswith(".wasm"))
    on_disk = sorted(p.name for p in (ROOT / "plugins").iterdir() if (p / "Cargo.toml").is_file())
    assert [Path(p).stem for p in plugins] == on_disk
    assert not any(n.startswith(("_build/", "stowd-src/")) for n in infos)


def test_auditwheel_agrees_with_the_tag(wheel):
    try:
        import auditwheel  # noqa: F401
    except ImportError:
        # CI installs it (.ci/run); without it the tag is maturin's and xtask's word alone.
        pytest.fail("auditwheel is not installed: pip install auditwheel")
    out = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)], check=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600).stdout.decode()
    tag = wheel.name.split("-")[-1].removesuffix(".whl")  # manylinux_2_N_x86_64
    assert f'consistent with the following platform tag: "{tag}"' in " ".join(out.split()), out


def _stowd(env_dir, env, *args, **kw):
    return subprocess.run([str(env_dir / "bin" / "stowd"), *args], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=300, **kw)


def test_the_stowd_command_runs_the_bundled_binary(installed):
    env_dir, env = installed
    out = _stowd(env_dir, env, "--version")
    assert out.returncode == 0, out.stdout.decode()
    assert out.stdout.decode().startswith("stowd "), out.stdout.decode()


def test_stowd_plugin_check_on_a_bundled_plugin(installed):
    env_dir, env = installed
    site = subprocess.run([str(env_dir / "bin" / "python"), "-c", "import stowage, os; print(os.path.dirname(stowage.__file__))"],
                          env=env, check=True, stdout=subprocess.PIPE, timeout=120).stdout.decode().strip()
    assert Path(site).is_relative_to(env_dir), f"the venv imported stowage from {site}"
    plugin = Path(site) / "plugins" / "constant-stride.wasm"
    out = _stowd(env_dir, env, "plugin", "check", str(plugin))
    text = out.stdout.decode()
    assert out.returncode == 0, text
    assert text.startswith("plugin constant-stride "), text
    assert re.search(r"\d+ cases: [1-9]\d* ok .*, 0 failed", text), text


ROUND_TRIP = r"""
import json, sys, numpy as np, stowage
ep = json.load(open(sys.argv[1]))["native"]
assert "site-packages" in stowage.__file__, stowage.__file__
for same_node in (False, True):
    with stowage.Client(ep, same_node=same_node) as c:
        base = 100 if same_node else 0
        x = np.arange(base, base + 24, dtype=np.float32).reshape(3, 8)
        c.put([base, base + 1, base + 2], {"x": x, "t": ["a", "bb", "ccc"]})
        got = c.get([base + 2, base], ["x", "t"])
        assert np.array_equal(got["x"], x[[2, 0]]), got
        assert list(got["t"]) == ["ccc", "a"], got
print("ok")
"""


def test_the_installed_client_round_trips_over_tcp_and_same_node(installed, tmp_path):
    env_dir, env = installed
    shm_dir = f"/dev/shm/stowage-wheel-{os.getpid()}"
    cfg = tmp_path / "stowd.toml"
    cfg.write_text(f'[shm]\ndir = "{shm_dir}"\n\n[checkpoint]\nroots = ["{tmp_path}"]\n')
    eps = tmp_path / "stowd.json"
    log = open(tmp_path / "stowd.log", "wb")
    proc = subprocess.Popen([str(env_dir / "bin" / "stowd"), "serve", "--config", str(cfg), "--endpoints-file",
                             str(eps)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not eps.is_file():
            assert proc.poll() is None, (tmp_path / "stowd.log").read_text()
            assert time.monotonic() < deadline, "stowd did not write its endpoints file in 120 s"
            time.sleep(0.05)
        # The endpoints file names the venv's binary: the command exec'd it.
        assert os.path.realpath(f"/proc/{proc.pid}/exe").startswith(str(env_dir.resolve())), os.path.realpath(
            f"/proc/{proc.pid}/exe")
        script = tmp_path / "round_trip.py"
        script.write_text(ROUND_TRIP)
        out = subprocess.run([str(env_dir / "bin" / "python"), str(script), str(eps)], env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
        assert out.returncode == 0 and out.stdout.decode().strip().endswith("ok"), out.stdout.decode()
        # It runs on its bundled plugins (found beside its own folder).
        listed = _stowd(env_dir, env, "plugin", "list", "--endpoint", json.loads(eps.read_text())["native"])
        assert listed.returncode == 0, listed.stdout.decode()
        for plugin in ("constant-stride", "coalesce", "runs"):
            assert plugin in listed.stdout.decode(), listed.stdout.decode()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
        shutil.rmtree(shm_dir, ignore_errors=True)
    assert proc.returncode == 0, (tmp_path / "stowd.log").read_text()


def test_the_stowd_command_says_what_is_missing_without_a_binary(installed, tmp_path):
    env_dir, env = installed
    script = (
        "import sys; from pathlib import Path; import stowage._stowd as s; "
        "s.BINARY = Path(sys.argv[1]); s.main()"
    )
    for binary, why in ((tmp_path / "nope", "is missing"), (tmp_path / "plain", "is not executable")):
        if binary.name == "plain":
            binary.write_bytes(b"")
        out = subprocess.run([str(env_dir / "bin" / "python"), "-c", script, str(binary)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
        text = out.stdout.decode()
        assert out.returncode == 127, text
        assert f"no stowd binary ({binary} {why})" in text and "cargo xtask" in text, text

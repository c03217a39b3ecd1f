"""The built wheel works outside the checkout: it carries the Lua scripts, the dashboard and
the scenarios, and `rollout-broker demo` runs from it with nothing of the repository in reach."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    import shutil

    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"  # a copy: setuptools builds in the source tree, which stays as it was
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                        str(src)], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    (built,) = out.glob("rollout_broker-*.whl")
    return built


def test_the_wheel_carries_the_data_files(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"scenarios/{p.name}" for p in (ROOT / "scenarios").glob("*.yaml")}
    assert "scenarios/demo.yaml" in shipped and shipped <= names
    assert {f"broker/lua/{p.name}" for p in (ROOT / "broker" / "lua").glob("*.lua")} <= names
    assert any(n.startswith("api/static/") for n in names)


def test_the_demo_runs_from_the_installed_wheel_outside_the_checkout(wheel: Path,
                                                                      tmp_path: Path) -> None:
    site = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(site), str(wheel)], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp_path / "elsewhere"
    run.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), COLUMNS="160")
    where = subprocess.run([sys.executable, "-c", "import broker, scenarios; "
                            "print(broker.__file__); print(scenarios.__file__)"],
                           cwd=run, env=env, capture_output=True, text=True)
    assert all(line.startswith(str(site)) for line in where.stdout.split()), where.stdout
    demo = subprocess.run([sys.executable, "-m", "broker.cli", "demo", "--duration", "10",
                           "--engines", "2"], cwd=run, env=env, capture_output=True, text=True,
                          timeout=200)
    out = demo.stdout + demo.stderr
    assert demo.returncode == 0, out[-3000:]
    assert "scenario demo" in out and "summary:" in out, out[-3000:]

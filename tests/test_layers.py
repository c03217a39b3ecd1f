"""The packages are floors: an import may only go down. `broker/` (sessions, policies, the
broker, the trainer's client) imports none of the others; `sim/` and `api/` import only
`broker/`; `workers/` imports `broker/` and `sim/`; `gateway/` (the session gateway, which
runs turns as a worker does) imports those; `rollout_broker/` (the CLI and the demo,
which wire processes together) may import any of them, and nothing in them imports it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOOR = {"broker": 0, "sim": 1, "api": 1, "workers": 2, "gateway": 3, "rollout_broker": 4}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in `path`, at any depth (lazy imports too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def upward_imports() -> list[str]:
    bad = []
    for package, floor in FLOOR.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, module in imports_of(path):
                target = module.split(".")[0]
                if target in FLOOR and target != package and FLOOR[target] >= floor:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


def test_no_package_imports_one_on_its_floor_or_above():
    assert upward_imports() == []


def test_the_check_sees_a_lazy_upward_import(tmp_path, monkeypatch):
    """A function-level `from workers... import` inside broker/ is found (the CLI's were)."""
    fake = tmp_path / "broker"
    fake.mkdir()
    (fake / "x.py").write_text("def f():\n    from workers.engine import open_engine\n")
    for other in FLOOR:
        if other != "broker":
            (tmp_path / other).mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert upward_imports() == ["broker/x.py:2 imports workers.engine"]

"""Programs installed by pip are found beside the interpreter even when its venv is not active."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from broker.binaries import find_executable


def _program(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_found_beside_the_interpreter_without_path(tmp_path, monkeypatch):
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    _program(venv_bin / "rb-test-tool")
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_executable("rb-test-tool") == str(venv_bin / "rb-test-tool")


def test_beside_the_interpreter_wins_over_path(tmp_path, monkeypatch):
    venv_bin, other = tmp_path / "bin", tmp_path / "other"
    venv_bin.mkdir()
    other.mkdir()
    _program(venv_bin / "rb-test-tool")
    _program(other / "rb-test-tool")
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", str(other))
    assert find_executable("rb-test-tool") == str(venv_bin / "rb-test-tool")


def test_path_then_none(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    _program(tmp_path / "not-executable").chmod(0o644)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_executable("not-executable") is None
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path / "nothing")]))
    assert find_executable("rb-no-such-program") is None

"""Find a program that a Python package installed (`vllm`, `vllm-router`, ...).

pip puts a package's executables next to the interpreter (a virtual environment's `bin/`), which
is on PATH only while that environment is activated. `python -m venv v && v/bin/pip install ...
&& v/bin/python -m pytest` never activates it, so look beside `sys.executable` first.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def find_executable(name: str) -> str | None:
    """`name` beside the running interpreter, else on PATH; None when neither has it."""
    # Not resolved: a venv's python is a symlink to the base interpreter, whose bin/ is not ours.
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)

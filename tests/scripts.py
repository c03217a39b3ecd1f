"""Load a script that is not in a package (a benchmark, an example) as a module, for tests of
its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path) -> ModuleType:
    """`path` run as the module named by its stem, registered in sys.modules first (its
    dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module

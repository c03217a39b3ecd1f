"""The shipped scenarios (YAML files beside this one), installed with the package so that
`rollout-broker demo` and `rollout-broker bench` find them outside a checkout as well."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def scenario_path(name: str) -> Path:
    """The path of the shipped scenario file `name` (e.g. "demo.yaml")."""
    return Path(str(resources.files(__name__).joinpath(name)))

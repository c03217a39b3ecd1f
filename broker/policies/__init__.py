"""Admission/placement policies: one module per policy, one registry of canonical names.

Every module in this package that defines `Policy` subclasses registers them with `@register`;
`make_policy(name)` finds them by their `name` class attribute. Variants of one policy (MISA-T's
ablations) register a factory under their own canonical name with `register_factory`.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any, TypeVar

from broker.policies.base import Policy

P = TypeVar("P", bound=type[Policy])

DEFAULT_POLICY = "misa_t"  # what the broker, the demo and compose run unless told otherwise

_FACTORIES: dict[str, Callable[..., Policy]] = {}
_SIMULATOR_ONLY: set[str] = set()
_loaded = False


def register(cls: P) -> P:
    register_factory(cls.name, cls)
    if cls.simulator_only:
        _SIMULATOR_ONLY.add(cls.name)
    return cls


def register_factory(name: str, factory: Callable[..., Policy]) -> None:
    if name in _FACTORIES and _FACTORIES[name] is not factory:
        raise ValueError(f"policy name {name!r} is registered twice")
    _FACTORIES[name] = factory


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    for mod in pkgutil.iter_modules(__path__):
        if mod.name != "base":
            importlib.import_module(f"{__name__}.{mod.name}")
    _loaded = True


def policy_names() -> list[str]:
    _load_all()
    return sorted(_FACTORIES)


def live_policy_names() -> list[str]:
    """The policies a live broker can run: every one but the simulator's references."""
    return [n for n in policy_names() if n not in _SIMULATOR_ONLY]


def check_live_policy(name: str) -> None:
    """Raise ValueError("policy: ...") unless the live broker can run `name`."""
    names = live_policy_names()
    if name in _SIMULATOR_ONLY:
        raise ValueError(f"policy: {name!r} runs only in the simulator (`rollout-broker bench`); "
                         f"the broker runs: {', '.join(names)}")
    if name not in names:
        raise ValueError(f"policy: unknown policy {name!r}; the broker runs: {', '.join(names)}")


def make_policy(name: str, **params: Any) -> Policy:
    _load_all()
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"policy: unknown policy {name!r}; known: {', '.join(sorted(_FACTORIES))}"
        ) from None
    return factory(**params)

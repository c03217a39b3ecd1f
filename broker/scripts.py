"""Load the Lua scripts in `broker/lua/` once per Redis client.

Each `*.lua` file opens with its KEYS/ARGV and the invariant it keeps; `lib.lua` holds the
helpers they share and is put in front of each. `Scripts(client)` wraps them with redis-py's
`Script` objects: EVALSHA, loading the body on NOSCRIPT; a script object can also be called
with `client=pipeline` so many calls go out in one round trip.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import redis
from redis.commands.core import Script

SCRIPT_NAMES = (
    "enqueue", "admit", "finish", "mark_running", "heartbeat", "requeue", "cancel", "recharge",
    "lease_renew", "lease_release", "dead_letter", "ack_results", "weights", "expire",
    "checkpoint", "episode_open", "episode_request", "episode_begin", "episode_commit",
    "episode_release",
)


def _lua(name: str) -> str:
    return resources.files("broker").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


@cache
def script_source(name: str) -> str:
    """The script as Redis runs it: `lua/lib.lua` (shared helpers), then `lua/<name>.lua`."""
    if name not in SCRIPT_NAMES:
        raise ValueError(f"script: unknown Lua script {name!r}")
    return _lua("lib") + _lua(name)


class Scripts:
    """The registered scripts for one client; attribute names are the file names."""

    enqueue: Script
    admit: Script
    finish: Script
    mark_running: Script
    heartbeat: Script
    requeue: Script
    cancel: Script
    recharge: Script
    lease_renew: Script
    lease_release: Script
    dead_letter: Script
    ack_results: Script
    weights: Script
    expire: Script
    checkpoint: Script
    episode_open: Script
    episode_request: Script
    episode_begin: Script
    episode_commit: Script
    episode_release: Script

    def __init__(self, client: redis.Redis) -> None:
        for name in SCRIPT_NAMES:
            setattr(self, name, client.register_script(script_source(name)))

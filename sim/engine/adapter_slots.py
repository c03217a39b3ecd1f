"""One engine's LoRA adapter slots: the rule the simulated engine's HTTP server and the fleet
simulator both apply (sim/server/lora.py, sim/fleet.py).

vLLM mixes at most `--max-loras` adapters in one engine step: its scheduler leaves a waiting
request whose adapter would exceed that in the queue until a running adapter's last request
ends, and goes on scheduling the requests behind it whose adapters do fit. Here an adapter
holds a slot while any request of it is in the engine, and a request of an adapter without a
slot waits before it reaches the engine core; when a slot frees, the waiting requests that fit
then enter, oldest first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class AdapterSlots(Generic[T]):
    max_loras: int
    running: dict[str, int] = field(default_factory=dict)  # adapter -> requests in the engine
    waiting: deque[tuple[str, T]] = field(default_factory=deque)  # (adapter, request), FIFO
    slot_waits: int = 0  # requests that had to wait for a slot

    def admits(self, name: str) -> bool:
        return name in self.running or len(self.running) < self.max_loras

    def submit(self, name: str, request: T) -> bool:
        """True: `request` of adapter `name` enters the engine now (its slot is taken); False:
        it waits, and a later `release` hands it back when a slot is free for it."""
        if self.admits(name):
            self.running[name] = self.running.get(name, 0) + 1
            return True
        self.waiting.append((name, request))
        self.slot_waits += 1
        return False

    def cancel(self, request: T) -> None:
        """`request` no longer waits for a slot (its client went away, it was handed back)."""
        self.waiting = deque(w for w in self.waiting if w[1] is not request)

    def release(self, name: str) -> list[T]:
        """A request of `name` left the engine; returns the waiting requests that enter now,
        oldest first (each holding its slot)."""
        left = self.running.get(name, 0) - 1
        if left > 0:
            self.running[name] = left
        else:
            self.running.pop(name, None)
        entered, still = [], deque()
        for adapter, request in self.waiting:
            if self.admits(adapter):
                self.running[adapter] = self.running.get(adapter, 0) + 1
                entered.append(request)
            else:
                still.append((adapter, request))
        self.waiting = still
        return entered

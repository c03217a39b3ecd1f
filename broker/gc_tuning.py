"""CPython's cyclic collector, tuned for processes that hold many long-lived objects.

CPython runs a young-generation pass every 700 net allocations and, up to every 100 of those, a
pass over everything older. The broker at hundreds of backends (resident views, metadata, held
sessions) and the fleet simulator (requests, sessions, records) keep tens of thousands to
millions of long-lived objects, almost none of them cyclic garbage, and allocate thousands per
loop: the old passes walked them many times a second, inside the broker's loop and the
simulator's event loop. Both raise the young threshold while they run.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

LONG_LIVED_YOUNG_THRESHOLD = 50_000


@contextmanager
def few_collections(young: int = LONG_LIVED_YOUNG_THRESHOLD) -> Iterator[None]:
    """Within the block the young-generation threshold is at least `young`; the previous
    thresholds come back after it."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], young), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)

"""Small Redis helpers every client of the key schema shares: reply text, consumer groups, the
group read, and the backlog-first cursor of a consumer that may have crashed."""

from __future__ import annotations

from collections.abc import Sequence

import redis

from broker import plans
from broker.plans import Runner
from broker.redis_conn import single_attempt


def as_text(reply: object) -> str:
    """Replies arrive as bytes unless the client decodes; compare and store them as str."""
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def ensure_group(client: redis.Redis, stream: str, group: str, start_id: str = "0") -> None:
    """Create consumer group `group` on `stream` (and the stream); one that exists is kept."""
    Runner(client).run(plans.ensure_group(stream, group, start_id))


def read_group(client: redis.Redis, group: str, consumer: str, streams: dict[str, str],
               count: int, block: int | None) -> list:
    """XREADGROUP, sent once: a lost reply raises (to the reader, who reads its backlog
    again) instead of being sent again, which would leave what it delivered unseen
    (`broker.redis_conn.single_attempt`)."""
    with single_attempt():
        return client.xreadgroup(group, consumer, streams, count=count, block=block)


class BacklogCursor:
    """Where a group consumer reads next. Entries delivered to it before a restart (its part of
    the group's backlog) come first, from the start, without blocking, until a short read says
    they are all seen; then only new entries ('>')."""

    __slots__ = ("_cursor", "done")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._cursor = "0"
        self.done = False

    def read_args(self, block_ms: int | None) -> tuple[str, int | None]:
        """(the id to pass XREADGROUP, its BLOCK): the backlog is never waited on."""
        return (">", block_ms) if self.done else (self._cursor, None)

    def advance(self, entries: Sequence, count: int) -> None:
        """Account for the `entries` a read of at most `count` returned."""
        if self.done:
            return
        if entries:
            self._cursor = as_text(entries[-1][0])
        if len(entries) < count:
            self.done = True

"""The one place that builds Redis key strings.

Every key lives under `rb:{<namespace>}:`. The braces are a Redis Cluster hash tag: all keys of a
namespace hash to one slot, so the multi-key Lua scripts in `broker/lua/` work on a cluster, and
several RL jobs (namespaces) spread over the cluster's slots.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from broker.session import ID_RE as _SESSION_RE
from broker.session import WORKLOAD_RE as _WORKLOAD_RE

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # namespaces and backend ids


def check_backend_id(backend_id: str) -> str:
    if not _NAMESPACE_RE.match(backend_id):
        raise ValueError(
            f"backend_id: {backend_id!r} must be 1-64 characters of letters, digits, '_', '.' or '-'"
        )
    return backend_id


def _check(kind: str, value: str, pattern: re.Pattern[str]) -> str:
    if not pattern.match(value):
        raise ValueError(f"{kind}: {value!r} is not a valid {kind} for a Redis key")
    return value


@dataclass(frozen=True, slots=True)
class Keys:
    """Key builder for one namespace. Argument checks keep ids from smuggling ':' or braces."""

    namespace: str

    def __post_init__(self) -> None:
        _check("namespace", self.namespace, _NAMESPACE_RE)

    @property
    def prefix(self) -> str:
        return f"rb:{{{self.namespace}}}:"

    # -- queues ---------------------------------------------------------------------------------
    def pending(self, workload: str) -> str:
        """Stream: sessions waiting for admission, in enqueue order (group "broker")."""
        return f"{self.prefix}pending:{_check('workload', workload, _WORKLOAD_RE)}"

    def requeue(self, workload: str) -> str:
        """Stream: sessions taken back from a dead backend; read before `pending` (its front)."""
        return f"{self.prefix}requeue:{_check('workload', workload, _WORKLOAD_RE)}"

    def admitted(self, backend_id: str) -> str:
        """Stream: sessions admitted to one backend, for its worker (group "workers")."""
        return f"{self.prefix}admitted:{check_backend_id(backend_id)}"

    @property
    def results(self) -> str:
        """Stream: one entry per finished session (group "trainer"); an entry is deleted when
        the trainer acknowledges it."""
        return f"{self.prefix}results"

    @property
    def completions(self) -> str:
        """Stream, capped: one small entry per finished session (its lengths and timings) for
        the broker's predictors, read with XREAD (lua/finish.lua writes it with the result)."""
        return f"{self.prefix}completions"

    @property
    def dead_letter(self) -> str:
        """Stream: malformed entries taken off the queues, with the reason."""
        return f"{self.prefix}dead"

    @property
    def events(self) -> str:
        """Stream: wake-ups for the broker (heartbeats, finishes, cancels); capped in length."""
        return f"{self.prefix}events"

    # -- per-session state ----------------------------------------------------------------------
    def session(self, session_id: str) -> str:
        """Hash: state, workload, timestamps, queue entry ids, backend, reservation (small
        fields only, so Redis keeps it a listpack; the body is at `body`)."""
        return f"{self.prefix}session:{_check('session_id', session_id, _SESSION_RE)}"

    def body(self, session_id: str) -> str:
        """String: the session's body, stored once (broker/body.py), written with its hash and
        deleted when the session ends (lua/lib.lua)."""
        return f"{self.prefix}body:{_check('session_id', session_id, _SESSION_RE)}"

    # -- episodes the agent drives (gateway/, broker/episodes.py) ----------------------------------
    def episode(self, session_id: str) -> str:
        """String: an episode's spec (JSON: workload, group, sampling, limits, metadata), written
        when it opens."""
        return f"{self.prefix}episode:{_check('session_id', session_id, _SESSION_RE)}"

    def episode_turns(self, session_id: str) -> str:
        """List: the episode's turn records (TurnRecord JSON), one or more per call, in order."""
        return f"{self.episode(session_id)}:turns"

    def episode_reply(self, session_id: str) -> str:
        """String: the reply to the episode's last call, handed again to a retry of that call."""
        return f"{self.episode(session_id)}:reply"

    def episode_text(self, session_id: str) -> str:
        """String: a text completions episode's prompt and completions so far (a later call's
        prompt extends it)."""
        return f"{self.episode(session_id)}:text"

    @property
    def idle(self) -> str:
        """Sorted set: episode id -> unix time its KV charge may be released (the broker does,
        lua/episode_release.lua): the end of the running call's deadline, or the idle timeout
        after the last call."""
        return f"{self.prefix}idle"

    @property
    def episodes_admitted(self) -> str:
        """Stream: episodes the broker admitted (sid, reserved), read by every gateway (no
        group) to wake the call waiting for it; gateways trim it by age."""
        return f"{self.prefix}episodes:admitted"

    # -- ledger, backends, heartbeats -----------------------------------------------------------
    def ledger(self, backend_id: str) -> str:
        """Hash: capacity, max_model_len, alpha, reserved (total), w:<workload> (per workload)."""
        return f"{self.prefix}ledger:{check_backend_id(backend_id)}"

    def ledger_sessions(self, backend_id: str) -> str:
        """Hash: session_id -> reserved KV tokens, for sessions resident on the backend."""
        return f"{self.prefix}ledger:{check_backend_id(backend_id)}:sessions"

    @property
    def stats(self) -> str:
        """Hash: counters of what went wrong and was absorbed (`stale_finishes`: results a
        worker finished but could not publish because the session was another's by then)."""
        return f"{self.prefix}stats"

    @property
    def kv_seconds(self) -> str:
        """Hash: <workload> -> summed KV-token-seconds of finished sessions, n:<workload> -> count."""
        return f"{self.prefix}kvsec"

    def heartbeat(self, backend_id: str) -> str:
        """String (JSON) with a TTL: the backend's latest telemetry and per-session progress."""
        return f"{self.prefix}hb:{check_backend_id(backend_id)}"

    @property
    def backends(self) -> str:
        """Set: every backend id ever registered in the namespace (the index; never KEYS *)."""
        return f"{self.prefix}backends"

    @property
    def adapters(self) -> str:
        """Hash: LoRA adapter name -> the path its engines load it from
        (`RolloutClient.register_adapter`; broker/adapters.py)."""
        return f"{self.prefix}adapters"

    @property
    def adapter_versions(self) -> str:
        """Hash: LoRA adapter name -> how often it was registered (a new path is new weights)."""
        return f"{self.prefix}adapter_versions"

    # -- trainer-side ---------------------------------------------------------------------------
    @property
    def workloads(self) -> str:
        """Set: workload names enqueue accepts."""
        return f"{self.prefix}workloads"

    @property
    def mixture(self) -> str:
        """Hash: <workload> -> target share π_w (sums to 1)."""
        return f"{self.prefix}mixture"

    @property
    def consumed(self) -> str:
        """Hash: <workload> -> results the trainer has acknowledged."""
        return f"{self.prefix}consumed"

    @property
    def settings(self) -> str:
        """Hash: namespace settings the trainer sets: session_retention_s (how long an ended
        session's state hash is kept; lua/lib.lua)."""
        return f"{self.prefix}settings"

    # -- weight updates -------------------------------------------------------------------------
    @property
    def weights(self) -> str:
        """Hash: paused (the pause mode, '' while generating), epoch (pauses so far), version
        (the policy version the engines serve), control_id (the latest `control` entry),
        max_staleness (the staleness bound, '' for none)."""
        return f"{self.prefix}weights"

    @property
    def control(self) -> str:
        """Stream: pause and resume orders, read by every worker (no group: a broadcast)."""
        return f"{self.prefix}control"

    @property
    def paused_acks(self) -> str:
        """Hash: backend_id -> the pause epoch its engine has reached (paused)."""
        return f"{self.prefix}paused"

    @property
    def paused_events(self) -> str:
        """Stream: an entry after each write to `paused_acks` (backend, epoch), which a pausing
        trainer blocks on instead of polling the hash (capped)."""
        return f"{self.prefix}paused:events"

    # -- tool calls (RQ) ------------------------------------------------------------------------
    @property
    def tool_queue(self) -> str:
        """RQ queue name: tool calls (RQ keeps its list at `rq:queue:<name>`, its registries
        and jobs under `rq:`; the name carries the hash tag)."""
        return f"{self.prefix}tools"

    @property
    def reward_queue(self) -> str:
        """RQ queue name: reward scoring."""
        return f"{self.prefix}rewards"

    def tool_replies(self, executor_id: str) -> str:
        """List: results of one executor's RQ jobs, pushed by their success callback. `*` gives
        the SCAN pattern of every executor's."""
        if executor_id != "*":
            check_backend_id(executor_id)
        return f"{self.prefix}tool-replies:{executor_id}"

    # -- broker ---------------------------------------------------------------------------------
    @property
    def lease(self) -> str:
        """String with a PX expiry: the token of the one active broker."""
        return f"{self.prefix}lease"


# Consumer-group names, next to the keys they apply to.
BROKER_GROUP = "broker"  # on pending:*, requeue:* and events
WORKERS_GROUP = "workers"  # on admitted:*
TRAINER_GROUP = "trainer"  # on results

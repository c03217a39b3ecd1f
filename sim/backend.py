"""A light simulated backend: heartbeats and finishes admitted sessions through `WorkerLink`.

Used by the broker's tests and `benchmarks/broker_throughput.py`, and a minimal reference for a
real worker's loop. It runs no model: each session finishes after `service_s` seconds with a
fixed number of output tokens. `stop_heartbeats()` makes it look dead to the broker (its key
expires); `hold` keeps sessions resident without finishing them. It follows weight updates
(broker/weights.py) as a worker does, at once: it acknowledges each pause on its next beat and
finishes nothing while paused.
"""

from __future__ import annotations

import threading
import time

from broker.heartbeat import EngineMetrics, SessionProgress
from broker.redis_conn import is_outage
from broker.completions import CompletionStats
from broker.worker_link import AdmittedSession, BackendReclaimed, WorkerLink
from broker.session import SessionResult, SessionState


class SimulatedBackend:
    def __init__(self, redis_url: str, namespace: str, backend_id: str, capacity_tokens: int,
                 max_model_len: int = 32768, service_s: float = 0.0, output_tokens: int = 8,
                 heartbeat_s: float = 0.2, heartbeat_ttl_s: float = 1.0, hold: bool = False) -> None:
        self.link = WorkerLink(redis_url, namespace, backend_id, heartbeat_ttl_s=heartbeat_ttl_s)
        self.capacity_tokens = capacity_tokens
        self.max_model_len = max_model_len
        self.service_s = service_s
        self.output_tokens = output_tokens
        self.heartbeat_s = heartbeat_s
        self.hold = hold
        self.finished: list[str] = []  # session ids this backend published a result for
        self.refused: list[tuple[str, str]] = []  # (session id, finish reply) when not 'ok'
        self._running: dict[str, tuple[AdmittedSession, float]] = {}  # sid -> (session, start)
        self._stop = threading.Event()
        self._beating = threading.Event()
        self._beating.set()
        self._thread: threading.Thread | None = None
        self.paused = False
        self._acked_epoch = 0

    def start(self) -> SimulatedBackend:
        self.link.register(self.capacity_tokens, self.max_model_len)
        self._beat()
        self._thread = threading.Thread(target=self._loop, name=f"sim-{self.link.backend_id}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.link.close()

    def stop_heartbeats(self) -> None:
        """Act dead: no more heartbeats and no more finishes (a crashed or cut-off worker)."""
        self._beating.clear()

    def _beat(self) -> None:
        progress = [SessionProgress(session_id=sid, context_tokens=a.session.prompt_len_hint,
                                    generated_tokens=0, turn=1)
                    for sid, (a, _) in self._running.items()]
        self.link.heartbeat(EngineMetrics(kv_usage=0.0, running=len(self._running), waiting=0,
                                          preemptions_total=0, prefix_queries_total=0,
                                          prefix_hits_total=0), progress)
        weights = self.link.weights_state()
        self.paused = bool(weights.paused)
        if self.paused and weights.epoch > self._acked_epoch:
            self.link.ack_paused(weights.epoch)
            self._acked_epoch = weights.epoch

    def _loop(self) -> None:
        """Serve until stopped, riding out Redis outages (lost or reset connections) as a
        worker does: the round is tried again."""
        while not self._stop.is_set():
            try:
                self._serve()
            except Exception as exc:
                if not is_outage(exc):
                    raise
                self._stop.wait(0.1)

    def _until_ok(self, fn, *args):
        """`fn(*args)` until Redis answers (read sessions must not be dropped on a reset: as
        a worker does, it is asked again; the scripts are idempotent)."""
        while True:
            try:
                return fn(*args)
            except Exception as exc:
                if not is_outage(exc) or self._stop.is_set():
                    raise
                self._stop.wait(0.05)

    def _serve(self) -> None:
        last_beat = time.monotonic()
        while not self._stop.is_set():
            if not self._beating.is_set():
                self._stop.wait(0.05)
                continue
            if time.monotonic() - last_beat >= self.heartbeat_s:
                self._beat()
                last_beat = time.monotonic()
            try:
                fresh = self.link.read_admitted(count=500, block_ms=50)
            except BackendReclaimed:
                self._running.clear()
                self.link.register(self.capacity_tokens, self.max_model_len)
                continue
            now = time.monotonic()
            ok = self._until_ok(self.link.mark_running_many,
                                [a.session.session_id for a in fresh])
            for a, run in zip(fresh, ok):
                if run:
                    self._running[a.session.session_id] = (a, now)
            if not self.hold and not self.paused and self._beating.is_set():
                self._finish_due(time.monotonic())

    def _finish_due(self, now: float) -> None:
        due = [sid for sid, (_, t0) in self._running.items() if now - t0 >= self.service_s]
        batch = []
        for sid in due:
            a, _ = self._running[sid]
            s = a.session
            result = SessionResult(session_id=sid, workload=s.workload, group_id=s.group_id,
                                   group_size=s.group_size, status=SessionState.done, turns=1,
                                   prompt_tokens=s.prompt_len_hint,
                                   output_tokens=self.output_tokens, policy_version=s.policy_version)
            batch.append((result, CompletionStats(turn_output_tokens=[self.output_tokens],
                                                  kv_token_seconds=a.reserved_tokens * self.service_s)))
        replies = self.link.finish_many(batch)  # (an outage: they stay due, finished again)
        for (result, _), reply in zip(batch, replies):
            self._running.pop(result.session_id, None)
            if reply == "ok":
                self.finished.append(result.session_id)
            else:
                self.refused.append((result.session_id, reply))

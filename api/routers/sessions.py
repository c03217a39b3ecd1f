"""Sessions: enqueue a batch, read one, cancel one. Writes go through `RolloutClient`, so the
API validates and deduplicates exactly as a Python trainer does."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from api.deps import AuthDep, ClientDep, KeysDep, RedisDep
from api.errors import ApiError, from_value_error
from api.limits import TOO_LARGE
from api.models import CancelPublic, EnqueuePublic, ErrorPublic, SessionBatchIn, SessionPublic
from broker.body import load_body
from broker.session import SessionState

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])

SessionId = Annotated[str, Path(pattern=r"^[A-Za-z0-9_.:\-]{1,128}$",
                                description="the id the trainer gave the session")]
_ERRORS = {400: {"model": ErrorPublic}, 401: {"model": ErrorPublic}, 422: {"model": ErrorPublic}}


@router.post("", response_model=EnqueuePublic, responses={**_ERRORS, **TOO_LARGE},
             dependencies=[AuthDep])
def enqueue(body: SessionBatchIn, client: ClientDep) -> EnqueuePublic:
    """Enqueue a batch: all or nothing on a bad item; ids seen before are left as they are."""
    try:
        new = client.enqueue(body.sessions)
    except ValueError as exc:
        raise from_value_error(exc) from None
    added = set(new)
    return EnqueuePublic(enqueued=new,
                         duplicates=[s.session_id for s in body.sessions if s.session_id not in added])


def _float(v: bytes | None) -> float | None:
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None


@router.get("/{session_id}", response_model=SessionPublic,
            responses={404: {"model": ErrorPublic}, 422: {"model": ErrorPublic}})
async def get_session(session_id: SessionId, redis: RedisDep, keys: KeysDep) -> SessionPublic:
    raw = await redis.hgetall(keys.session(session_id))
    f = {k.decode(): v for k, v in raw.items()}
    try:
        state = SessionState(f["state"].decode())
    except (KeyError, ValueError):
        raise ApiError(404, "session_id", f"no session {session_id!r} in this namespace") from None
    # The body is in its own key; a session enqueued by an earlier version keeps it in the hash.
    body = f.get("session") or await redis.get(keys.body(session_id))
    try:
        session = load_body(body) if body is not None else None
    except ValueError:
        session = None
    reserved = f.get("reserved")
    return SessionPublic(
        session_id=session_id, state=state, workload=f.get("workload", b"").decode(),
        backend_id=f["backend"].decode() if f.get("backend") else None,
        reserved_tokens=int(reserved) if reserved is not None else None,
        enqueued_at=_float(f.get("enqueued_at")), admitted_at=_float(f.get("admitted_at")),
        running_at=_float(f.get("running_at")), finished_at=_float(f.get("finished_at")),
        requeued_at=_float(f.get("requeued_at")), session=session,
    )


@router.delete("/{session_id}", response_model=CancelPublic, dependencies=[AuthDep],
               responses={**_ERRORS, 404: {"model": ErrorPublic}, 409: {"model": ErrorPublic}})
def cancel(session_id: SessionId, client: ClientDep) -> CancelPublic:
    """Cancel a session that has not finished; repeating it is harmless."""
    try:
        outcome = client.cancel(session_id)
    except RuntimeError as exc:  # it kept moving between backends while we tried
        raise ApiError(409, "session_id", str(exc).partition(": ")[2] or str(exc)) from None
    if outcome == "unknown":
        raise ApiError(404, "session_id", f"no session {session_id!r} in this namespace")
    state = SessionState(outcome)
    return CancelPublic(session_id=session_id, cancelled=state is SessionState.cancelled,
                        state=state)

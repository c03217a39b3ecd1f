"""GET /v1/status (everything an operator watches) and GET /v1/backends.

The reader builds validated models already, so these answer with their JSON directly rather
than have FastAPI validate them a second time (the response models still document them)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from pydantic import TypeAdapter

from api.deps import StatusReaderDep
from api.models import BackendStatus, ChartPoint, HistoryPublic, StatusPublic

router = APIRouter(prefix="/v1", tags=["status"])

_BACKENDS = TypeAdapter(list[BackendStatus])


@router.get("/status", response_model=StatusPublic)
async def get_status(reader: StatusReaderDep) -> Response:
    status = await reader.read()
    return Response(status.model_dump_json(), media_type="application/json")


@router.get("/history", response_model=HistoryPublic)
async def get_history(request: Request) -> HistoryPublic:
    """What the dashboard's charts plot over the last 5 minutes, as the API sampled it (every
    2 s, and at each status read): a page opened now starts with that history."""
    return HistoryPublic(now=time.time(), samples=[
        ChartPoint(at=s.at, queue=s.queue, kv=s.kv, drift=s.drift)
        for s in request.app.state.chart_trail.samples()])


@router.get("/backends", response_model=list[BackendStatus])
async def get_backends(reader: StatusReaderDep) -> Response:
    status = await reader.read()
    return Response(_BACKENDS.dump_json(status.backends), media_type="application/json")

"""GET /v1/status (everything an operator watches) and GET /v1/backends.

The reader builds validated models already, so these answer with their JSON directly rather
than have FastAPI validate them a second time (the response models still document them)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from pydantic import TypeAdapter

from api.deps import StatusReaderDep
from api.models import BackendStatus, StatusPublic

router = APIRouter(prefix="/v1", tags=["status"])

_BACKENDS = TypeAdapter(list[BackendStatus])


@router.get("/status", response_model=StatusPublic)
async def get_status(reader: StatusReaderDep) -> Response:
    status = await reader.read()
    return Response(status.model_dump_json(), media_type="application/json")


@router.get("/backends", response_model=list[BackendStatus])
async def get_backends(reader: StatusReaderDep) -> Response:
    status = await reader.read()
    return Response(_BACKENDS.dump_json(status.backends), media_type="application/json")

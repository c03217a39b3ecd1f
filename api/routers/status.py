"""GET /v1/status (everything an operator watches) and GET /v1/backends."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import HistoryDep, KeysDep, RedisDep, SettingsDep
from api.models import BackendStatus, StatusPublic
from api.status import read_status

router = APIRouter(prefix="/v1", tags=["status"])


@router.get("/status", response_model=StatusPublic)
async def get_status(redis: RedisDep, keys: KeysDep, history: HistoryDep,
                     settings: SettingsDep) -> StatusPublic:
    return await read_status(redis, keys, history, settings.mixture_window_s,
                             settings.throughput_windows_s)


@router.get("/backends", response_model=list[BackendStatus])
async def get_backends(redis: RedisDep, keys: KeysDep, history: HistoryDep,
                       settings: SettingsDep) -> list[BackendStatus]:
    status = await read_status(redis, keys, history, settings.mixture_window_s,
                               settings.throughput_windows_s)
    return status.backends

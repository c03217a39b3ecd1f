"""The target mixture π: read it, set it (through `RolloutClient.set_mixture`)."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import AuthDep, ClientDep, KeysDep, RedisDep
from api.errors import from_value_error
from api.limits import TOO_LARGE
from api.models import ErrorPublic, MixtureIn, MixturePublic

router = APIRouter(prefix="/v1/mixture", tags=["mixture"])


@router.get("", response_model=MixturePublic)
async def get_mixture(redis: RedisDep, keys: KeysDep) -> MixturePublic:
    raw = await redis.hgetall(keys.mixture)
    return MixturePublic(shares={k.decode(): float(v) for k, v in raw.items()})


@router.put("", response_model=MixturePublic, dependencies=[AuthDep],
            responses={400: {"model": ErrorPublic}, 401: {"model": ErrorPublic},
                       422: {"model": ErrorPublic}, **TOO_LARGE})
def put_mixture(body: MixtureIn, client: ClientDep) -> MixturePublic:
    """Set the target share of consumed sessions per known workload; shares sum to 1."""
    try:
        shares = client.set_mixture(body.shares)
    except ValueError as exc:
        raise from_value_error(exc, rename=("mixture", "shares")) from None
    return MixturePublic(shares=shares)

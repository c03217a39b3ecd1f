"""API settings from the environment (`RB_API_*`), read once per process by `get_settings()`;
`make_settings()` builds them with a one-line error for a command line to print."""

from __future__ import annotations

import ipaddress
from functools import lru_cache

from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from broker.redis_conn import DEFAULT_REDIS_URL, check_redis_url


class ApiSettings(BaseSettings):
    """Every command reads RB_REDIS_URL and RB_NAMESPACE (README "Settings"); the API's own
    settings are RB_API_*."""

    model_config = SettingsConfigDict(env_prefix="RB_API_", extra="ignore", populate_by_name=True)

    redis_url: str = Field(default=DEFAULT_REDIS_URL,
                           validation_alias=AliasChoices("redis_url", "RB_REDIS_URL"))
    namespace: str = Field(default="default",  # one RL job; see broker/keys.py
                           validation_alias=AliasChoices("namespace", "RB_NAMESPACE"))
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    # Bearer token for the mutating endpoints; None leaves them open (loopback only).
    token: SecretStr | None = None
    # The "last window" of consumed mixture and session latency, and the throughput windows (s).
    mixture_window_s: float = Field(default=60.0, gt=0)
    throughput_windows_s: tuple[float, ...] = (60.0, 300.0)
    # A request body longer than this is refused with a 413 before it is parsed.
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)

    @field_validator("redis_url")
    @classmethod
    def _redis_url_usable(cls, v: str) -> str:
        check_redis_url(v)
        return v

    @field_validator("token")
    @classmethod
    def _token_not_blank(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value().strip():
            raise ValueError("token: must not be blank")
        return v


@lru_cache
def get_settings() -> ApiSettings:
    return ApiSettings()


def make_settings(**values: object) -> ApiSettings:
    """`ApiSettings(**values)`, its first error as a one-line ValueError "field: reason"."""
    try:
        return ApiSettings(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        reason = str(err["msg"]).removeprefix("Value error, ")
        field = ".".join(str(p) for p in err["loc"])
        if not field or reason.startswith(f"{field}: "):
            raise ValueError(reason) from None
        raise ValueError(f"{field}: {reason}") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(settings: ApiSettings) -> None:
    """Refuse to serve the mutating endpoints unauthenticated beyond this machine."""
    blank = settings.token is None or not settings.token.get_secret_value().strip()
    if blank and not is_loopback(settings.host):
        raise ValueError(
            f"host: refusing to bind {settings.host!r} without a token; anyone who can reach it "
            "could enqueue, cancel and change the mixture. Set --token (or RB_API_TOKEN), "
            "or bind a loopback address such as 127.0.0.1"
        )

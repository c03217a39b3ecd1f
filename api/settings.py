"""API settings from the environment (`RB_API_*`), read once per process by `get_settings()`."""

from __future__ import annotations

import ipaddress
from functools import lru_cache

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class ApiSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RB_API_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "default"  # one RL job; see broker/keys.py
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    # Bearer token for the mutating endpoints; None leaves them open (loopback only).
    token: SecretStr | None = None
    # The "last window" of consumed mixture and the throughput windows, in seconds.
    mixture_window_s: float = Field(default=60.0, gt=0)
    throughput_windows_s: tuple[float, ...] = (60.0, 300.0)


@lru_cache
def get_settings() -> ApiSettings:
    return ApiSettings()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(settings: ApiSettings) -> None:
    """Refuse to serve the mutating endpoints unauthenticated beyond this machine."""
    if settings.token is None and not is_loopback(settings.host):
        raise ValueError(
            f"host: refusing to bind {settings.host!r} without a token; anyone who can reach it "
            "could enqueue, cancel and change the mixture. Set --token (or RB_API_TOKEN), "
            "or bind a loopback address such as 127.0.0.1"
        )

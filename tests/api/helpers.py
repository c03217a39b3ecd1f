"""Small helpers for the API tests."""

from __future__ import annotations

from broker.session import Session


def session_json(i: int, workload: str = "rlvr", prompt_len: int = 8, max_tokens: int = 16,
                 prefix: str = "s") -> dict:
    return Session(session_id=f"{prefix}{i}", workload=workload,
                   prompt_token_ids=list(range(1, prompt_len + 1)),
                   max_tokens=max_tokens).model_dump(mode="json")

"""How a session's body is stored in Redis: compact JSON, once per session.

The body lives in one string key, `rb:{ns}:body:<sid>` (`Keys.body`); the queue entries and the
state hash hold only the session id and small fields (see broker/queue.py). The stored JSON
leaves out every field at its default (`exclude_defaults`) and packs `prompt_token_ids` into one
string: base64 of a width byte w (8..32, the bits of the largest id, at least 8) followed by
every id's low w bits, little-endian, back to back. A 150-token prompt of a 128k vocabulary is
428 characters instead of about 930 as decimal text. Ids of 2^32 or more are kept as a list.

It stays JSON, so the Lua scripts read its plain fields with cjson (requeue.lua reads
`max_attempts`, `group_id`, `group_size` and `policy_version`). `load_body` also reads the
previous form (`Session.model_dump_json()`, token ids as a list), which sessions enqueued by an
earlier version still carry in their queue entry or state hash.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence

import numpy as np

from broker.session import Session

_PACKED_MARK = '"prompt_token_ids":"'  # a packed prompt; a list starts '"prompt_token_ids":['


def pack_ids(ids: Sequence[int]) -> str | None:
    """The packed form of `ids`, or None when it cannot be packed (empty, or an id >= 2^32)."""
    if not ids:
        return None
    top = max(ids)
    if top >= 1 << 32:
        return None
    width = max(8, int(top).bit_length())  # >= 8: the < 8 padding bits never make an extra id
    a = np.asarray(ids, dtype="<u4")
    bits = np.unpackbits(a.view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")[:, :width]
    packed = np.packbits(bits, bitorder="little").tobytes()
    return base64.b64encode(bytes([width]) + packed).decode("ascii")


def unpack_ids(text: str, field: str = "prompt_token_ids") -> list[int]:
    """The ids `pack_ids` packed; ValueError naming `field` when `text` is not such a string."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{field}: not a packed id string (bad base64)") from None
    if not raw or not 8 <= raw[0] <= 32:
        raise ValueError(f"{field}: not a packed id string (bad width)")
    width = raw[0]
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8, offset=1), bitorder="little")
    n = bits.size // width
    full = np.zeros((n, 32), dtype=np.uint8)
    full[:, :width] = bits[:n * width].reshape(n, width)
    return np.packbits(full, axis=1, bitorder="little").view("<u4").ravel().tolist()


def dump_body(session: Session) -> str:
    """The stored form of `session` (see the module docstring); `load_body` gives it back."""
    packed = pack_ids(session.prompt_token_ids) if session.prompt_token_ids else None
    if packed is None:
        return session.model_dump_json(exclude_defaults=True)
    d = session.model_dump(mode="json", exclude_defaults=True, exclude={"prompt_token_ids"})
    d["prompt_token_ids"] = packed
    return json.dumps(d, ensure_ascii=False, separators=(",", ":"))


def load_body(raw: bytes | str) -> Session:
    """The Session stored as `raw`, packed or in the earlier plain JSON. Raises ValueError
    (pydantic's ValidationError is one) when it does not parse or validate."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    if _PACKED_MARK not in text:
        return Session.model_validate_json(text)
    d = json.loads(text)
    if isinstance(d, dict) and isinstance(d.get("prompt_token_ids"), str):
        d["prompt_token_ids"] = unpack_ids(d["prompt_token_ids"])
    return Session.model_validate(d)

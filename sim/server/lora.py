"""LoRA adapters on the simulated engine, through vLLM's API for them.

`POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}` and
`POST /v1/unload_lora_adapter {lora_name}` behave as vLLM's (`--enable-lora` with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`; the same errors for a name loaded twice, a name that
clashes with the base model, an unknown name); a loaded adapter is listed by /v1/models with the
base model as its `parent`, and a request whose `model` names it runs with it.

What it costs, modelled:
- **Loading** takes `load_s` (simulated seconds, divided by the time scale like everything
  else): reading the adapter's weights. The default is derived, not measured: a rank-16 adapter
  on every attention projection of Llama-3.1-8B holds 32 layers × (q, o: 2 × 4096 × 16 + k, v:
  4096 × 16 + 16 × 1024) ≈ 13.6 M parameters, 27 MB in BF16, read at ~1.5 GB/s from a local
  NVMe drive or page cache: about 0.02 s.
- **Slots**: one engine step mixes at most `max_loras` adapters (vLLM's `--max-loras`). vLLM's
  scheduler leaves a waiting request whose adapter would exceed that in the queue until a
  running adapter's last request finishes; here the request waits before it reaches the engine
  core, for the same condition (a request of an adapter already running goes ahead).
- **Outputs depend on the adapter**: its name and path seed the sampled tokens (on top of the
  request's own seed), so other weights give other tokens, as a real adapter does, and prefix
  cache blocks are not shared across adapters (vLLM keys them by adapter too).
- `vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}` on /metrics,
  as vLLM exports it.
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass, field

from pydantic import BaseModel

from sim.engine.adapter_slots import AdapterSlots
from sim.server.errors import ApiError

DEFAULT_LOAD_S = 0.02  # derived in the module docstring


class LoadLoRAAdapterBody(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterBody(BaseModel):
    lora_name: str


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    name: str
    path: str

    @property
    def seed(self) -> int:
        """What the adapter's weights change in the sampled tokens (nonzero)."""
        return zlib.crc32(f"{self.name}\0{self.path}".encode()) | 1


@dataclass
class LoraState:
    """The engine's adapters and its `max_loras` slots."""

    max_loras: int
    load_s: float  # simulated seconds per load
    time_scale: float = 1.0
    adapters: dict[str, LoadedAdapter] = field(default_factory=dict)
    slots: AdapterSlots[asyncio.Future] = field(init=False)
    loads: int = 0

    def __post_init__(self) -> None:
        self.slots = AdapterSlots(self.max_loras)

    @property
    def running(self) -> list[str]:
        """Adapters with a request in the engine (each holds a slot)."""
        return list(self.slots.running)

    @property
    def waiting(self) -> list[str]:
        """Adapters with a request waiting for a slot."""
        return list(dict.fromkeys(name for name, _ in self.slots.waiting))

    async def load(self, body: LoadLoRAAdapterBody, base_model: str) -> str:
        name = body.lora_name
        if not name or not body.lora_path:
            raise ApiError("Both 'lora_name' and 'lora_path' must be provided.",
                           param="lora_name")
        if name == base_model:
            raise ApiError(f"The lora adapter '{name}' conflicts with a served base model.",
                           param="lora_name")
        if name in self.adapters and not body.load_inplace:
            raise ApiError(f"The lora adapter '{name}' has already been loaded. If you want to "
                           "load the adapter in place, set 'load_inplace' to True.",
                           param="lora_name")
        await asyncio.sleep(self.load_s / self.time_scale)
        self.adapters[name] = LoadedAdapter(name, body.lora_path)
        self.loads += 1
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: UnloadLoRAAdapterBody) -> str:
        if body.lora_name not in self.adapters:
            raise ApiError(f"The lora adapter '{body.lora_name}' cannot be found.",
                           param="lora_name", status_code=404, err_type="NotFoundError")
        del self.adapters[body.lora_name]
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    async def acquire(self, name: str) -> LoadedAdapter:
        """Take a slot for one request of adapter `name`, waiting while `max_loras` other
        adapters hold them all (sim/engine/adapter_slots.py); `release` gives it back when the
        request is done."""
        woken = asyncio.get_running_loop().create_future()
        if not self.slots.submit(name, woken):
            try:
                await woken
            except asyncio.CancelledError:  # the client went away
                if woken.cancelled():  # still waiting: out of the queue
                    self.slots.cancel(woken)
                else:  # it had entered: the slot is ours to give back
                    self.release(name)
                raise
        adapter = self.adapters.get(name)
        if adapter is None:  # unloaded while the request waited
            self.release(name)
            raise ApiError.model_not_found(name)
        return adapter

    def release(self, name: str) -> None:
        for woken in self.slots.release(name):
            woken.set_result(None)

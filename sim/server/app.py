"""The FastAPI app: vLLM's HTTP surface over one simulated engine core.

Routes (as vLLM serves them): POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize,
/v1/completions/render, /v1/chat/completions/render, /inference/v1/generate (token ids in and
out, with the weights label of every output span); POST /pause?mode=abort|wait|keep
(&clear_cache=), /resume, GET /is_paused, POST /update_weight_version, GET /weight_info and POST
/collective_rpc (method reload_weights: recorded, nothing changes) for RL weight updates
(driver.py); GET /v1/models, /health, /ping, /version, /metrics, /server_info. Nothing is
created at import time; `create_app` builds the engine core and the driver task starts with the
app's lifespan.

With `fault_injection` (`rollout-broker sim-engine --fault-injection`, for fault drills such as
benchmarks/chaos.py; off by default) one more route, `POST /sim/faults {"metrics_delay_s": S}`,
makes every /metrics answer S seconds late while generation goes on, as an overloaded API
server's would.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel

from sim.engine.core import EngineCore
from sim.engine.profiles import EngineProfile, get_profile
from sim.server import prompts as P
from sim.server import serving
from sim.server.driver import EngineDriver
from sim.server.errors import ApiError, api_error_handler, validation_error_handler
from sim.server.metrics import CacheConfigInfo, build_registry
from sim.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    GenerateRequest,
    InferenceGenerateRequest,
    ModelCard,
    ModelList,
    ModelPermission,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    random_uuid,
)
from sim.server.lora import DEFAULT_LOAD_S, LoadLoRAAdapterBody, LoraState, UnloadLoRAAdapterBody
from sim.server.tokenizer import SimTokenizer

# The vLLM release whose HTTP API the simulator serves (GET /version), marked as simulated.
SIM_VERSION = "0.32.0+sim"


@dataclass(frozen=True, slots=True)
class EngineSettings:
    profile: str = "h200-30b-a3b"
    time_scale: float = 1.0
    kv_tokens: int | None = None
    seed: int = 0
    model_name: str | None = None
    fault_injection: bool = False
    # Keep the last `journal` token-in/token-out requests (`/inference/v1/generate`): their
    # prompt and output ids, served at GET /sim/journal, so a test can check what a client
    # recorded against what the engine consumed and produced. 0: none kept.
    journal: int = 0
    # LoRA (sim/server/lora.py): vLLM's --max-loras (0: LoRA off, as without --enable-lora),
    # and the simulated seconds one adapter takes to load.
    max_loras: int = 0
    lora_load_s: float = DEFAULT_LOAD_S
    # vLLM's --scheduling-policy: `fcfs`, or `priority` (requests' `priority` field orders the
    # waiting queue and picks whom to preempt; `fcfs` ignores it, as vLLM does).
    scheduling_policy: str = "fcfs"


@dataclass
class ServerState:
    """What every route needs; one per app, held in `app.state.sim`."""

    profile: EngineProfile
    model_name: str
    tokenizer: SimTokenizer
    core: EngineCore
    driver: EngineDriver
    registry: CollectorRegistry
    metrics_delay_s: float = 0.0  # an injected fault (see the module docstring)
    weights_path: str | None = None  # the last checkpoint a collective_rpc reload_weights named
    journal: deque | None = None  # EngineSettings.journal
    lora: LoraState | None = None  # None: LoRA off

    @property
    def max_model_len(self) -> int:
        """The core's: shrunk below the profile's when an overridden KV capacity can't hold it."""
        return self.core.max_model_len

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for a
        name the engine does not serve."""
        if name is None or name == self.model_name:
            return None
        if self.lora is not None and name in self.lora.adapters:
            return name
        raise ApiError.model_not_found(name)


def get_state(request: Request) -> ServerState:
    return request.app.state.sim


StateDep = Annotated[ServerState, Depends(get_state)]


def build_state(settings: EngineSettings) -> ServerState:
    profile = get_profile(settings.profile)
    core = EngineCore(profile, kv_tokens=settings.kv_tokens, seed=settings.seed,
                      scheduling_policy=settings.scheduling_policy)
    driver = EngineDriver(core, time_scale=settings.time_scale)
    model_name = settings.model_name or profile.served_model
    cache_info = CacheConfigInfo(block_size=core.block_size, num_gpu_blocks=core.num_gpu_blocks)
    if settings.max_loras < 0 or settings.lora_load_s < 0:
        raise ValueError("max_loras and lora_load_s: must not be negative")
    lora = LoraState(settings.max_loras, settings.lora_load_s, settings.time_scale) \
        if settings.max_loras else None
    return ServerState(profile=profile, model_name=model_name,
                       tokenizer=SimTokenizer(profile.vocab_size), core=core, driver=driver,
                       registry=build_registry(model_name, driver.stats, cache_info, lora),
                       journal=deque(maxlen=settings.journal) if settings.journal else None,
                       lora=lora)


def create_app(settings: EngineSettings) -> FastAPI:
    state = build_state(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.driver.start()
        yield
        await state.driver.stop()

    app = FastAPI(title="rollout-broker simulated vLLM", version=SIM_VERSION, lifespan=lifespan)
    app.state.sim = state
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    _add_generation_routes(app)
    _add_pause_routes(app)
    _add_token_routes(app)
    _add_info_routes(app)
    if state.lora is not None:
        _add_lora_routes(app)
    if settings.fault_injection:
        _add_fault_routes(app)
    return app


def _add_fault_routes(app: FastAPI) -> None:
    @app.post("/sim/faults")
    async def faults(body: dict[str, float], s: StateDep) -> dict[str, float]:
        unknown = set(body) - {"metrics_delay_s"}
        if unknown:
            raise ApiError(f"unknown fault(s): {', '.join(sorted(unknown))}",
                           param=sorted(unknown)[0])
        s.metrics_delay_s = max(0.0, float(body.get("metrics_delay_s", s.metrics_delay_s)))
        return {"metrics_delay_s": s.metrics_delay_s}


def _add_lora_routes(app: FastAPI) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterBody, s: StateDep) -> Response:
        assert s.lora is not None
        return Response(await s.lora.load(body, s.model_name), media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterBody, s: StateDep) -> Response:
        assert s.lora is not None
        return Response(s.lora.unload(body), media_type="text/plain")

    @app.get("/sim/lora")
    async def lora_stats(s: StateDep) -> dict[str, Any]:
        """What the simulator counts of its adapters (not a vLLM route): loads, requests that
        waited for a slot, and the adapters loaded (name -> path)."""
        assert s.lora is not None
        return {"loads": s.lora.loads, "slot_waits": s.lora.slots.slot_waits,
                "adapters": {a.name: a.path for a in s.lora.adapters.values()}}


async def _start(s: ServerState, adapter: str | None, request_id: str, prompts: list,
                 limits: list[int], sampling: Any, priority: int) -> serving.Generation:
    """Start a generation on the base model or, holding one of its slots, on `adapter` (the
    slot goes back when every request of it has ended)."""
    if adapter is None:
        return serving.start_generation(s.driver, request_id, s.model_name, prompts, limits,
                                        sampling, s.tokenizer, priority=priority)
    assert s.lora is not None
    lora = s.lora
    loaded = await lora.acquire(adapter)
    try:
        gen = serving.start_generation(s.driver, request_id, adapter, prompts, limits,
                                       sampling, s.tokenizer, lora_seed=loaded.seed,
                                       priority=priority)
    except BaseException:
        lora.release(adapter)
        raise
    done = asyncio.gather(*gen.futures, return_exceptions=True)
    done.add_done_callback(lambda _: lora.release(adapter))
    return gen


def _json(body: BaseModel) -> Response:
    """A response model as JSON, serialised by pydantic-core: FastAPI's `jsonable_encoder`
    walks a reply with per-token logprobs in Python, 5× slower (a 2,000-token reply: 38 ms),
    which a loaded machine's benchmarks would charge to the broker."""
    return Response(content=body.model_dump_json(), media_type="application/json")


def _add_generation_routes(app: FastAPI) -> None:
    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, s: StateDep, request: Request) -> Any:
        adapter = s.check_model(req.model)
        prompts, limits = P.completion_inputs(req, s.tokenizer, s.profile.vocab_size,
                                              s.max_model_len)
        request_id = f"cmpl-{req.request_id or random_uuid()}"
        gen = await _start(s, adapter, request_id, prompts, limits, req, req.priority)
        echo = bool(req.echo)
        if req.stream:
            return StreamingResponse(serving.completion_stream(s.driver, gen, s.tokenizer, req,
                                                               echo),
                                     media_type="text/event-stream")
        if not await serving.wait_all_or_disconnect(request, s.driver, gen):
            return Response(status_code=499)  # nobody reads it: the client went away
        return _json(serving.completion_response(gen, s.tokenizer, req, echo))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest, s: StateDep, request: Request) -> Any:
        adapter = s.check_model(req.model)
        prompt, limit = P.chat_inputs(req, s.tokenizer, s.max_model_len)
        request_id = f"chatcmpl-{req.request_id or random_uuid()}"
        gen = await _start(s, adapter, request_id, [prompt], [limit], req, req.priority)
        if req.stream:
            return StreamingResponse(serving.chat_stream(s.driver, gen, s.tokenizer, req),
                                     media_type="text/event-stream")
        if not await serving.wait_all_or_disconnect(request, s.driver, gen):
            return Response(status_code=499)
        return _json(serving.chat_response(gen, s.tokenizer, req))


    @app.post("/inference/v1/generate", response_model=None)
    async def generate(req: InferenceGenerateRequest, s: StateDep, request: Request) -> Any:
        adapter = s.check_model(req.model)
        prompt, limit, sampling = P.generate_inputs(req, s.profile.vocab_size, s.max_model_len)
        request_id = f"generate-{req.output_mode}-{req.request_id or random_uuid()}"
        gen = await _start(s, adapter, request_id, [prompt], [limit], sampling, req.priority)
        if not await serving.wait_all_or_disconnect(request, s.driver, gen):
            return Response(status_code=499)
        reply = serving.generate_response(gen, s.tokenizer, req)
        if s.journal is not None:
            s.journal.append({"request_id": req.request_id, "prompt_token_ids": prompt.token_ids,
                              "output_token_ids": reply.choices[0].token_ids,
                              "finish_reason": reply.choices[0].finish_reason})
        return _json(reply)

    @app.get("/sim/journal")
    async def journal(s: StateDep) -> list[dict[str, Any]]:
        """The token-in/token-out requests kept (EngineSettings.journal), oldest first."""
        return list(s.journal or ())


class WeightVersionBody(BaseModel):
    new_version: str


class CollectiveRpcBody(BaseModel):
    method: str
    args: list[str] = []
    kwargs: dict[str, str] = {}
    timeout: float | None = None


def _add_pause_routes(app: FastAPI) -> None:
    @app.post("/update_weight_version")
    async def update_weight_version(body: WeightVersionBody, s: StateDep) -> dict[str, Any]:
        s.driver.set_weight_version(body.new_version)
        return {"success": True, "new_version": body.new_version}

    @app.get("/weight_info")
    async def weight_info(s: StateDep) -> dict[str, str]:
        return {"weight_version": s.driver.weight_version}

    @app.post("/collective_rpc")
    async def collective_rpc(body: CollectiveRpcBody, s: StateDep) -> dict[str, Any]:
        if body.method != "reload_weights":
            raise ApiError(f"the simulated engine runs no method {body.method!r} "
                           "(only reload_weights)", param="method")
        s.weights_path = body.kwargs.get("weights_path")
        return {"results": [None]}

    @app.post("/pause")
    async def pause(s: StateDep, mode: Literal["abort", "wait", "keep"] = "abort",
                    clear_cache: bool = True) -> dict[str, str]:
        await s.driver.pause(mode, clear_cache)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume(s: StateDep) -> dict[str, str]:
        s.driver.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused(s: StateDep) -> dict[str, bool]:
        return {"is_paused": s.driver.paused}


def _add_token_routes(app: FastAPI) -> None:
    @app.post("/tokenize")
    async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest,
                       s: StateDep) -> TokenizeResponse:
        s.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            ids = P.chat_prompt(req.messages, req.add_generation_prompt,
                                req.continue_final_message, s.tokenizer, req.tools).token_ids
        else:
            ids = s.tokenizer.encode(req.prompt)
        strs = s.tokenizer.pieces(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=s.max_model_len, tokens=ids,
                                token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest, s: StateDep) -> DetokenizeResponse:
        s.check_model(req.model)
        try:
            return DetokenizeResponse(prompt=s.tokenizer.decode(req.tokens))
        except ValueError as exc:
            raise ApiError.from_engine(exc) from exc

    @app.post("/v1/completions/render")
    async def render_completion(req: CompletionRequest, s: StateDep) -> list[GenerateRequest]:
        s.check_model(req.model)
        prompts, limits = P.completion_inputs(req, s.tokenizer, s.profile.vocab_size,
                                              s.max_model_len)
        return [GenerateRequest(request_id=f"cmpl-{random_uuid()}", token_ids=pr.token_ids,
                                model=s.model_name, sampling_params=P.sampling_params(req, limit),
                                stream=req.stream, stream_options=req.stream_options)
                for pr, limit in zip(prompts, limits)]

    @app.post("/v1/chat/completions/render")
    async def render_chat(req: ChatCompletionRequest, s: StateDep) -> GenerateRequest:
        s.check_model(req.model)
        prompt, limit = P.chat_inputs(req, s.tokenizer, s.max_model_len)
        return GenerateRequest(request_id=f"chatcmpl-{random_uuid()}", token_ids=prompt.token_ids,
                               model=s.model_name, sampling_params=P.sampling_params(req, limit),
                               stream=req.stream, stream_options=req.stream_options)


def _add_info_routes(app: FastAPI) -> None:
    @app.get("/v1/models")
    async def models(s: StateDep) -> ModelList:
        card = ModelCard(id=s.model_name, root=s.model_name, max_model_len=s.max_model_len,
                         permission=[ModelPermission()], vocab_size=s.profile.vocab_size)
        cards = [card]
        if s.lora is not None:
            cards += [ModelCard(id=a.name, root=a.path, parent=s.model_name,
                                permission=[ModelPermission()])
                      for a in s.lora.adapters.values()]
        return ModelList(data=cards)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": SIM_VERSION}

    @app.get("/metrics")
    async def metrics(s: StateDep) -> Response:
        if s.metrics_delay_s > 0:
            await asyncio.sleep(s.metrics_delay_s)
        return Response(generate_latest(s.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    async def server_info(s: StateDep) -> JSONResponse:
        """The part of vLLM's server_info routers read: the served model and the block size."""
        return JSONResponse({"vllm_config": {
            "model_config": {"model": s.model_name, "max_model_len": s.max_model_len},
            "cache_config": {"block_size": s.core.block_size,
                             "num_gpu_blocks": s.core.num_gpu_blocks},
            "lora_config": None if s.lora is None else {"max_loras": s.lora.max_loras},
        }})


def serve(host: str = "127.0.0.1", port: int = 8000, profile: str = "h200-30b-a3b",
          time_scale: float = 1.0, kv_tokens: int | None = None, seed: int = 0,
          model_name: str | None = None, fault_injection: bool = False, journal: int = 0,
          max_loras: int = 0, lora_load_s: float = DEFAULT_LOAD_S,
          scheduling_policy: str = "fcfs") -> None:
    """Run the server in the foreground until interrupted (`rollout-broker sim-engine`)."""
    settings = EngineSettings(profile=profile, time_scale=time_scale, kv_tokens=kv_tokens,
                              seed=seed, model_name=model_name, fault_injection=fault_injection,
                              journal=journal, max_loras=max_loras, lora_load_s=lora_load_s,
                              scheduling_policy=scheduling_policy)
    # On SIGTERM, requests still generating are cut after 2 s instead of holding the process
    # until they finish (uvicorn waits for open connections otherwise).
    uvicorn.run(create_app(settings), host=host, port=port, log_level="warning",
                timeout_graceful_shutdown=2)

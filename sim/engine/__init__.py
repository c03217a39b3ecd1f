"""A model of vLLM v1's engine core: paged KV cache with prefix caching, and its scheduler.

`EngineCore` is driven either by the fleet simulator on a virtual clock or by the wall-clock
HTTP server (`sim.server`); both see the same scheduler, cache and step-time model.
"""

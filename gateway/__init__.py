"""The session gateway: an OpenAI-compatible endpoint per episode for agents that drive
their own turns (docs/gateway.md)."""

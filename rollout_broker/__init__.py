"""The entry points: the `rollout-broker` command (`cli.py`) and what wires processes together
(`demo.py`). The top floor: it imports every other package, and none imports it. Below it,
`workers/` (GPU workers), then `sim/` (the simulated engine and fleet) and `api/` (the status
API), then `broker/` (sessions, policies, the broker, the trainer's client), which every other
package builds on (tests/test_layers.py checks the order)."""

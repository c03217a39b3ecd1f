"""Simulated rollout sessions: the hidden truth, the generators and the session sources.

`sim.workloads.source` (generator and trace sources for the trainer) is imported explicitly;
it depends on `sim.trace`, which depends on this package.
"""

from sim.workloads.generators import agentic_group, generate_group, rlhf_group, rlvr_group
from sim.workloads.truth import SessionTruth, SimSession, stable_hash, token_ids

__all__ = [
    "SessionTruth",
    "SimSession",
    "agentic_group",
    "generate_group",
    "rlhf_group",
    "rlvr_group",
    "stable_hash",
    "token_ids",
]

"""A request inside the simulated engine, with vLLM v1's token accounting."""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

from sim.engine.block_pool import Block

# (output token ids, min_tokens) -> (output tokens up to and including the one that completes a
# stop condition, what stopped it), or None when nothing in them does.
StopScan = Callable[[list[int], int], tuple[int, int | str] | None]
# (the request's token seed) -> the ids its output must end with: a tool call and EOS for the
# server's `sim_tool_call` (the server knows the tokenizer, the engine the seed).
ForcedEnding = Callable[[int], list[int]]


class FinishReason(StrEnum):
    length = "length"  # reached max_tokens (or max_model_len)
    stop = "stop"  # end of sequence
    abort = "abort"  # aborted by the client


class RequestStatus(StrEnum):
    waiting = "waiting"  # in the waiting queue, never scheduled
    running = "running"  # in the running list (prefill may be partial)
    preempted = "preempted"  # evicted by recompute preemption; back at the front of waiting
    finished = "finished"


class EngineRequest:
    """A completion request. Fields after `arrival_time` are the engine's to change.

    Token accounting (as vLLM's Request): num_tokens = prompt + output so far; the engine has
    KV for the first num_computed_tokens of them. A request in decode has
    num_computed_tokens == num_tokens − 1 (its last sampled token is not fed yet).
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "max_tokens", "output_len", "ignore_eos", "seed",
        "arrival_time", "stop_len", "num_prompt_tokens", "num_output_tokens",
        "num_computed_tokens", "blocks", "block_hashes", "status", "num_cached_tokens",
        "num_preemptions", "first_token_time", "finish_time", "finish_reason", "token_seed",
        "_output_ids", "num_cached_blocks", "vocab_size", "num_tokens", "min_tokens",
        "stop_token_ids", "stop_scan", "stop_reason", "weight_version_starts", "forced_ending",
        "ending_ids", "ending_start", "lora_seed", "priority", "arrival_seq",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                 output_len: int | None = None, ignore_eos: bool = False, seed: int | None = None,
                 arrival_time: float = 0.0, prefix_block_hashes: list[int] | None = None,
                 min_tokens: int = 0, stop_token_ids: frozenset[int] = frozenset(),
                 stop_scan: StopScan | None = None,
                 forced_ending: ForcedEnding | None = None, lora_seed: int = 0,
                 priority: int = 0) -> None:
        """`prefix_block_hashes`: chained hashes of the prompt's leading full blocks when the
        caller already has them — an in-process driver passes the previous turn's hashes for
        the next turn of a conversation, so a long history is not hashed again. They must be
        what `chain_hashes` gives for those tokens (the HTTP server never passes them).
        `priority`: vLLM's request priority, lower first; read only by an engine scheduling by
        priority (`Scheduler`)."""
        self.request_id = request_id
        self.priority = priority
        self.arrival_seq = 0  # the engine's count of requests added before it (set on add)
        self.prompt_token_ids = prompt_token_ids
        self.max_tokens = max_tokens
        self.output_len = output_len  # `sim_output_len`: the EOS position if the caller knows it
        # A LoRA adapter's weights (sim/server/lora.py), 0 for the base model: they change the
        # sampled tokens and key the prefix cache's blocks.
        self.lora_seed = lora_seed
        self.ignore_eos = ignore_eos
        self.seed = seed
        self.arrival_time = arrival_time
        # vLLM's stop conditions, none checked before `min_tokens` output tokens: an id in
        # `stop_token_ids`, and whatever `stop_scan` finds in the output (stop strings: the
        # server knows the tokenizer, the engine does not).
        self.min_tokens = min_tokens
        self.stop_token_ids = stop_token_ids
        self.stop_scan = stop_scan
        # Ids the output ends with in place of sampled ones (set on add: `ending_ids` at output
        # positions [ending_start, ending_start + len); a max_tokens below the end cuts them).
        self.forced_ending = forced_ending
        self.ending_ids: list[int] = []
        self.ending_start = 0
        # Engine state.
        self.stop_len = 0  # output tokens at which it will finish (set on add)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_output_tokens = 0
        self.num_tokens = self.num_prompt_tokens  # prompt + output; kept in step with num_output_tokens
        self.num_computed_tokens = 0
        self.blocks: list[Block] = []
        # Chained hashes of full blocks known so far.
        self.block_hashes: list[int] = list(prefix_block_hashes or ())
        self.status = RequestStatus.waiting
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling (vLLM reports this)
        self.num_preemptions = 0
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None  # the stop token id or string that ended it
        self.token_seed = 0  # seeds output token ids (set on add)
        self.vocab_size = 151_936  # the engine's vocabulary (set on add)
        self.num_cached_blocks = 0  # leading blocks of `blocks` already offered to the cache
        self._output_ids: list[int] | None = None
        # (weights label, first output position) for each span of output tokens that label's
        # weights generated; kept by the HTTP server's driver (None in the fleet simulator).
        self.weight_version_starts: list[tuple[str, int]] | None = None

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.finished

    @property
    def output_token_ids(self) -> list[int]:
        """The generated ids so far."""
        return self.output_token_ids_upto(self.num_output_tokens)

    def output_token_ids_upto(self, n: int) -> list[int]:
        """The ids at output positions [0, n), generated or not yet (materialised on demand:
        they are a pure function of the request's seed and position, and of its forced
        ending where it has one)."""
        from sim.engine.sampling import output_token_ids

        ids = self._output_ids
        if ids is None or len(ids) < n:
            have = [] if ids is None else ids
            fresh = output_token_ids(self.token_seed, len(have), n, self.vocab_size)
            start, ending = self.ending_start, self.ending_ids
            lo, hi = max(len(have), start), min(n, start + len(ending))
            if lo < hi:
                fresh[lo - len(have):hi - len(have)] = ending[lo - start:hi - start]
            ids = have + fresh
            self._output_ids = ids
        return ids[:n]

    @property
    def ends_with_eos(self) -> bool:
        """Its output so far ends with the whole forced ending, whose last id is EOS: a model
        that samples EOS stops there, at max_tokens too (unless told to ignore EOS)."""
        return (bool(self.ending_ids) and not self.ignore_eos
                and self.num_output_tokens == self.ending_start + len(self.ending_ids))

    @property
    def output_logprobs(self) -> list[float]:
        """Logprobs of the generated ids (as deterministic as the ids)."""
        from sim.engine.sampling import output_logprobs

        return output_logprobs(self.token_seed, 0, self.num_output_tokens)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __repr__(self) -> str:
        return (f"EngineRequest({self.request_id!r}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}/{self.stop_len}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.blocks)}, {self.status})")

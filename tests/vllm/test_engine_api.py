"""What the worker asks of an engine, asked of real vLLM: the checks and facts it reads at start,
token-id turns with logprobs and stop conditions, and the /metrics the broker is fed from."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from broker.session import SamplingParams, Session, SessionState
from tests.vllm.conftest import BLOCK, BLOCKS, MAX_MODEL_LEN, VOCAB, RealEngine
from workers.engine import MIN_VLLM, parse_metrics, read_engine_info
from workers.runner import RunnerSettings, SessionRunner
from workers.tools import InlineExecutor, load_registry

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(300)]


def test_the_engine_the_worker_starts_passes_its_checks_and_says_what_the_broker_needs(
        vllm_engine: RealEngine):
    info = read_engine_info(vllm_engine.url, weight_reload=True)
    assert info.version == MIN_VLLM
    assert info.capacity_tokens == BLOCK * BLOCKS and info.max_model_len == MAX_MODEL_LEN
    # Finding 3: the vocabulary comes from the served model (its config and tokenizer), so
    # the broker can refuse an out-of-vocabulary prompt at enqueue.
    assert info.vocab_size == VOCAB
    assert vllm_engine.generate([VOCAB - 1], max_tokens=1)["token_ids"]
    with pytest.raises(httpx.HTTPStatusError):
        vllm_engine.generate([VOCAB], max_tokens=1)
    # Findings 4 and 6: what the worker turned on and off for its child.
    config = httpx.get(f"{vllm_engine.url}/server_info").json()["vllm_config"]
    assert "enable_chunked_prefill=False" in config
    assert vllm_engine.generate([5, 6, 7], max_tokens=1)["usage"]["prompt_tokens_details"] \
        is not None


def run_sessions(engine: RealEngine, sessions: list[Session]) -> list:
    info = read_engine_info(engine.url)

    async def main():
        tools = InlineExecutor(timeout_s=30.0, registry=load_registry(None))
        async with httpx.AsyncClient(timeout=120) as http:
            runner = SessionRunner(http, engine.url, info.model, info.max_model_len, tools,
                                   RunnerSettings(), vocab_size=info.vocab_size)
            try:
                return await asyncio.gather(*(runner.run(s) for s in sessions))
            finally:
                await tools.aclose()

    return asyncio.run(main())


def session(sid: str, prompt: list[int], max_tokens: int = 24, **sampling) -> Session:
    return Session(session_id=sid, workload="rlhf", prompt_token_ids=prompt,
                   max_tokens=max_tokens, sampling=SamplingParams(**sampling))


def test_token_id_turns_come_back_with_a_logprob_per_token_and_honour_stop_and_seed(
        vllm_engine: RealEngine):
    prompt = [11, 22, 33, 44, 55, 66, 77]
    greedy, = run_sessions(vllm_engine, [session("g", prompt, temperature=0.0,
                                                 ignore_eos=True)])
    out = greedy.turns[0]
    assert greedy.result.status == SessionState.done, greedy.result.error
    assert len(out.output_token_ids) == 24 and out.finish_reason == "length"
    assert len(out.output_logprobs) == 24 and all(v <= 0.0 for v in out.output_logprobs)
    record = greedy.result.turn_records[0]
    assert record.input_token_ids == prompt and record.output_token_ids == out.output_token_ids
    # A stop token id ends the output at its first occurrence (the id is kept, as vLLM does).
    stop_id = out.output_token_ids[9]
    first = out.output_token_ids.index(stop_id)
    text = httpx.post(f"{vllm_engine.url}/detokenize",
                      json={"model": vllm_engine.model,
                            "tokens": out.output_token_ids[12:16]}).json()["prompt"]
    stop_text = text.strip()[:3]
    by_id, by_text, seeded, seeded_again, other_seed = run_sessions(vllm_engine, [
        session("i", prompt, temperature=0.0, stop_token_ids=[stop_id]),
        session("t", prompt, temperature=0.0, stop=[stop_text]),
        session("s1", prompt, max_tokens=32, temperature=1.0, seed=7, ignore_eos=True),
        session("s2", prompt, max_tokens=32, temperature=1.0, seed=7, ignore_eos=True),
        session("s3", prompt, max_tokens=32, temperature=1.0, seed=8, ignore_eos=True)])
    assert by_id.turns[0].output_token_ids == out.output_token_ids[:first + 1]
    assert by_id.turns[0].finish_reason == "stop"
    assert by_text.turns[0].finish_reason == "stop"
    assert len(by_text.turns[0].output_token_ids) <= 16
    assert seeded.turns[0].output_token_ids == seeded_again.turns[0].output_token_ids
    assert seeded.turns[0].output_token_ids != other_seed.turns[0].output_token_ids


def test_a_prompt_given_as_text_is_tokenized_by_the_engine_once(vllm_engine: RealEngine):
    s = Session(session_id="txt", workload="rlhf", prompt_text="ka to ri ne su", max_tokens=8)
    out, = run_sessions(vllm_engine, [s])
    ids = httpx.post(f"{vllm_engine.url}/tokenize",
                     json={"model": vllm_engine.model, "prompt": "ka to ri ne su"}).json()["tokens"]
    assert out.result.status == SessionState.done, out.result.error
    assert out.result.turn_records[0].input_token_ids == ids


def test_seeded_prompts_prefilled_together_do_not_kill_the_cpu_engine(vllm_engine: RealEngine):
    """Finding 6: vLLM's CPU build with chunked prefill died on a seeded request whose prompt
    was prefilled in chunks (RuntimeError: CPU Generator does not use offset), as happens when
    several long prompts arrive together; the worker starts it with chunked prefill off."""
    prompts = [[(i * 131 + j) % 1900 + 10 for j in range(1200)] for i in range(4)]
    outs = run_sessions(vllm_engine, [session(f"c{i}", p, max_tokens=16, seed=i)
                                      for i, p in enumerate(prompts)])
    assert [o.result.status for o in outs] == [SessionState.done] * 4
    assert httpx.get(f"{vllm_engine.url}/health").status_code == 200


def metrics(engine: RealEngine):
    return parse_metrics(httpx.get(f"{engine.url}/metrics").text)


def test_the_metrics_the_broker_reads_are_parsed_from_vllms_own(vllm_engine: RealEngine):
    before = metrics(vllm_engine)
    assert (before.num_gpu_blocks, before.block_size) == (BLOCKS, BLOCK)
    prompt = [(j * 7) % 2000 + 3 for j in range(320)]  # ten whole blocks
    vllm_engine.generate(prompt, max_tokens=2)
    second = vllm_engine.generate(prompt, max_tokens=2)
    after = metrics(vllm_engine)
    # The prefix cache counts whole blocks: all but the block the last token needs again.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 288
    assert after.metrics.prefix_queries_total - before.metrics.prefix_queries_total == 640
    assert after.metrics.prefix_hits_total - before.metrics.prefix_hits_total == 288
    assert after.prompt_tokens_total - before.prompt_tokens_total == 640
    assert after.generation_tokens_total - before.generation_tokens_total == 4
    # While requests run: running, waiting and KV use move.
    seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(metrics(vllm_engine).metrics)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with httpx.Client(timeout=120) as http:
            def one(i):
                http.post(f"{vllm_engine.url}/inference/v1/generate", json={
                    "token_ids": [i + 5] * 100,
                    "sampling_params": {"max_tokens": 400, "ignore_eos": True}})
            threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        stop.set()
        watcher.join()
    assert max(m.running for m in seen) >= 2
    assert max(m.kv_usage for m in seen) > 0.05
    assert metrics(vllm_engine).metrics.running == 0

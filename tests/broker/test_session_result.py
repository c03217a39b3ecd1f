"""SessionResult as a trainer reads it: turn records, the trajectory view, sampling checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from broker.session import SamplingParams, SessionResult, SessionState, TurnRecord


def result() -> SessionResult:
    return SessionResult(session_id="s", workload="agentic", status=SessionState.done, turns=2,
                         turn_records=[
                             TurnRecord(turn=0, input_token_ids=[1, 2, 3], output_token_ids=[7, 8],
                                        output_logprobs=[-0.1, -2.0], finish_reason="stop",
                                        policy_version=4),
                             TurnRecord(turn=1, input_token_ids=[5], output_token_ids=[9],
                                        output_logprobs=[-0.5], finish_reason="length",
                                        policy_version=5),
                         ])


def test_trajectory_masks_prompt_and_observation_tokens_and_aligns_logprobs_and_versions():
    t = result().trajectory()
    assert t.token_ids == [1, 2, 3, 7, 8, 5, 9]
    assert t.loss_mask == [0, 0, 0, 1, 1, 0, 1]
    assert t.logprobs == [0.0, 0.0, 0.0, -0.1, -2.0, 0.0, -0.5]
    assert t.policy_versions == [-1, -1, -1, 4, 4, -1, 5]
    assert result().output_token_ids == [[7, 8], [9]]


def test_a_result_survives_the_json_round_trip_through_redis():
    r = result()
    back = SessionResult.model_validate_json(r.model_dump_json())
    assert back == r and back.trajectory() == r.trajectory()


def test_a_turn_record_with_logprobs_for_other_tokens_is_refused_naming_the_field():
    with pytest.raises(ValidationError, match="output_logprobs: 1 logprobs for 2 output tokens"):
        TurnRecord(turn=0, output_token_ids=[1, 2], output_logprobs=[-0.3])


@pytest.mark.parametrize("field, value", [
    ("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0.0), ("stop", [""]),
    ("stop_token_ids", [-1]), ("logprobs", 1),
])
def test_sampling_params_refuse_what_vllm_refuses_naming_the_field(field, value):
    with pytest.raises(ValidationError) as info:
        SamplingParams(**{field: value})
    assert info.value.errors()[0]["loc"][0] == field


def test_a_resumed_session_is_placed_and_charged_from_the_context_it_goes_on_from() -> None:
    from broker.session import PartialRollout, Session
    from broker.snapshot import pending_item, resident_meta

    s = Session(session_id="a", workload="agentic", prompt_token_ids=[1] * 100, max_tokens=50,
                max_turns=4, metadata={"tool": "sim"})
    history = [1] * 100 + [2] * 40 + [3] * 60
    resumed = s.model_copy(update={"resume_from": PartialRollout(
        turn_records=[], history_token_ids=history, turn=1, next_input_token_ids=[3] * 60)})
    assert pending_item(s, 0.0).prompt_tokens == 100
    item = pending_item(resumed, 0.0)
    assert item.prompt_tokens == 200 and item.prefix == tuple(history)
    assert resident_meta(resumed, 0.0).prompt_tokens == 200

"""The invariants of a stored episode (docs/trainer-contract.md), as one reusable assertion."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from service.sim.worker import SimRequest, SimWorker


@dataclass(frozen=True)
class GenerateCall:
    input_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]


def assert_trainer_contract(
    prompt: list[int], response: list[int], mask: list[int], logprobs: list[float], calls: list[GenerateCall]
) -> None:
    # 1. Equal lengths.
    assert len(response) == len(mask) == len(logprobs)
    # 2. Every call's input is P + R[:o]; its output is R[o:o+n] exactly, mask 1, its logprobs.
    sampled = [False] * len(response)
    for call in calls:
        assert call.input_ids[: len(prompt)] == prompt
        offset, count = len(call.input_ids) - len(prompt), len(call.output_ids)
        assert call.input_ids[len(prompt) :] == response[:offset]
        assert response[offset : offset + count] == call.output_ids
        assert mask[offset : offset + count] == [1] * count
        assert logprobs[offset : offset + count] == call.logprobs
        sampled[offset : offset + count] = [True] * count
    # 3. Every other position: mask 0, logprob 0.0.
    for position, was_sampled in enumerate(sampled):
        if not was_sampled:
            assert mask[position] == 0 and logprobs[position] == 0.0, position


def _call_order(request: SimRequest) -> tuple[int, int]:
    """(turn, resume) of a rid "<episode>:<attempt>:<turn>[.<resume>]"."""
    turn, _, resume = request.rid.rsplit(":", 1)[1].partition(".")
    return int(turn), int(resume or 0)


def generate_call(request: SimRequest) -> GenerateCall:
    """What one answered request of the simulated worker carried and sampled."""
    assert request.response_body is not None
    body = json.loads(request.response_body)
    if "choices" in body:  # vLLM's /inference/v1/generate
        content = body["choices"][0]["logprobs"]["content"]
        return GenerateCall(
            request.input_ids, [e["token_id"] for e in content], [e["logprob"] for e in content]
        )
    pairs = body["meta_info"]["output_token_logprobs"]
    return GenerateCall(request.input_ids, [p[1] for p in pairs], [p[0] for p in pairs])


def sim_calls(sim: SimWorker, episode_id: str, attempt: int) -> list[GenerateCall]:
    """The generate calls the simulated worker answered for one attempt of one episode, in order."""
    prefix = f"{episode_id}:{attempt}:"
    return [
        generate_call(request)
        for request in sorted((r for r in sim.requests if r.rid.startswith(prefix)), key=_call_order)
    ]


def assert_tokens_match_calls(tokens: dict[str, Any], calls: list[GenerateCall]) -> None:
    """The trainer contract over token arrays as the API answers them (an episode, or a segment)."""
    assert_trainer_contract(
        tokens["prompt_ids"], tokens["response_ids"], tokens["loss_mask"], tokens["rollout_logprobs"], calls
    )


def assert_stored_episode_matches_sim(sim: SimWorker, episode: dict[str, Any]) -> None:
    """An episode as GET /episodes/{id} answers it: its stored attempt's calls (one per turn, and
    one per resume of a turn the engine aborted), and the trainer contract over them."""
    calls = sim_calls(sim, episode["id"], episode["attempt"])
    assert len(calls) == len(episode["turns"]) == len(episode["weight_versions"]) > 0
    assert episode["num_turns"] == sum(1 for turn in episode["turns"] if turn["resume"] == 0)
    assert_tokens_match_calls(episode, calls)

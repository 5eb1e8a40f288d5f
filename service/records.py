"""The core of the service: what an episode is asked to do, what it produces, and the request ids
of its engine calls. Pure data, no I/O: storage, the API, the loop and metrics all build on it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

DEFAULT_MAX_NEW_TOKENS = 1024  # per turn, when sampling_params has none
DEADLINE_NOTE = "deadline"  # the error of an episode that ran past its episode_timeout_seconds


# Episodes that external agents play through their OpenAI endpoint (service/agents): no env here.
EXTERNAL_ENV = "external"


class EpisodeStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"  # the environment said done
    # The turn limit, a turn cut at max_new_tokens, the response-token budget, the context length,
    # or the episode's deadline.
    TRUNCATED = "truncated"
    # The policy's doing: an unparseable tool call, an env error it caused, or a turn the engine
    # refused (an abort with a 4xx status). An engine abort of a turn (a weight update, a pause) is
    # none of these: the turn resumes where it stopped (loop/runner.py's sample_turn).
    ABORTED = "aborted"
    # Not the policy's doing, after retries: an engine error or a request the engine answered with
    # an HTTP error, the env's infrastructure (a user simulator's endpoint, a hung call), an env
    # worker's crash, or a turn the engine still aborted after MAX_TURN_RESUMES resumes. `error`
    # says which.
    FAILED = "failed"
    CANCELLED = "cancelled"  # its batch was cancelled (POST /batches/{id}/cancel) before it finished

    @property
    def finished(self) -> bool:
        return self not in (EpisodeStatus.QUEUED, EpisodeStatus.RUNNING)


FINISHED_STATUSES = frozenset(status for status in EpisodeStatus if status.finished)
# What a trainer trains on: the policy's own finished episodes. A failed one (infrastructure), a
# cancelled one (nobody's) and an aborted one (the engine refused it, or the policy's output could
# not be parsed: its reward means nothing) are dropped or masked, never trained on as reward 0.
# The records say so per row (`trainable`), as the client's trainer adapters decide.
TRAINABLE_STATUSES = frozenset({EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED})


# ---- Request ids. A generate call's rid is "<episode_id>:<attempt>:<turn>", optionally with a
# ".<suffix>" (a retried call). SGLang aborts by rid prefix: "<episode_id>:<attempt>:" reaches every
# call of one attempt, and its closing colon keeps attempt 1 from matching attempt 10.


def version_number(weight_version: str | None) -> int | None:
    """A weight version as a number, for staleness: an integer string ("3") is itself, SGLang's
    "default" (the weights it started with, before any update) is 0, anything else (None, "step-7")
    has no number and is never counted stale nor newer."""
    if weight_version == "default":
        return 0
    try:
        return int(weight_version) if weight_version is not None else None
    except ValueError:
        return None


def generate_rid(episode_id: str, attempt: int, turn: int) -> str:
    return f"{episode_id}:{attempt}:{turn}"


def attempt_rid_prefix(episode_id: str, attempt: int) -> str:
    """The prefix of every rid of one attempt of an episode."""
    return f"{episode_id}:{attempt}:"


def rid_attempt_key(rid: str) -> str:
    """The "<episode_id>:<attempt>" part of a rid: one attempt of one episode (the whole rid if not ours)."""
    return rid.rsplit(":", 1)[0] if rid.count(":") >= 2 else rid


@dataclass(frozen=True)
class EpisodeRequest:
    """What the trainer asked one episode to do: a sample of a task, as POST /episodes stored it."""

    env: str
    task_split: str
    task_index: int
    sampling_params: dict[str, Any]  # SGLang's sampling_params of every turn
    max_turns: int
    max_response_tokens: int | None = None
    max_staleness: int | None = None  # weight versions an episode's oldest token may lag the newest
    episode_timeout_seconds: float | None = None  # past it, an attempt ends truncated ("deadline")


@dataclass(frozen=True)
class EpisodeSpec:
    """One attempt at running an episode: its request, under the episode's id and attempt."""

    episode_id: str
    attempt: int
    request: EpisodeRequest

    @property
    def key(self) -> str:
        """The attempt's "<episode_id>:<attempt>": names its env session and prefixes its engine calls."""
        return f"{self.episode_id}:{self.attempt}"

    def rid(self, turn: int) -> str:
        return generate_rid(self.episode_id, self.attempt, turn)


@dataclass
class TurnRecord:
    """One generate call: a turn's first, or a resume of it after the engine aborted it."""

    turn: int
    weight_version: str | None
    finish_reason: dict[str, Any]
    output_tokens: int
    engine_seconds: float
    env_seconds: float = 0.0
    action: str | None = None  # the tool called, "respond", or None when the turn ended the episode
    has_logprobs: bool = True  # False: SGLang sent no logprobs; this turn's are placeholders (0.0)
    resume: int = 0  # 0: the turn's first generate call; n: its n-th resume after an engine abort
    # What the turn ran, in order: its tools (several: parallel calls), or ["respond"]; [] when the
    # turn ended the episode before any ran. `action` is its first, kept for older readers.
    actions: list[str] | None = None

    def __post_init__(self) -> None:
        if self.actions is None:  # stored before every record had its list
            self.actions = [] if self.action is None else [self.action]

    # The distribution this call's logprobs come from, as the engine reported it: "processed" (the
    # one sampled from, after temperature, penalties, top-k/top-p: what an importance ratio needs)
    # or "raw" (the model's, before them); None: unknown (an engine or a row that did not say).
    logprobs_mode: str | None = None
    # SGLang's meta_info: the call's prompt tokens, and how many of them its prefix cache served.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Its fields as a dict, shallow: its finish_reason and actions are the record's own, which
        nothing changes once the turn is recorded (dataclasses.asdict's deep copy was 14 us a turn)."""
        return {name: getattr(self, name) for name in _TURN_FIELDS}


_TURN_FIELDS = tuple(turn_field.name for turn_field in fields(TurnRecord))


@dataclass(frozen=True)
class EpisodeTokens:
    """The token arrays a trainer reads (the trainer contract's P, R, M, L): prompt ids, response
    ids, loss mask and rollout logprobs (SGLang's, exactly; 0.0 where not sampled), with
    len(response_ids) == len(loss_mask) == len(rollout_logprobs), checked once, here. One value
    from the episode loop to the wire: whoever makes it hands its lists over and changes them no
    more. Storage encodes and decodes it (storage/blobs.py)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]

    def __post_init__(self) -> None:
        lengths = {len(self.response_ids), len(self.loss_mask), len(self.rollout_logprobs)}
        if len(lengths) != 1:
            raise ValueError(
                f"response_ids, loss_mask and rollout_logprobs differ in length: {sorted(lengths)}"
            )


@dataclass(frozen=True)
class Ending:
    """How an agent (its endpoint's `/finish`) or an env's driver ends a handed-over episode."""

    status: EpisodeStatus
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)  # merged into the episode's info
    error: str | None = None


@dataclass
class EpisodeResult:
    """A finished episode, as stored. An episode that never got its prompt (it failed first) has
    no token arrays at all: `tokens` is None."""

    status: EpisodeStatus
    reward: float | None
    tokens: EpisodeTokens | None
    messages: list[dict[str, Any]]
    info: dict[str, Any]
    turns: list[TurnRecord] = field(default_factory=list)
    error: str | None = None
    # An infrastructure failure (engine unreachable, env worker crashed) that another attempt
    # may not meet: the worker re-queues the episode while it has attempts left.
    retryable: bool = False
    # Its oldest tokens fell more than max_staleness weight versions behind: the worker re-runs it
    # from scratch as a new attempt, which is no failure.
    stale: bool = False
    # The engine did not answer at all (an outage, not a crash): the worker re-queues it without
    # counting a failed attempt and claims nothing until the engine answers again.
    engine_down: bool = False

    @property
    def num_turns(self) -> int:
        """Turns played; `turns` holds a record per generate call (a resumed turn has several)."""
        return sum(1 for record in self.turns if record.resume == 0)

    def __post_init__(self) -> None:
        if not self.status.finished:
            raise ValueError(f"a result needs a finished status, not {self.status.value!r}")

    @classmethod
    def failed(cls, error: str) -> EpisodeResult:
        return cls(EpisodeStatus.FAILED, None, None, [], {}, error=error)

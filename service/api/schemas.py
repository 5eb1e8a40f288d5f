"""Request and response bodies of the HTTP API."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    model_validator,
)

from service.api.values import (
    JSON_INTEGER,
    MAX_JSON_DEPTH,
    Integer,
    Label,
    Text,
    field_error,
    storable_json,
)
from service.records import DEFAULT_MAX_NEW_TOKENS, EpisodeStatus, TurnRecord

# Batch ids, and the ids the service generates (uuid hex): ASCII, so that any database stores them.
BATCH_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
ID_PATTERN = BATCH_ID_PATTERN
MAX_TURNS_LIMIT = 1000
MAX_EPISODE_TIMEOUT_SECONDS = 7 * 24 * 3600
INT32_MAX = 2**31 - 1  # integers are stored as 32-bit columns
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256

# Request bodies are strict: `true` is not 1 and "0.7" is not a number (an integer is a number).
REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


# JSON values of SGLang's custom_params (its CustomParamValue): a scalar, a list or a flat object of them.
JsonScalar = None | bool | int | float | Text
CustomParam = JsonScalar | list[JsonScalar] | dict[str, JsonScalar]
# SGLang takes one string or a list of them: one is stored as a list of one, as SGLang reads it.
StopStrings = Annotated[
    list[StopString],
    Field(max_length=MAX_STOP_STRINGS),
    BeforeValidator(lambda value: [value] if isinstance(value, str) else value),
]
Penalty = Annotated[float, Field(ge=-2, le=2)]
TOKEN_ID_KEY = r"^[0-9]{1,10}$"
# Pydantic states the keys' pattern as patternProperties alone, which lets other keys through.
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=TOKEN_ID_KEY)], float],
    WithJsonSchema(
        {
            "type": "object",
            "patternProperties": {TOKEN_ID_KEY: {"type": "number"}},
            "additionalProperties": False,
        }
    ),
]


class SamplingParams(BaseModel):
    """SGLang's sampling_params of every turn: each name SGLang's /generate takes (its
    sampling_params.py), checked against the bounds SGLang enforces, and forwarded as given. A
    name SGLang does not know is refused, not silently dropped."""

    model_config = REQUEST_CONFIG

    max_new_tokens: Integer = Field(
        default=DEFAULT_MAX_NEW_TOKENS, ge=1, le=1_000_000, description="Per turn."
    )
    min_new_tokens: Annotated[int, Field(ge=0), JSON_INTEGER] | None = Field(
        default=None, description="At most max_new_tokens."
    )
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: (
        Annotated[int, Field(ge=-1, le=INT32_MAX, json_schema_extra={"not": {"const": 0}}), JSON_INTEGER]
        | None
    ) = Field(default=None, description="-1: off; not 0.")
    min_p: float | None = Field(default=None, ge=0, le=1)
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(default=None, gt=0, le=2, description="1: off.")
    stop: StopStrings | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX), JSON_INTEGER]] | None = Field(
        default=None, max_length=MAX_STOP_TOKEN_IDS
    )
    stop_regex: StopStrings | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: Annotated[int, Field(ge=1, le=1), JSON_INTEGER] | None = Field(
        default=None, description="Only 1: an episode follows one conversation."
    )
    json_schema: Text | None = None
    regex: Text | None = None
    ebnf: Text | None = None
    structural_tag: Text | None = None
    logit_bias: LogitBias | None = Field(default=None, description="Token id (as a string) -> bias.")
    custom_params: Annotated[dict[str, CustomParam], AfterValidator(storable_json)] | None = Field(
        default=None, description="For SGLang's custom logit processors."
    )
    # Exact in a JSON number (a double) up to 2**53.
    sampling_seed: Annotated[int, Field(ge=0, le=2**53), JSON_INTEGER] | None = None
    stream_interval: Annotated[int, Field(ge=1, le=INT32_MAX), JSON_INTEGER] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.min_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise field_error(
                ["min_new_tokens"],
                "min_new_tokens_above_max",
                f"min_new_tokens ({self.min_new_tokens}) is above max_new_tokens ({self.max_new_tokens})",
                self.min_new_tokens,
            )
        if self.top_k == 0:
            raise field_error(["top_k"], "top_k_zero", "top_k is -1 (off) or at least 1, not 0", 0)
        grammars = [name for name in ("json_schema", "regex", "ebnf") if getattr(self, name) is not None]
        if len(grammars) > 1:
            raise field_error(
                [grammars[1]],
                "one_grammar",
                f"{' and '.join(grammars)} are set: SGLang takes only one of json_schema, regex, ebnf",
                getattr(self, grammars[1]),
            )
        return self

    def to_sglang(self) -> dict[str, Any]:
        """What was given (null is SGLang's default, so it is left out), and max_new_tokens always."""
        return self.model_dump(exclude_none=True)


class SubmitEpisodes(BaseModel):
    model_config = REQUEST_CONFIG

    batch_id: str | None = Field(
        default=None,
        pattern=BATCH_ID_PATTERN,
        description="Idempotency key; generated if absent. The same batch_id with the same body "
        "answers the same episodes; with another body, 409.",
    )
    env: Label = Field(description="An environment name from GET /envs.")
    task_split: Label | None = Field(
        default=None,
        description="A split of that environment. Required unless the environment declares its training "
        "split (`train_split` in GET /envs), which it then runs: there is no silent default. Env "
        "`external`: a label, empty if absent.",
    )
    task_indices: list[Annotated[int, Field(ge=0), JSON_INTEGER]] = Field(
        min_length=1, description="Tasks to run (indices in the split); each is one group."
    )
    samples_per_task: Integer = Field(
        default=1, ge=1, le=1024, description="Episodes per task (a GRPO group)."
    )
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    max_turns: Integer = Field(
        default=30, ge=1, le=MAX_TURNS_LIMIT, description="Generate calls per episode."
    )
    max_response_tokens: Annotated[int, Field(ge=1, le=INT32_MAX), JSON_INTEGER] | None = Field(
        default=None,
        description="Budget of response tokens (sampled and context) per episode.",
    )
    max_staleness: Annotated[int, Field(ge=0, le=INT32_MAX), JSON_INTEGER] | None = Field(
        default=None,
        description="Weight versions an episode's oldest sampled token may lag the newest version the "
        "service has seen; past it the episode re-runs from scratch (a new attempt, not a failure). "
        "Versions are integers; SGLang's 'default' counts 0; other names are never stale.",
    )
    episode_timeout_seconds: float | None = Field(
        default=None,
        gt=0,
        le=MAX_EPISODE_TIMEOUT_SECONDS,
        description="An episode still running this long after it started ends truncated, its error "
        "'deadline: ...', its engine request aborted and its env closed; its reward is the env's so far.",
    )
    metadata: Annotated[dict[str, Any], AfterValidator(storable_json)] = Field(
        default_factory=dict,
        description="Echoed back with the batch: JSON of finite numbers and Unicode text, nested at most "
        f"{MAX_JSON_DEPTH} levels.",
    )


class AgentEndpoint(BaseModel):
    """Where an external agent plays one episode: `OpenAI(base_url=base_url, api_key=api_key)`."""

    episode_id: str
    base_url: str = Field(description="The episode's OpenAI base URL: <service>/v1/episodes/{id}.")
    api_key: str = Field(description="The episode's own bearer token (its agent needs no API key).")


class SubmitAccepted(BaseModel):
    batch_id: str
    episode_ids: list[str] = Field(description="Ordered by task (group), then sample.")
    created: bool = Field(description="False when this was an idempotent resubmission.")
    agents: list[AgentEndpoint] | None = Field(
        default=None, description="Env `external`: each episode's OpenAI endpoint, as episode_ids."
    )


class EpisodeSummary(BaseModel):
    id: str
    status: EpisodeStatus
    reward: float | None
    group_index: int
    sample_index: int
    task_index: int
    attempt: int
    num_turns: int | None
    prompt_length: int | None
    response_length: int | None
    error: str | None
    trainable: bool = Field(
        description="Train on it: it is `completed` or `truncated`. A `failed`, `aborted` or "
        "`cancelled` episode is dropped or masked by the trainer, never trained on as reward 0."
    )


class EpisodeTokensOut(BaseModel):
    prompt_ids: list[int] | None
    response_ids: list[int] | None
    loss_mask: list[int] | None
    rollout_logprobs: list[float] | None
    weight_versions: list[str | None]
    logprobs_modes: list[str | None] = Field(
        description="Per generate call, the distribution its rollout_logprobs come from, as the engine "
        "reported it: 'processed' (the one sampled from, after temperature, penalties and top-k/top-p: "
        "what an importance ratio needs) or 'raw' (the model's, before them); null: unknown."
    )
    segment: int = Field(
        default=0, description="Which segment of its episode these tokens are (external agents)."
    )
    segments: int = Field(
        default=1,
        description="Its episode's segments: an external agent that rewrote its history has several.",
    )


class EpisodeWithTokens(EpisodeSummary, EpisodeTokensOut):
    """A batch entry with `include_tokens=true`."""


class SegmentOut(BaseModel):
    """An earlier segment of an external agent's episode: a training sample of its own."""

    segment: int
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    turns: list[dict[str, Any]]
    messages: list[dict[str, Any]]


class EpisodeDetail(EpisodeWithTokens):
    batch_id: str
    env: str
    task_split: str
    sampling_params: dict[str, Any]
    max_turns: int
    messages: list[dict[str, Any]] | None
    info: dict[str, Any] | None
    finish_reasons: list[dict[str, Any]]
    token_weight_versions: list[str | None] | None = Field(
        description="Per response token: the weight version of the generate call that sampled it; "
        "null where not sampled (mask 0) or not reported."
    )
    turns: list[TurnRecord] = Field(
        description="One per generate call: a turn's first, then its resumes after engine aborts."
    )
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    earlier_segments: list[SegmentOut] = Field(
        default_factory=list, description="The segments before the last (whose tokens are above), in order."
    )


class RewardStatsOut(BaseModel):
    """A group's rewards, over its episodes that have one (all null when none has); `std` is the
    population's (ddof 0), exactly 0 when the rewards are all equal."""

    count: int
    mean: float | None
    std: float | None
    min: float | None
    max: float | None


class BatchGroupOut(BaseModel):
    group_index: int
    reward: RewardStatsOut


class BatchInfo(BaseModel):
    """A batch's own fields, as its request stored them."""

    batch_id: str
    env: str
    task_split: str
    metadata: dict[str, Any]
    created_at: datetime
    cancelled_at: datetime | None


class BatchOut(BatchInfo):
    counts: dict[str, int] = Field(description="Episodes per status.")
    total: int
    finished: int
    complete: bool = Field(description="Every episode has a final status.")
    groups_total: int
    groups_complete: int
    groups_filtered: int = Field(
        description="Complete groups whose rewards are all equal (no learning signal): those "
        "`GET /groups?min_reward_std=0` skips, as DAPO's dynamic sampling does."
    )
    groups: list[BatchGroupOut] = Field(description="The complete groups' reward statistics, by group index.")
    waiting_for_engine: str | None = Field(
        default=None,
        description="While some of its episodes are unfinished and the engine does not answer: one "
        "line saying so (its episodes wait for it; an outage costs them no attempt). Null otherwise.",
    )
    episodes: list[EpisodeWithTokens] | list[EpisodeSummary] = Field(
        description="Episodes of complete groups only: a group arrives whole, once all its samples ended. "
        "With include_tokens=true each carries its token arrays."
    )


class BatchListItem(BatchInfo):
    counts: dict[str, int] = Field(description="Episodes per status.")
    total: int
    reward_mean: float | None = Field(description="Over its episodes that have a reward so far.")


class BatchListOut(BaseModel):
    batches: list[BatchListItem] = Field(description="Newest first.")
    next: str | None = Field(
        description="`before=` this for the next (older) page; null: this is the last page."
    )


class BatchEpisodesOut(BatchInfo):
    waiting_for_engine: str | None = Field(
        default=None,
        description="While some of its episodes are unfinished and the engine does not answer: one "
        "line saying so (its episodes wait for it; an outage costs them no attempt). Null otherwise.",
    )
    episodes: list[EpisodeSummary] = Field(
        description="By group, then sample: every status, or those asked for."
    )


class TokenTurnOut(BaseModel):
    """One generate call's sampled tokens in the response: response_ids[start:end] holds them (with
    the context tokens between them, mask 0, when the template put any there)."""

    turn: int
    resume: int
    weight_version: str | None
    start: int
    end: int
    engine_seconds: float
    env_seconds: float


class EpisodeTokenView(BaseModel):
    """An episode's tokens as text, decoded by the service's tokenizer one token at a time; tokens
    that split a multi-byte character give it to the first of them, the others read empty."""

    episode_id: str
    prompt_text: str = Field(description="The prompt, decoded whole.")
    response_ids: list[int]
    response_tokens: list[str] = Field(
        description="Each response token's text; where tokens split a multi-byte character, the "
        "first of them holds it and the others are empty."
    )
    loss_mask: list[int]
    rollout_logprobs: list[float]
    turns: list[TokenTurnOut] = Field(description="The generate calls, in order.")


class GroupOut(BaseModel):
    """A complete group in the stream of GET /groups."""

    cursor: int = Field(description="Its place in the stream: `after=` this gives the groups after it.")
    batch_id: str
    group_index: int
    env: str
    task_index: int
    completed_at: datetime
    reward: RewardStatsOut
    cancelled: bool = Field(
        description="Its batch was cancelled before the group finished: some of its episodes are "
        "`cancelled` (no tokens). The client skips such groups unless asked."
    )
    trainable: int = Field(description="Its episodes a trainer trains on (`trainable`).")
    episodes: list[EpisodeSummary] = Field(description="Its episodes, by sample index.")


class GroupsOut(BaseModel):
    groups: list[GroupOut] = Field(description="In the order they completed.")
    next: int = Field(
        description="The cursor for the next page: past every group this page looked at, the "
        "filtered ones included. The same as `after` when none was found."
    )
    filtered: int = Field(description="Complete groups this page skipped for `min_reward_std`.")


class CancelOut(BaseModel):
    batch_id: str
    cancelled: int = Field(description="Episodes this call cancelled (queued or running); 0 on a repeat.")
    counts: dict[str, int] = Field(description="The batch's episodes per status, after.")


class EnvOut(BaseModel):
    name: str
    description: str
    splits: dict[str, int] = Field(description="Split name -> number of tasks.")
    unavailable: dict[str, str] = Field(
        default_factory=dict,
        description="Splits that cannot run on this install, and why (the data file it lacks); "
        "submitting them is a 422 saying so. Key `*`: the environment cannot run at all (a plugin that "
        "failed to load, or an invalid spec), and why.",
    )
    judged_tasks: dict[str, int] = Field(
        default_factory=dict,
        description="Per split, how many tasks need an LLM judge for their reward (tau2's NL_ASSERTION): "
        "refused at submit unless JUDGE_BASE_URL is set.",
    )
    train_split: str | None = Field(
        default=None,
        description="The split a submit without `task_split` runs; null: every submit names its split.",
    )
    source: str = Field(
        default="builtin",
        description="Where the environment comes from: builtin, or a plugin (its entry point and "
        "package, or its ENV_PLUGINS loader).",
    )


class ModelOut(BaseModel):
    tokenizer_path: str = Field(description="TOKENIZER_PATH: the served model's tokenizer and chat template.")
    tool_call_format: str = Field(
        description="The tool-call format parsed (TOOL_CALL_FORMAT, auto resolved)."
    )
    tool_call_formats: list[str] = Field(description="Every format TOOL_CALL_FORMAT may name.")


class HealthOut(BaseModel):
    status: str
    database: str


class ReadyOut(BaseModel):
    ready: bool
    database: str
    engine: str
    # Remote env servers (REMOTE_ENVS) by "<env> <url>": "ok", or "down: why" while out of placement.
    env_servers: dict[str, str] = Field(default_factory=dict)


class AccessOut(BaseModel):
    """What the caller's API key opens (GET /access)."""

    admin: bool = Field(description="An admin key (API_KEYS), or no key set: every batch, and /engine.")
    project: str | None = Field(description="The key's project (API_PROJECTS); null for an admin.")
    batch_prefix: str = Field(
        description="What the batch ids this key sees and submits start with; empty for an admin. A "
        "client prefixes the batch ids it makes with it."
    )

"""Every setting of the service, read from the environment (or a `.env` file)."""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.engine.client import ABORT_QUIET_GROWTH, ABORT_QUIET_SECONDS
from service.envs.base import UserSimConfig
from service.envs.executors import THREADS_PER_WORKER, ExecutorKind
from service.envs.host import CALL_TIMEOUT_SECONDS
from service.loop.runner import DEFAULT_MAX_TURN_RESUMES
from service.storage.db import (
    POSTGRES_CONNECT_TIMEOUT_SECONDS,
    POSTGRES_MAX_OVERFLOW,
    POSTGRES_POOL_SIZE,
    POSTGRES_POOL_TIMEOUT_SECONDS,
    async_url,
)

PACKAGE_DIR = Path(__file__).resolve().parent
TEST_TOKENIZER_DIR = PACKAGE_DIR / "assets" / "tokenizer"

# The instruction the seed (slime's tau-bench agent) puts in place of the chat template's
# "You may call one or more functions" sentence: tau-bench allows at most one action a turn.
ONE_CALL_TOOL_INSTRUCTION = (
    " At each turn, you are allowed to call one or no function to assist "
    "with task execution using <tools></tools> XML tags.\n"
    "YOU MUST EXECUTE TOOLS TO MAKE ANY MODIFICATIONS OR CANCELLATIONS. "
    "Each tool call leads to a message returned by the system.\n"
    "NEVER confirm execution to the user without seeing confirmation "
    "from the tool system.\n"
)
TEMPLATE_TOOL_INSTRUCTION = "You may call one or more functions to assist with the user query."


# What a batch id may hold (service/api/schemas.py's BATCH_ID_PATTERN, 128 characters): a project's
# prefix is the start of one, and leaves room for the 32 hex digits of a generated id after it.
BATCH_PREFIX_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
MAX_BATCH_PREFIX = 96


@dataclass(frozen=True)
class Access:
    """What one API key opens: every batch (an admin key, or any caller when no key is set), or
    those of one project, whose ids start with its `batch_prefix`."""

    project: str | None  # None: an admin
    batch_prefix: str  # "" for an admin

    @property
    def admin(self) -> bool:
        return self.project is None

    def owns(self, batch_id: str) -> bool:
        return batch_id.startswith(self.batch_prefix)


ADMIN = Access(project=None, batch_prefix="")


class ProjectKeys(BaseModel):
    """One project of API_PROJECTS."""

    model_config = ConfigDict(extra="forbid", strict=True)

    keys: list[str] = Field(min_length=1, description="The project's bearer keys.")
    batch_prefix: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_BATCH_PREFIX,
        pattern=BATCH_PREFIX_PATTERN,
        description="What its batch ids start with; default '<project>:'.",
    )


_PROJECTS = TypeAdapter(dict[str, ProjectKeys])


class KeyTable:
    """API key -> what it opens: API_KEYS are admin keys, each of API_PROJECTS' keys opens its
    project's batches. A lookup compares every key, each in constant time (hmac.compare_digest)."""

    def __init__(self, admin_keys: list[str], projects: dict[str, Access], project_keys: dict[str, str]):
        self.entries: list[tuple[bytes, Access]] = [(key.encode(), ADMIN) for key in admin_keys] + [
            (key.encode(), projects[project]) for key, project in project_keys.items()
        ]
        self.projects = projects

    @property
    def open(self) -> bool:
        """No key at all is set: anyone who can reach the service is an admin."""
        return not self.entries

    def lookup(self, key: bytes | None) -> Access | None:
        """What `key` opens; None for no key or an unknown one (every key compared, no early exit)."""
        if key is None:
            return None
        found = None
        for candidate, access in self.entries:
            if hmac.compare_digest(key, candidate):
                found = access
        return found

    @classmethod
    def parse(cls, admin_keys: list[str], projects_json: str) -> KeyTable:
        """From API_KEYS' keys and API_PROJECTS (a JSON object: project -> {keys, batch_prefix}).
        Raises ValueError saying what is wrong, never with a key in it."""
        projects: dict[str, Access] = {}
        owner: dict[str, str] = {key: "API_KEYS" for key in admin_keys}
        if not projects_json.strip():
            return cls(admin_keys, projects, {})
        try:
            parsed = _PROJECTS.validate_json(projects_json)
        except ValidationError as error:
            problems = "; ".join(
                f"{'.'.join(str(part) for part in item['loc']) or 'the value'}: {item['msg']}"
                for item in error.errors(include_input=False)
            )
            raise ValueError(
                'a JSON object like {"team-a": {"keys": ["..."], "batch_prefix": "team-a:"}} is expected; '
                + problems
            ) from None
        project_keys: dict[str, str] = {}
        for name, project in parsed.items():
            if not name.strip():
                raise ValueError("a project's name is empty")
            prefix = project.batch_prefix if project.batch_prefix is not None else f"{name}:"
            if len(prefix) > MAX_BATCH_PREFIX or re.fullmatch(BATCH_PREFIX_PATTERN, prefix) is None:
                raise ValueError(
                    f"project {name!r}: its default batch_prefix {prefix!r} is not the start of a batch id "
                    f"([A-Za-z0-9][A-Za-z0-9._:-]*, at most {MAX_BATCH_PREFIX} characters): set batch_prefix"
                )
            for other, access in projects.items():
                if access.batch_prefix.startswith(prefix) or prefix.startswith(access.batch_prefix):
                    raise ValueError(
                        f"projects {other!r} and {name!r}: batch prefixes {access.batch_prefix!r} and "
                        f"{prefix!r} overlap (one starts the other): each batch id must belong to one project"
                    )
            projects[name] = Access(project=name, batch_prefix=prefix)
            for key in project.keys:
                if not key or not key.isascii() or not key.isprintable() or " " in key:
                    # What a header carries as sent: printable ASCII, and a bearer key no space.
                    raise ValueError(f"project {name!r}: a key is empty, or holds whitespace or non-ASCII")
                if key in owner:
                    where = "API_KEYS" if owner[key] == "API_KEYS" else f"project {owner[key]!r}"
                    raise ValueError(f"project {name!r}: one of its keys is also a key of {where}")
                owner[key] = name
                project_keys[key] = name
        return cls(admin_keys, projects, project_keys)


class UserSimSettings(BaseSettings, UserSimConfig):
    """UserSimConfig as the environment (or `.env`) sets it, by its fields' aliases: USER_SIM_*, JUDGE_*."""

    model_config = SettingsConfigDict(env_file=".env", extra="ignore", frozen=True, validate_by_name=True)


class Settings(BaseSettings):
    # A refused value is not repeated in the error: API_KEYS, API_PROJECTS and DATABASE_URL hold secrets.
    model_config = SettingsConfigDict(env_file=".env", extra="ignore", hide_input_in_errors=True)

    database_url: str = Field(
        default="sqlite+aiosqlite:///./rollouts.db",
        description="SQLAlchemy async URL: sqlite+aiosqlite:///path or postgresql+asyncpg://user@host/db; "
        "postgresql://, postgres:// and sqlite:// mean the same (the installed async drivers).",
    )
    engine: Literal["sglang", "vllm"] = Field(
        default="sglang",
        description="The inference engine's protocol: SGLang's /generate, or vLLM's /inference/v1/generate "
        "(a vLLM server started with --enable-scale-out, and VLLM_SERVER_DEV_MODE=1 for /engine/pause).",
    )
    sglang_url: str = Field(
        default="http://127.0.0.1:30000",
        description="The engine's URL: one SGLang worker, or the SGLang router in front of many; with "
        "ENGINE=vllm, the vLLM server.",
    )
    sglang_worker_urls: str = Field(
        default="",
        description="Comma-separated worker URLs for control calls (abort, pause) when SGLANG_URL is a "
        "router; empty means ask the router's GET /workers, or use SGLANG_URL itself.",
    )
    engine_placement: Literal["sticky", "round_robin", "router"] = Field(
        default="sticky",
        description="Where generate calls go. sticky: with SGLANG_WORKER_URLS, the service places every "
        "call of an episode on one of those workers, and a group's episodes on one while its load allows "
        "(prefix-cache hits); without them, every call goes to SGLANG_URL with the episode's group as the "
        "router's routing key (X-SMG-Routing-Key; the router's --policy manual pins it). round_robin: "
        "calls spread over SGLANG_WORKER_URLS one by one. router: every call to SGLANG_URL, the workers "
        "listed only for control calls.",
    )
    tokenizer_path: str = Field(
        default=str(TEST_TOKENIZER_DIR),
        description="A Hugging Face tokenizer directory (or hub id, if cached) with a chat template that "
        "renders system, user, assistant and tool messages. Default: the project's small test tokenizer.",
    )
    tool_call_format: str = Field(
        default="auto",
        description="Tool-call format of the policy, by SGLang's --tool-call-parser names (qwen25, "
        "qwen3_coder, llama3, mistral, deepseekv3, glm45, kimi_k2, gpt-oss, ...); auto: the one the "
        "tokenizer's chat template writes.",
    )
    tool_instruction: str = Field(
        default=ONE_CALL_TOOL_INSTRUCTION,
        description="Replaces TEMPLATE_TOOL_INSTRUCTION in the rendered system prompt; empty keeps it.",
    )
    template_tool_instruction: str = Field(
        default=TEMPLATE_TOOL_INSTRUCTION,
        description="The chat template's own tool instruction sentence, the one replaced.",
    )
    api_keys: SecretStr = Field(
        default=SecretStr(""),
        description="Comma-separated API keys; when set, every endpoint but the probes and the scrape "
        "(/health, /ready, /metrics) needs "
        "'Authorization: Bearer <key>'. Unset: no authentication (a warning is logged at start). These "
        "are admin keys: they open every batch, and /engine's controls; API_PROJECTS gives keys a scope.",
    )
    api_projects: SecretStr = Field(
        default=SecretStr(""),
        description='Keys with a scope, as a JSON object: {"team-a": {"keys": ["k1", "k2"], '
        '"batch_prefix": "team-a:"}, ...} (batch_prefix defaults to "<project>:"). A project key '
        "sees, lists, streams, pulls and cancels only batches whose id starts with its prefix (anything "
        "else is a 404, as if it did not exist), submits only such batches (a generated id gets the "
        "prefix), and is refused /engine's controls (403). GET /access tells a key its scope. No key "
        "may be in two projects or in API_KEYS, and no prefix may start another.",
    )

    serve_workers: int = Field(
        default=1,
        ge=1,
        description="Service processes `serve` runs on its one port and database (`--workers` overrides "
        "it), so that one machine's cores all work: each is the whole service (API, worker, env workers, "
        "engine client); a parent supervises them and serves nothing. MAX_RUNNING_EPISODES, "
        "MAX_INFLIGHT_GENERATES and ENV_WORKERS are then the command's totals, shared among them.",
    )

    http_keep_alive_seconds: int = Field(
        default=75,
        ge=1,
        description="How long the service keeps an idle HTTP connection open (uvicorn's own default is "
        "5 s). Longer than the idle time of common clients' connection pools (aiohttp 15 s, httpx 5 s), "
        "so the client drops an idle connection first: a connection the server closes just as a client "
        "reuses it fails that request (aiohttp's ServerDisconnectedError), and no client re-sends a POST.",
    )

    serve_api_processes: int = Field(
        default=0,
        ge=0,
        description="Processes `serve` runs that serve the API alone (`--api-processes` overrides it). "
        "With any, they take every request on the port and the SERVE_WORKERS processes run episodes "
        "behind them, each on a private loopback port: a trainer's polls and pulls never wait behind "
        "the episodes' CPU, however many run.",
    )

    # The database connections of each service process (PostgreSQL; SQLite opens one per use).
    database_pool_size: int = Field(
        default=POSTGRES_POOL_SIZE,
        ge=1,
        description="Pooled PostgreSQL connections per process: the writer holds one (all writes go "
        "through it, committed in groups), the rest serve reads (API requests, long-poll checks, one per "
        "Arrow or JSON pull while it streams). With `--workers N`, N times this many.",
    )
    database_max_overflow: int = Field(
        default=POSTGRES_MAX_OVERFLOW,
        ge=0,
        description="Connections opened beyond the pool under bursts of reads.",
    )
    database_pool_timeout_seconds: float = Field(
        default=POSTGRES_POOL_TIMEOUT_SECONDS,
        gt=0,
        description="How long a request waits for a free connection before answering 503 (Retry-After).",
    )
    database_connect_timeout_seconds: float = Field(
        default=POSTGRES_CONNECT_TIMEOUT_SECONDS,
        gt=0,
        description="How long opening a PostgreSQL connection may take before it counts as failed "
        "(a transient error: the work is retried, a request answered 503).",
    )
    database_transaction_pooler: bool = Field(
        default=False,
        description="PostgreSQL is reached through a transaction-mode pooler (PgBouncer pool_mode="
        "transaction, older than 1.21 or with max_prepared_statements=0): prepared statements are not "
        "kept across transactions. Not needed for a direct connection or a session-mode pooler.",
    )

    # The queue and the worker.
    run_worker: bool = Field(default=True, description="Run episodes in this process (false: API only).")
    lease_seconds: float = Field(
        default=20.0, gt=0, description="An episode whose lease is not renewed for this long is re-queued."
    )
    sweep_interval_seconds: float = Field(
        default=5.0, gt=0, description="How often expired leases are swept."
    )
    claim_interval_seconds: float = Field(
        default=0.2, gt=0, description="Idle poll interval of the claim loop when the queue was empty."
    )
    # It bounds failed attempts, not attempts: MAX_ATTEMPTS, its name in the environment, stays.
    max_failed_attempts: int = Field(
        default=3,
        ge=1,
        validation_alias=AliasChoices("max_attempts", "max_failed_attempts"),
        description="MAX_ATTEMPTS: an episode fails after this many failed attempts (its worker crashed "
        "or was killed, or the engine stayed unreachable); releases on a graceful shutdown and re-runs "
        "of stale episodes do not count.",
    )
    max_running_episodes: int = Field(default=2048, ge=1, description="Episodes in flight in this process.")
    max_inflight_generates: int = Field(default=512, ge=1, description="Concurrent /generate calls.")
    env_workers: int = Field(default=2, ge=1, description="Environment worker processes (or threads).")
    env_executor: ExecutorKind = Field(
        default="process", description="Env work in worker processes (tau-bench: CPU-heavy) or threads."
    )
    env_threads_per_worker: int = Field(
        default=THREADS_PER_WORKER,
        ge=1,
        description="Env calls one env worker runs at once (each episode's calls stay one at a time): "
        "user-simulator turns wait on HTTP inside env.step, so they overlap on threads.",
    )
    env_call_timeout_seconds: float = Field(
        default=CALL_TIMEOUT_SECONDS,
        gt=0,
        description="Timeout of one env open/reset/step; past it the call raises an env error "
        "(TimeoutError) and the episode's environment is abandoned (a stuck thread cannot be stopped).",
    )
    shutdown_timeout_seconds: float = Field(
        default=30.0, ge=0, description="On SIGTERM, how long in-flight episodes may run before release."
    )

    # Environment plugins (service/envs/plugins.py): installed packages' `rollout_service.envs` entry
    # points load by themselves; these are for local work without packaging.
    env_plugins: str = Field(
        default="",
        description="Comma-separated `module:function` loaders of environment plugins (each function "
        "returns EnvSpecs), loaded in every service process as entry points are; env worker processes "
        "import each spec's factory by its module.",
    )

    @field_validator("database_url")
    @classmethod
    def _with_async_driver(cls, url: str) -> str:
        return async_url(url)

    # Environments on servers of their own (service/envs/remote/, docs/remote-envs.md).
    remote_envs: str = Field(
        default="",
        description="Remote environments (OpenEnv servers, MCP tool servers, NeMo Gym resource servers): "
        "a JSON list of {name, protocol, urls, splits, ...}, or the path of a JSON or YAML file holding one.",
    )

    @property
    def env_plugin_list(self) -> list[str]:
        return [loader.strip() for loader in self.env_plugins.split(",") if loader.strip()]

    # Engine calls.
    engine_timeout_seconds: float = Field(default=600.0, gt=0, description="Timeout of one /generate call.")
    engine_retries: int = Field(default=5, ge=0, description="Retries of a connection error or 5xx.")
    engine_backoff_seconds: float = Field(default=0.5, ge=0, description="First retry delay; doubles.")
    max_turn_resumes: int = Field(
        default=DEFAULT_MAX_TURN_RESUMES,
        ge=0,
        description="Engine aborts (weight updates, pause_generation) one turn is resumed after; "
        "one more fails the episode.",
    )
    engine_abort_quiet_seconds: float = Field(
        default=ABORT_QUIET_SECONDS,
        ge=0,
        description="After the engine aborts requests, no generate call goes to it for this long "
        f"(doubling, up to {ABORT_QUIET_GROWTH}x, while aborts keep coming), so that a trainer sees it idle.",
    )
    engine_logprobs_mode: Literal["auto", "processed", "raw"] = Field(
        default="auto",
        description="Which distribution the engine's logprobs come from, recorded on every turn "
        "(turns[].logprobs_mode): 'processed', the one sampled from (after temperature, penalties, "
        "top-k/top-p), or 'raw', the model's before them. auto: what the engine reports (vLLM's "
        "--logprobs-mode, from its dev-mode /server_info), and SGLang's default, processed (set raw for "
        "an SGLang run with SGLANG_RETURN_ORIGINAL_LOGPROB=1, which it does not report).",
    )
    max_pause_seconds: float = Field(
        default=600.0,
        gt=0,
        description="Longest pause of generation (POST /engine/pause): past it without POST "
        "/engine/continue the service resumes the engine itself and logs a warning. Meanwhile /ready "
        "answers 503 and /metrics' rollout_engine_paused is 1.",
    )

    # Limits.
    max_request_bytes: int = Field(default=1_048_576, ge=1024, description="Largest accepted request body.")
    max_episodes_per_request: int = Field(default=10_000, ge=1, description="Episodes one POST may create.")
    max_long_poll_seconds: float = Field(default=300.0, ge=0, description="Upper bound of ?wait=.")
    external_idle_seconds: float = Field(
        default=600.0,
        gt=0,
        description="An external agent's episode (env `external`) with no call for this long ends "
        "`failed` (timed out).",
    )
    service_url: str | None = Field(
        default=None,
        description="Where this service's episode endpoints are reached from its own env workers: "
        "agent-driven envs (verifiers') call the model at <SERVICE_URL>/v1/episodes/{id}. Unset, "
        "`serve` uses the address it listens on (127.0.0.1 for every IPv4 interface, [::1] for every "
        "IPv6 one).",
    )

    user_sim: UserSimConfig = Field(
        default_factory=UserSimSettings,
        description="The user simulator of LLM-driven environments (tau-bench, tau2) and the LLM judge "
        "of rewards that need one: USER_SIM_BASE_URL, USER_SIM_MODEL, USER_SIM_API_KEY, "
        "USER_SIM_TEMPERATURE, USER_SIM_SEED, JUDGE_BASE_URL, JUDGE_MODEL, JUDGE_API_KEY (UserSimConfig).",
    )

    tune_gc: bool = Field(
        default=True,
        description="After start-up, freeze what start-up built (gc.freeze) and collect less often: "
        "full collections over thousands of live episodes stall the event loop. Process-wide; off "
        "where several apps share a process (tests).",
    )

    tracemalloc_dir: Path | None = Field(
        default=None,
        description="For diagnosing memory growth: a service process sent SIGUSR2 starts tracing its "
        "Python allocations (tracemalloc, 10 frames; it slows every allocation), and each SIGUSR2 after "
        "that writes a snapshot to this directory, tracemalloc-<pid>-<n>.pickle. Unset (the default), "
        "SIGUSR2 keeps its default action: the process ends.",
    )

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Logging level."
    )

    @field_validator("api_projects")
    @classmethod
    def _valid_projects(cls, value: SecretStr, info: ValidationInfo) -> SecretStr:
        admin = info.data.get("api_keys")
        KeyTable.parse(_key_list(admin) if isinstance(admin, SecretStr) else [], value.get_secret_value())
        return value

    @cached_property
    def api_key_list(self) -> list[str]:
        return _key_list(self.api_keys)

    @cached_property
    def key_table(self) -> KeyTable:
        """Every API key and what it opens (API_KEYS: everything; API_PROJECTS: a project's batches)."""
        return KeyTable.parse(self.api_key_list, self.api_projects.get_secret_value())

    @cached_property
    def worker_url_list(self) -> list[str]:
        return [url.strip().rstrip("/") for url in self.sglang_worker_urls.split(",") if url.strip()]


def _key_list(keys: SecretStr) -> list[str]:
    return [key.strip() for key in keys.get_secret_value().split(",") if key.strip()]


def environment_names() -> set[str]:
    """Every environment variable the settings read (upper case), the nested model's included."""
    names: set[str] = set()
    for model in (Settings, UserSimSettings):
        for name, field in model.model_fields.items():
            if model is Settings and name == "user_sim":
                continue
            alias = field.validation_alias
            choices = alias.choices if isinstance(alias, AliasChoices) else [alias or name]
            names.update(str(choice).upper() for choice in choices)
    return names

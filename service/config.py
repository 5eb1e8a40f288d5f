"""Every setting of the service, read from the environment (or a `.env` file)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.engine.client import ABORT_QUIET_GROWTH, ABORT_QUIET_SECONDS
from service.envs.base import UserSimConfig
from service.envs.executors import THREADS_PER_WORKER, ExecutorKind
from service.envs.host import CALL_TIMEOUT_SECONDS
from service.loop.runner import DEFAULT_MAX_TURN_RESUMES
from service.storage.db import (
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


class UserSimSettings(BaseSettings, UserSimConfig):
    """UserSimConfig as the environment (or `.env`) sets it, by its fields' aliases: USER_SIM_*, JUDGE_*."""

    model_config = SettingsConfigDict(env_file=".env", extra="ignore", frozen=True, validate_by_name=True)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_file=".env", extra="ignore")

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
        "'Authorization: Bearer <key>'. Unset: no authentication (a warning is logged at start).",
    )

    serve_workers: int = Field(
        default=1,
        ge=1,
        description="Service processes `serve` runs on its one port and database (`--workers` overrides "
        "it), so that one machine's cores all work: each is the whole service (API, worker, env workers, "
        "engine client); a parent supervises them and serves nothing. MAX_RUNNING_EPISODES, "
        "MAX_INFLIGHT_GENERATES and ENV_WORKERS are then the command's totals, shared among them.",
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
        description="Remote environments (OpenEnv servers, MCP tool servers): a JSON list of "
        "{name, protocol, urls, splits, ...}, or the path of a JSON or YAML file holding one.",
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
    service_url: str = Field(
        default="http://127.0.0.1:8000",
        description="Where this service's episode endpoints are reached from its own env workers: "
        "agent-driven envs (verifiers') call the model at <SERVICE_URL>/v1/episodes/{id}.",
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

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Logging level."
    )

    @cached_property
    def api_key_list(self) -> list[str]:
        return [key.strip() for key in self.api_keys.get_secret_value().split(",") if key.strip()]

    @cached_property
    def worker_url_list(self) -> list[str]:
        return [url.strip().rstrip("/") for url in self.sglang_worker_urls.split(",") if url.strip()]


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

"""The resources an app's lifespan composes, each an async context manager that builds it and
releases it (whatever the release of another did): the database, the engine client, the group log,
the episode worker; and the tokenizers, loaded now where episodes run, else on first use."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import cast

from service.agents.errors import EpisodeClosed
from service.agents.service import AgentSessions
from service.config import Settings
from service.engine.client import AbortQuiet, SGLangClient, make_control_client
from service.engine.model_info import ModelInfoCache
from service.engine.placement import Placement
from service.engine.transport import SocketTransport
from service.engine.vllm import VLLMClient
from service.envs.base import EnvSpec
from service.envs.host import EnvHost
from service.envs.remote.config import RemoteEnvConfig
from service.envs.remote.opener import RemoteEnvs
from service.loop.driven import DrivingRunner
from service.loop.runner import EpisodeRunner
from service.loop.tokens import ChatTokenizer, HFTokenizer
from service.loop.toolcalls import AUTO, format_of_template, get_parser
from service.metrics import Metrics
from service.records import Ending
from service.shared import Lazy
from service.storage.db import Database
from service.worker.endings import Endings, ResultsSignal
from service.worker.group_log import GroupLog
from service.worker.worker import EpisodeWorker

logger = logging.getLogger(__name__)


def load_tokenizer(settings: Settings) -> HFTokenizer:
    # "PyTorch was not found" is advice for model users: the service only tokenizes.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer

    # transformers' signatures are wider than the HFTokenizer protocol states; the calls match.
    return cast(HFTokenizer, AutoTokenizer.from_pretrained(settings.tokenizer_path))


def load_chat_tokenizer(settings: Settings, tokenizer: HFTokenizer | None = None) -> ChatTokenizer:
    return ChatTokenizer(
        tokenizer or load_tokenizer(settings),
        tool_instruction=settings.tool_instruction,
        template_tool_instruction=settings.template_tool_instruction,
    )


def tool_call_format(settings: Settings, tokenizer: HFTokenizer | None) -> str:
    """TOOL_CALL_FORMAT, `auto` resolved from the tokenizer's chat template; raises ValueError (the
    service does not start) for a name no parser has, or a template that shows no known format."""
    if settings.tool_call_format != AUTO:
        get_parser(settings.tool_call_format)
        return settings.tool_call_format
    template = getattr(tokenizer or load_tokenizer(settings), "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates
        template = "\n".join(str(text) for text in template.values())
    return format_of_template(str(template))


@dataclass(frozen=True)
class Tokenizers:
    """The policy's tokenizer, its chat rendering and its tool-call format. Each is built once, on
    first use: at start where episodes run (`load(now=True)`), else by the viewer or an agent."""

    tokenizer: Lazy[HFTokenizer]
    chat: Lazy[ChatTokenizer]
    call_format: str  # TOOL_CALL_FORMAT, `auto` resolved

    @classmethod
    async def load(cls, settings: Settings, *, now: bool) -> Tokenizers:
        tokenizer = Lazy(lambda: asyncio.to_thread(load_tokenizer, settings))

        async def chat() -> ChatTokenizer:
            return await asyncio.to_thread(load_chat_tokenizer, settings, await tokenizer.get())

        loaded = await tokenizer.get() if now else None
        call_format = await asyncio.to_thread(tool_call_format, settings, loaded)
        logger.info("tool-call format: %s", call_format)
        tokenizers = cls(tokenizer, Lazy(chat), call_format)
        if now:
            await tokenizers.chat.get()
        return tokenizers


@asynccontextmanager
async def open_database(settings: Settings) -> AsyncIterator[Database]:
    database = Database.open(
        settings.database_url,
        pool_size=settings.database_pool_size,
        max_overflow=settings.database_max_overflow,
        pool_timeout=settings.database_pool_timeout_seconds,
        connect_timeout=settings.database_connect_timeout_seconds,
        transaction_pooler=settings.database_transaction_pooler,
    )
    try:
        if await database.check() != "ok":  # not fatal: the worker retries, /ready tells
            logger.warning("the database does not answer at start: %s", database.status.describe())
        yield database
    finally:
        await database.dispose()


@asynccontextmanager
async def engine_client(settings: Settings) -> AsyncIterator[SGLangClient]:
    # The transport's connections are bounded by the client's max_inflight.
    async with (
        make_control_client(settings.engine_timeout_seconds) as http,
        aclosing(SocketTransport()) as transport,
    ):
        client = VLLMClient if settings.engine == "vllm" else SGLangClient
        workers, mode = settings.worker_url_list, settings.engine_placement
        placement = Placement(workers, mode) if workers and mode != "router" else None
        model_info = ModelInfoCache(
            http, settings.sglang_url.rstrip("/"), settings.engine, settings.engine_logprobs_mode
        )
        model_info.warm_up()
        try:
            yield client(
                http,
                settings.sglang_url,
                max_inflight=settings.max_inflight_generates,
                retries=settings.engine_retries,
                backoff_seconds=settings.engine_backoff_seconds,
                timeout_seconds=settings.engine_timeout_seconds,
                worker_urls=settings.worker_url_list,
                transport=transport,
                abort_quiet=AbortQuiet(settings.engine_abort_quiet_seconds),
                model_info=model_info,
                placement=placement,
            )
        finally:
            await model_info.aclose()


@asynccontextmanager
async def group_log(database: Database, metrics: Metrics, results: ResultsSignal) -> AsyncIterator[GroupLog]:
    # Long-polls of /groups wake when this process logs groups (other processes' are polled).
    log = GroupLog(database, metrics, on_logged=lambda completed: results.notify())
    log.start()
    try:
        yield log
    finally:
        await log.stop()


async def finish_driven(
    agents: AgentSessions,
    endings: Endings,
    episode_id: str,
    ending: Ending,
    token: str,
) -> None:
    """An agent-driven env's episode ended by its driver (given `token`), as its endpoint's
    `/finish` ends one."""
    try:
        group, ended = await agents.finish(episode_id, ending, token)
    except EpisodeClosed:
        return  # cancelled meanwhile, or re-queued (this process lost its lease): another attempt's
    endings.agent_finished(group, ended)


@asynccontextmanager
async def episode_worker(
    settings: Settings,
    database: Database,
    engine: SGLangClient,
    tokenizers: Tokenizers,
    endings: Endings,
    agents: AgentSessions,
    envs: dict[str, EnvSpec],
    remote: list[RemoteEnvConfig] | None = None,
    metrics: Metrics | None = None,
) -> AsyncIterator[EpisodeWorker]:
    """The worker, running until the exit, when it drains before its env workers close; its env
    workers run `envs` (plugins included), `remote` envs run on their servers."""
    env_host = EnvHost(
        settings.env_workers,
        settings.env_executor,
        settings.user_sim,
        threads_per_worker=settings.env_threads_per_worker,
        call_timeout_seconds=settings.env_call_timeout_seconds,
        envs=envs,
    )
    remote_envs = RemoteEnvs(remote or [], env_host, metrics.registry if metrics is not None else None)
    try:
        runner = EpisodeRunner(
            engine,
            remote_envs,
            await tokenizers.chat.get(),
            get_parser(tokenizers.call_format),
            max_turn_resumes=settings.max_turn_resumes,
        )
        driving = DrivingRunner(
            runner,
            env_host,
            database,
            service_url=lambda: settings.service_url,
            finish=functools.partial(finish_driven, agents, endings),
        )
        worker = EpisodeWorker(
            settings, database, driving, on_finished=endings.result_stored, engine_status=engine.status
        )
        driving.on_finishing = worker.finishing
        driving.on_handed_over = agents.handed_over
        worker.start()
        try:
            yield worker
        finally:
            await worker.stop()
    finally:
        await remote_envs.close()
        await env_host.close()

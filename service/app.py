"""The application: `create_app(settings)`, with a lifespan that owns every shared resource."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import cast

from fastapi import Depends, FastAPI

from service.agents.chat import AgentChat
from service.api import agents, batches, engine, envs, episodes, groups, health
from service.api.contract import install_contract
from service.api.deps import refuse_unknown_query_parameters
from service.api.errors import install_error_handlers
from service.api.middleware import install_middleware
from service.api.ui import install_pages
from service.app_state import EnginePause, Lazy, ResultsSignal, Services
from service.config import Settings
from service.engine.client import AbortQuiet, SGLangClient, make_control_client
from service.engine.transport import SocketTransport
from service.engine.vllm import VLLMClient
from service.envs.base import UserSimConfig
from service.envs.host import EnvHost
from service.envs.registry import available_envs
from service.loop.runner import EpisodeRunner
from service.loop.tokens import ChatTokenizer, HFTokenizer, TokenTexts
from service.loop.toolcalls import AUTO, format_of_template, get_parser
from service.metrics import Metrics
from service.records import EpisodeResult
from service.storage.db import Database
from service.storage.queue import ClaimedEpisode
from service.worker.group_log import GroupLog
from service.worker.worker import EpisodeWorker

logger = logging.getLogger(__name__)


def load_tokenizer(settings: Settings) -> HFTokenizer:
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


# Allocations between young collections (CPython's default: 700). An episode allocates a few
# hundred objects a turn; at thousands in flight the default collects hundreds of times a second.
GC_THRESHOLDS = (50_000, 20, 100)


def tune_garbage_collector() -> None:
    """What start-up built (modules, the tokenizer, templates) lives as long as the process: out of
    the collector's sight (gc.freeze, as CPython's docs advise for long-running servers)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def user_sim_config(settings: Settings) -> UserSimConfig:
    return UserSimConfig(
        base_url=settings.user_sim_base_url,
        model=settings.user_sim_model,
        api_key=settings.user_sim_api_key.get_secret_value(),
        temperature=settings.user_sim_temperature,
        seed=settings.user_sim_seed,
        judge_base_url=settings.judge_base_url,
        judge_model=settings.judge_model,
        judge_api_key=settings.judge_api_key.get_secret_value(),
    )


@asynccontextmanager
async def lifespan(
    settings: Settings, metrics: Metrics, shutting_down: asyncio.Event
) -> AsyncIterator[dict[str, Services]]:
    if not settings.api_key_list:
        logger.warning("API_KEYS is not set: the API accepts requests from anyone who can reach it")
    async with AsyncExitStack() as resources:  # each is released even if an earlier release fails
        database = Database.open(
            settings.database_url,
            pool_size=settings.database_pool_size,
            max_overflow=settings.database_max_overflow,
            pool_timeout=settings.database_pool_timeout_seconds,
        )
        resources.push_async_callback(database.dispose)
        if await database.check() != "ok":  # not fatal: the worker retries, /ready tells
            logger.warning("the database does not answer at start: %s", database.status.describe())
        http = make_control_client(settings.engine_timeout_seconds)
        resources.push_async_callback(http.aclose)
        transport = SocketTransport()  # its connections are bounded by the client's max_inflight
        resources.push_async_callback(transport.aclose)
        engine = (VLLMClient if settings.engine == "vllm" else SGLangClient)(
            http,
            settings.sglang_url,
            max_inflight=settings.max_inflight_generates,
            retries=settings.engine_retries,
            backoff_seconds=settings.engine_backoff_seconds,
            timeout_seconds=settings.engine_timeout_seconds,
            worker_urls=settings.worker_url_list,
            transport=transport,
            abort_quiet=AbortQuiet(
                settings.engine_abort_quiet_seconds, 16 * settings.engine_abort_quiet_seconds
            ),
        )
        results = ResultsSignal()
        # Long-polls of /groups wake when this process logs groups (other processes' are polled).
        group_log = GroupLog(database, metrics, on_logged=lambda completed: results.notify())
        group_log.start()
        resources.push_async_callback(group_log.stop)
        pause = EnginePause(settings.max_pause_seconds, engine.resume)
        resources.push_async_callback(pause.aclose)
        worker = None
        chat = None
        tokenizer = await asyncio.to_thread(load_tokenizer, settings) if settings.run_worker else None
        call_format = await asyncio.to_thread(tool_call_format, settings, tokenizer)
        logger.info("tool-call format: %s", call_format)
        if settings.run_worker:
            chat = await asyncio.to_thread(load_chat_tokenizer, settings, tokenizer)
            env_host = EnvHost(
                settings.env_workers,
                settings.env_executor,
                user_sim_config(settings),
                threads_per_worker=settings.env_threads_per_worker,
                call_timeout_seconds=settings.env_call_timeout_seconds,
            )
            resources.push_async_callback(env_host.close)
            runner = EpisodeRunner(
                engine,
                env_host,
                chat,
                get_parser(call_format),
                max_turn_resumes=settings.max_turn_resumes,
            )

            def episode_stored(claim: ClaimedEpisode, result: EpisodeResult) -> None:
                metrics.episode_finished(result)
                group_log.touch([(claim.batch_id, claim.group_index)])
                results.notify()

            worker = EpisodeWorker(settings, database, runner, on_finished=episode_stored)

        # An API-only process loads its tokenizer on first use (the viewer's or an agent's), once.
        async def load_once() -> HFTokenizer:
            if tokenizer is None:
                return await asyncio.to_thread(load_tokenizer, settings)
            return tokenizer

        shared_tokenizer = Lazy(load_once)

        async def agent_chat() -> AgentChat:
            agents_chat = chat
            if agents_chat is None:
                agents_chat = await asyncio.to_thread(
                    load_chat_tokenizer, settings, await shared_tokenizer.get()
                )
            return AgentChat(
                engine, agents_chat, get_parser(call_format), max_turn_resumes=settings.max_turn_resumes
            )

        services = Services(
            settings=settings,
            database=database,
            engine=engine,
            envs=available_envs(),
            metrics=metrics,
            results=results,
            shutting_down=shutting_down,
            pause=pause,
            worker=worker,
            group_log=group_log,
            tool_call_format=call_format,
            token_texts=TokenTexts(shared_tokenizer.get),
            agent_chat=Lazy(agent_chat),
        )
        if worker is not None:
            worker.start()
            resources.push_async_callback(worker.stop)  # first out: drains before the rest closes
        if settings.tune_gc:
            tune_garbage_collector()
        yield {"services": services}


def create_app(settings: Settings | None = None, shutting_down: asyncio.Event | None = None) -> FastAPI:
    """The app. `shutting_down`, set by the server on SIGTERM, ends long-polls so that the server
    can close its connections and run the lifespan's drain without waiting for them."""
    settings = settings or Settings()
    metrics = Metrics()
    shutting_down = shutting_down or asyncio.Event()
    app = FastAPI(
        title="Rollout service",
        version="0.1.0",
        summary="Durable multi-turn agent rollouts against SGLang, with exact token data for RL trainers.",
        lifespan=lambda app: lifespan(settings, metrics, shutting_down),
        dependencies=[Depends(refuse_unknown_query_parameters)],
        docs_url=None,  # served by install_pages, from the package rather than a CDN
        redoc_url=None,
    )
    install_error_handlers(app)
    install_middleware(app, settings)
    for module in (episodes, batches, groups, envs, engine, health, agents):
        app.include_router(module.router)
    install_pages(app)
    install_contract(app)
    return app

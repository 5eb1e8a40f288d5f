"""The application: `create_app(settings)`, with a lifespan that owns every shared resource."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, aclosing, asynccontextmanager

from fastapi import Depends, FastAPI

from service.agents import routes as agents
from service.agents.chat_completions import ChatCompletionsFastPath
from service.agents.service import AgentSessions
from service.agents.session import AgentTurns
from service.api import access, batches, engine, envs, episodes, groups, health
from service.api.contract import install_contract
from service.api.deps import refuse_unknown_query_parameters
from service.api.errors import install_error_handlers
from service.api.middleware import install_middleware
from service.api.ui import install_pages
from service.app_state import Services
from service.config import Settings
from service.engine.pause import EnginePause
from service.envs.registry import available_envs, with_loaders
from service.envs.remote.config import env_spec, parse_remote_envs
from service.loop.tokens import TokenTexts
from service.loop.toolcalls import get_parser
from service.metrics import Metrics
from service.resources import Tokenizers, engine_client, episode_worker, group_log, open_database
from service.shared import Lazy
from service.worker.endings import Endings, ResultsSignal

logger = logging.getLogger(__name__)

# Allocations between young collections (CPython's default: 700). An episode allocates a few
# hundred objects a turn; at thousands in flight the default collects hundreds of times a second.
GC_THRESHOLDS = (50_000, 20, 100)


def tune_garbage_collector() -> None:
    """What start-up built (modules, the tokenizer, templates) lives as long as the process: out of
    the collector's sight (gc.freeze, as CPython's docs advise for long-running servers)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


@asynccontextmanager
async def lifespan(
    settings: Settings, metrics: Metrics, shutting_down: asyncio.Event
) -> AsyncIterator[dict[str, Services]]:
    """Each resource in its own context manager, released in the reverse order: the worker drains
    first, the database closes last."""
    if settings.key_table.open:
        logger.warning("API_KEYS is not set: the API accepts requests from anyone who can reach it")
    async with AsyncExitStack() as resources:
        resources.callback(metrics.watch_collections())
        database = await resources.enter_async_context(open_database(settings))
        engine = await resources.enter_async_context(engine_client(settings))
        await engine.status.check()  # an engine that does not answer is logged as a warning now
        results = ResultsSignal()
        endings = Endings(
            metrics, await resources.enter_async_context(group_log(database, metrics, results)), results
        )
        pause = EnginePause(settings.max_pause_seconds, engine.pause, engine.resume, database)
        await resources.enter_async_context(aclosing(pause))
        tokenizers = await Tokenizers.load(settings, now=settings.run_worker)

        async def agent_turns() -> AgentTurns:
            chat = await tokenizers.chat.get()
            parser = get_parser(tokenizers.call_format)
            return AgentTurns(engine, chat, parser, max_turn_resumes=settings.max_turn_resumes)

        agents = AgentSessions(database, Lazy(agent_turns).get, idle_seconds=settings.external_idle_seconds)
        worker = None
        envs = with_loaders(available_envs(), settings.env_plugin_list)
        remote = parse_remote_envs(settings.remote_envs)
        envs |= {config.name: env_spec(config) for config in remote}
        if settings.run_worker:
            worker = await resources.enter_async_context(
                episode_worker(settings, database, engine, tokenizers, endings, agents, envs, remote, metrics)
            )

        services = Services(
            settings=settings,
            database=database,
            engine=engine,
            envs=envs,
            metrics=metrics,
            results=results,
            endings=endings,
            shutting_down=shutting_down,
            pause=pause,
            worker=worker,
            tool_call_format=tokenizers.call_format,
            token_texts=TokenTexts(tokenizers.tokenizer.get),
            agents=agents,
        )
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
    app.add_middleware(ChatCompletionsFastPath)  # inside install_middleware's guard
    install_middleware(app, settings)
    for module in (episodes, batches, groups, envs, engine, health, access, agents):
        app.include_router(module.router)
    install_pages(app)
    install_contract(app)
    return app

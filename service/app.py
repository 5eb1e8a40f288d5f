"""The application: `create_app(settings)`, with a lifespan that owns every shared resource."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import cast

import httpx
from fastapi import FastAPI

from service.api import batches, engine, envs, episodes, health
from service.api.errors import install_error_handlers
from service.api.middleware import install_middleware
from service.app_state import ResultsSignal, Services
from service.config import Settings
from service.engine.client import SGLangClient, make_generate_pools
from service.envs.base import UserSimConfig
from service.envs.host import EnvHost
from service.envs.registry import available_envs
from service.loop.records import EpisodeResult
from service.loop.runner import EpisodeRunner
from service.loop.tokens import ChatTokenizer, HFTokenizer
from service.loop.toolcalls import get_parser
from service.metrics import Metrics
from service.storage.db import Database
from service.storage.queue import ClaimedEpisode
from service.worker.worker import EpisodeWorker

logger = logging.getLogger(__name__)


def load_chat_tokenizer(settings: Settings) -> ChatTokenizer:
    from transformers import AutoTokenizer

    # transformers' signatures are wider than the HFTokenizer protocol states; the calls match.
    tokenizer = cast(HFTokenizer, AutoTokenizer.from_pretrained(settings.tokenizer_path))
    return ChatTokenizer(
        tokenizer,
        tool_instruction=settings.tool_instruction,
        template_tool_instruction=settings.template_tool_instruction,
    )


def user_sim_config(settings: Settings) -> UserSimConfig:
    return UserSimConfig(
        base_url=settings.user_sim_base_url,
        model=settings.user_sim_model,
        api_key=settings.user_sim_api_key.get_secret_value(),
        temperature=settings.user_sim_temperature,
        seed=settings.user_sim_seed,
    )


@asynccontextmanager
async def lifespan(
    settings: Settings, metrics: Metrics, shutting_down: asyncio.Event
) -> AsyncIterator[dict[str, Services]]:
    if not settings.api_key_list:
        logger.warning("API_KEYS is not set: the API accepts requests from anyone who can reach it")
    async with AsyncExitStack() as resources:  # each is released even if an earlier release fails
        database = Database.open(settings.database_url)
        resources.push_async_callback(database.dispose)
        http = httpx.AsyncClient(timeout=httpx.Timeout(settings.engine_timeout_seconds, connect=10.0))
        resources.push_async_callback(http.aclose)
        generate_pools = make_generate_pools(settings.max_inflight_generates, settings.engine_timeout_seconds)
        for pool in generate_pools:
            resources.push_async_callback(pool.aclose)
        engine = SGLangClient(
            http,
            settings.sglang_url,
            max_inflight=settings.max_inflight_generates,
            retries=settings.engine_retries,
            backoff_seconds=settings.engine_backoff_seconds,
            timeout_seconds=settings.engine_timeout_seconds,
            worker_urls=settings.worker_url_list,
            generate_pools=generate_pools,
        )
        services = Services(
            settings=settings,
            database=database,
            http=http,
            engine=engine,
            envs=available_envs(),
            metrics=metrics,
            results=ResultsSignal(),
            shutting_down=shutting_down,
        )
        if settings.run_worker:
            chat = await asyncio.to_thread(load_chat_tokenizer, settings)
            services.env_host = EnvHost(
                settings.env_workers,
                settings.env_executor,
                user_sim_config(settings),
                threads_per_worker=settings.env_threads_per_worker,
                call_timeout_seconds=settings.env_call_timeout_seconds,
            )
            resources.push_async_callback(services.env_host.close)
            runner = EpisodeRunner(engine, services.env_host, chat, get_parser(settings.tool_call_format))

            def episode_stored(claim: ClaimedEpisode, result: EpisodeResult) -> None:
                services.metrics.episode_finished(result)
                services.results.notify()

            services.worker = EpisodeWorker(
                settings, database.sessionmaker, runner, on_finished=episode_stored
            )
            services.worker.start()
            resources.push_async_callback(services.worker.stop)  # first out: drains before the rest closes
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
    )
    install_error_handlers(app)
    install_middleware(app, settings)
    for module in (episodes, batches, envs, engine, health):
        app.include_router(module.router)
    return app

"""What one app's lifespan builds, whole, and hands to the routes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from service.agents.service import AgentSessions
from service.config import Settings
from service.engine.client import SGLangClient
from service.engine.pause import EnginePause
from service.envs.base import EnvSpec
from service.loop.tokens import TokenTexts
from service.metrics import Metrics
from service.shared import GroupSummaries, SharedReads
from service.storage.db import Database
from service.worker.endings import Endings, ResultsSignal
from service.worker.worker import EpisodeWorker


@dataclass(frozen=True)
class Services:
    """What the lifespan builds, whole, and the routes use; one per app."""

    settings: Settings
    database: Database
    engine: SGLangClient
    envs: dict[str, EnvSpec]
    metrics: Metrics
    results: ResultsSignal  # fires whenever this process stores a result
    endings: Endings  # what follows episodes' end: metrics, the group log, `results`
    shutting_down: asyncio.Event  # set when the server was told to stop: long-polls return at once
    pause: EnginePause  # whether a trainer paused generation, and since when
    worker: EpisodeWorker | None  # None when this process only serves the API (RUN_WORKER=false)
    tool_call_format: str  # TOOL_CALL_FORMAT, `auto` resolved
    token_texts: TokenTexts  # token ids as text, for people (the viewer)
    agents: AgentSessions  # external agents' episodes; their tokenizer is loaded on first call
    summaries: GroupSummaries = field(default_factory=GroupSummaries)
    summary_reads: SharedReads[str, bytes | None] = field(default_factory=SharedReads)

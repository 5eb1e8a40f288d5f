"""Command line: `python -m service migrate | serve | demo | sim-worker | openapi`."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

SIM_CLI_REQUEST_LOG = 1000  # generate requests `sim-worker` remembers (at 10,000 episodes: 1.3 GB)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    migrate_command = commands.add_parser(
        "migrate", help="Upgrade the database of DATABASE_URL to the newest schema."
    )
    migrate_command.add_argument(
        "--check",
        action="store_true",
        help="Change nothing: exit 0 if the schema is the newest, else 2 (a pod's init container waits "
        "on it for the migration Job).",
    )
    migrate_command.add_argument(
        "--wait", type=float, default=0.0, metavar="SECONDS", help="With --check: ask again until then."
    )
    serve = commands.add_parser("serve", help="Serve the API and run episodes (RUN_WORKER=false: API only).")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--migrate", action="store_true", help="Migrate the database first (always done for SQLite)."
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=None,
        help="Service processes on this port, each the whole service (default: SERVE_WORKERS, 1).",
    )
    serve.add_argument(
        "--api-processes",
        type=int,
        default=None,
        help="Processes that serve the API alone in front of the --workers, which then run episodes "
        "off the port (default: SERVE_API_PROCESSES, 0).",
    )
    demo = commands.add_parser("demo", help="One batch end to end on SQLite with a simulated SGLang worker.")
    demo.add_argument("--tasks", type=int, default=16, help="Tasks of builtin/shop's test split.")
    demo.add_argument("--samples", type=int, default=4, help="Samples per task (a GRPO group).")
    demo.add_argument("--database", default="sqlite+aiosqlite:///./demo.db")
    demo.add_argument(
        "--engine-url", default=None, help="A running engine instead of the simulated worker (with --engine)."
    )
    demo.add_argument("--engine", choices=["sglang", "vllm"], default="sglang", help="The engine's protocol.")
    sim = commands.add_parser(
        "sim-worker", help="Serve a simulated SGLang worker (tests, demos, benchmarks)."
    )
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=30000)
    sim.add_argument("--latency", type=float, default=0.02, help="Seconds per request.")
    sim.add_argument("--tokenizer", default=None, help="Tokenizer directory (default: the test tokenizer).")
    sim.add_argument("--per-token-latency", type=float, default=0.0, help="Seconds per sampled token.")
    sim.add_argument(
        "--stream-interval", type=int, default=8, help="Tokens per streamed frame (after the first)."
    )
    sim.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=None,
        help="Tokens its prefix cache holds (default 1,000,000); 0: no prefix cache, and none of its CPU "
        "(a bench whose measure is the service, on cores it shares with the worker).",
    )
    sim.add_argument(
        "--policy",
        default=None,
        metavar="MODULE:FUNCTION",
        help="The policy, a function (prompt text, episode key) -> the assistant's next text (default: "
        "builtin/shop's oracle, and for any other env each tool called once with valid arguments, "
        "then an answer).",
    )
    commands.add_parser(
        "tool-call-format",
        help="Print the tool-call format of the policy (TOOL_CALL_FORMAT, `auto` resolved from "
        "TOKENIZER_PATH's chat template), by SGLang's --tool-call-parser names.",
    )
    openapi = commands.add_parser("openapi", help="Write the API's OpenAPI document as YAML.")
    openapi.add_argument("--output", type=Path, default=None, help="File to write (default: stdout).")
    args = parser.parse_args(argv)
    if args.command == "serve" and args.workers is not None and args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.command == "serve" and args.api_processes is not None and args.api_processes < 0:
        parser.error("--api-processes must be at least 0")

    from pydantic import ValidationError

    from service.config import Settings
    from service.logs import configure_logging

    quiet_transformers()
    try:
        settings = Settings()
    except ValidationError as error:
        for item in error.errors():
            name = str(item["loc"][0]).upper() if item["loc"] else "a setting"
            print(f"error: {name}: {item['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    if args.command == "migrate" and args.check:
        from service.storage.db import wait_for_schema

        return wait_for_schema(settings.database_url, args.wait)
    if args.command in ("migrate", "serve"):
        from sqlalchemy.engine import make_url

        from service.storage.errors import sqlite_problem

        url = make_url(settings.database_url)
        if url.get_backend_name() == "sqlite" and (problem := sqlite_problem(url.database)) is not None:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    if args.command == "migrate":
        return migrate(settings.database_url)
    elif args.command == "serve":
        from service.storage.db import SchemaOutOfDate, check_schema, is_sqlite

        if args.migrate or is_sqlite(settings.database_url):  # an embedded database: nobody else migrates it
            if (code := migrate(settings.database_url, quiet=True)) != 0:
                return code
        try:
            check_schema(settings.database_url)
        except SchemaOutOfDate as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        except Exception as error:
            return startup_failed(settings.database_url, error)
        if (problem := tokenizer_problem(settings.tokenizer_path)) is not None:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        workers = settings.serve_workers if args.workers is None else args.workers
        api_processes = settings.serve_api_processes if args.api_processes is None else args.api_processes
        from service.sockets import listen, own_url
        from service.supervisor import Supervisor

        try:
            sock = listen(args.host, args.port)
        except OSError as error:
            print(
                f"error: cannot listen on {args.host}:{args.port}: {error} (another service there? "
                "choose one with --port)",
                file=sys.stderr,
            )
            return 2
        if settings.service_url is None:  # agent-driven envs call this very port
            settings = settings.model_copy(update={"service_url": own_url(sock)})
        with sock:
            if workers == 1 and api_processes == 0:
                from service.serving import run_service

                run_service(settings, sockets=[sock])
                return 0
            return Supervisor(settings, workers, sock, api_processes=api_processes).run()
    elif args.command == "demo":
        from service.demo import run_demo

        return run_demo(
            database_url=args.database,
            tasks=args.tasks,
            samples=args.samples,
            engine=args.engine,
            engine_url=args.engine_url,
        )
    elif args.command == "sim-worker":
        from service.sim.worker import SimConfig
        from service.sim.worker import main as sim_main

        # Its request log is for tests that hold the worker in-process; a served one keeps a little.
        sim_config = SimConfig(
            latency_seconds=args.latency,
            request_log_limit=SIM_CLI_REQUEST_LOG,
            per_token_latency_seconds=args.per_token_latency,
            stream_interval=args.stream_interval,
        )
        if args.tokenizer:
            sim_config = replace(sim_config, tokenizer_path=args.tokenizer)
        if args.prefix_cache_tokens is not None:
            if args.prefix_cache_tokens < 0:
                parser.error("--prefix-cache-tokens must be at least 0")
            sim_config = replace(sim_config, prefix_cache_tokens=args.prefix_cache_tokens)
        if args.policy:
            from service.envs.plugins import load_function

            sim_config = replace(sim_config, policy=load_function(args.policy))
        sim_main(args.host, args.port, sim_config)
    elif args.command == "tool-call-format":
        from service.resources import tool_call_format

        try:
            print(tool_call_format(settings, None))
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    elif args.command == "openapi":
        from service.openapi import openapi_yaml

        text = openapi_yaml()
        if args.output is None:
            sys.stdout.write(text)
        else:
            args.output.write_text(text)
    return 0


def quiet_transformers() -> None:
    """transformers advises at import that PyTorch is missing; the service (and the simulated
    worker) only tokenize, never import torch, so the advice is noise. Its real warnings stay."""
    import os

    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def migrate(url: str, *, quiet: bool = False) -> int:
    """`migrate`: upgrades the database and says what it did; a failure is one line, exit 2."""
    from service.storage.db import current_revision, head_revision, run_migrations

    try:
        before = current_revision(url)
        run_migrations(url)
    except Exception as error:
        return startup_failed(url, error)
    if not quiet:
        from sqlalchemy.engine import make_url

        where = make_url(url).render_as_string(hide_password=True)
        head = head_revision(url)
        if before == head:
            print(f"{where}: already at migration {head}, nothing to do")
        else:
            print(f"{where}: migrated from {before or 'an empty database'} to {head}")
    return 0


def startup_failed(url: str, error: BaseException) -> int:
    from service.storage.errors import startup_problem

    print(f"error: {startup_problem(url, error)}", file=sys.stderr)
    return 2


def tokenizer_problem(path: str) -> str | None:
    """None if TOKENIZER_PATH names a directory with a tokenizer, or could be a hub id."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not any((local / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
            return f"TOKENIZER_PATH {path} holds no tokenizer.json nor tokenizer_config.json"
        return None
    if path.startswith(("/", ".", "~")) or path.count("/") > 1:
        return f"TOKENIZER_PATH {path} does not exist: name the served model's tokenizer directory or hub id"
    return None


if __name__ == "__main__":
    sys.exit(main())

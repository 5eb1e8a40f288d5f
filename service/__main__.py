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
    commands.add_parser("migrate", help="Upgrade the database of DATABASE_URL to the newest schema.")
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
        "--policy",
        default=None,
        metavar="MODULE:FUNCTION",
        help="The policy, a function (prompt text, episode key) -> the assistant's next text (default: "
        "builtin/shop's oracle, and for any other env each tool called once with valid arguments, "
        "then an answer).",
    )
    openapi = commands.add_parser("openapi", help="Write the API's OpenAPI document as YAML.")
    openapi.add_argument("--output", type=Path, default=None, help="File to write (default: stdout).")
    args = parser.parse_args(argv)
    if args.command == "serve" and args.workers is not None and args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.command == "serve" and args.api_processes is not None and args.api_processes < 0:
        parser.error("--api-processes must be at least 0")

    from service.config import Settings
    from service.logs import configure_logging

    settings = Settings()
    configure_logging(settings.log_level)
    if args.command == "migrate":
        from service.storage.db import run_migrations

        run_migrations(settings.database_url)
    elif args.command == "serve":
        from service.storage.db import SchemaOutOfDate, check_schema, is_sqlite, run_migrations

        if args.migrate or is_sqlite(settings.database_url):  # an embedded database: nobody else migrates it
            run_migrations(settings.database_url)
        try:
            check_schema(settings.database_url)
        except SchemaOutOfDate as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        workers = settings.serve_workers if args.workers is None else args.workers
        api_processes = settings.serve_api_processes if args.api_processes is None else args.api_processes
        if workers == 1 and api_processes == 0:
            from service.serving import run_service

            run_service(settings, args.host, args.port)
            return 0
        from service.sockets import listen
        from service.supervisor import Supervisor

        try:
            sock = listen(args.host, args.port)
        except OSError as error:
            print(f"error: cannot listen on {args.host}:{args.port}: {error}", file=sys.stderr)
            return 1
        with sock:
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
        if args.policy:
            from service.envs.plugins import load_function

            sim_config = replace(sim_config, policy=load_function(args.policy))
        sim_main(args.host, args.port, sim_config)
    elif args.command == "openapi":
        from service.openapi import openapi_yaml

        text = openapi_yaml()
        if args.output is None:
            sys.stdout.write(text)
        else:
            args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

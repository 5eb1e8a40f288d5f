"""A GRPO rollout loop on rollout_client: submit a step's groups, wait, pull the exact token arrays,
compute group-relative advantages with numpy, print each step's statistics.

    .venv/bin/python examples/grpo_loop.py                  # starts a local service + simulated SGLang
    .venv/bin/python examples/grpo_loop.py --url http://127.0.0.1:8000 --env tau-bench/retail

Without --url it runs `python -m service sim-worker` and `python -m service serve` (SQLite in a
temporary directory) for the length of the loop. A trainer would take `advantages`, the token
arrays and the loss masks from here into its policy-gradient step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
from rollout_client import Batch, RolloutClient

STARTUP_SECONDS = 60.0


def group_advantages(batch: Batch) -> dict[str, float]:
    """GRPO: each episode's reward against its group's, (r - mean) / (std + eps); null rewards
    (failed episodes) count 0 and are not trained on (their loss mask is dropped by the trainer)."""
    advantages = {}
    for episodes in batch.groups().values():
        rewards = np.array([episode.reward or 0.0 for episode in episodes])
        normalized = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        advantages.update(zip((episode.episode_id for episode in episodes), normalized.tolist(), strict=True))
    return advantages


def step_line(step: int, batch: Batch, advantages: dict[str, float], seconds: float) -> str:
    statuses = Counter(batch.status)
    rewards = np.nan_to_num(batch.reward, nan=0.0)
    group_std = [np.std([e.reward or 0.0 for e in group]) for group in batch.groups().values()]
    response_tokens = sum(len(episode.response_ids) for episode in batch)
    trained_tokens = sum(int(episode.loss_mask.sum()) for episode in batch)
    spread = sum(1 for std in group_std if std > 0)
    return (
        f"step {step}: {len(batch)} episodes in {len(group_std)} groups ({spread} with a reward spread), "
        f"reward mean {rewards.mean():.3f} std {rewards.std():.3f}, "
        f"|advantage| mean {np.mean(np.abs(list(advantages.values()))):.3f}, "
        f"tokens {response_tokens} ({trained_tokens} trained), "
        f"{dict(sorted(statuses.items()))}, {seconds:.1f} s"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def local_service() -> Iterator[str]:
    """A simulated SGLang worker and the service on SQLite, as subprocesses; the service's URL."""
    with tempfile.TemporaryDirectory() as directory:
        sim_port, port = free_port(), free_port()
        environment = {
            **os.environ,
            "DATABASE_URL": f"sqlite+aiosqlite:///{directory}/rollouts.db",
            "SGLANG_URL": f"http://127.0.0.1:{sim_port}",
            "LOG_LEVEL": "WARNING",
        }
        command = [sys.executable, "-m", "service"]
        processes = [
            subprocess.Popen([*command, "sim-worker", "--port", str(sim_port)], env=environment),
            subprocess.Popen([*command, "serve", "--port", str(port)], env=environment),
        ]
        try:
            url = f"http://127.0.0.1:{port}"
            with RolloutClient(url, retries=0) as probe:
                deadline = time.monotonic() + STARTUP_SECONDS
                while True:
                    try:
                        probe.envs()
                        break
                    except Exception:
                        if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                            raise
                        time.sleep(0.2)
            yield url
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(30)


def run(args: argparse.Namespace, url: str) -> None:
    with RolloutClient(url, args.api_key) as client:
        split_sizes = {env["name"]: env["splits"] for env in client.envs()}[args.env]
        num_tasks = split_sizes[args.split]
        for step in range(args.steps):
            started = time.monotonic()
            # Tasks of this step; the batch id names the run and the step: rerunning a step resumes it.
            tasks = [(step * args.tasks + offset) % num_tasks for offset in range(args.tasks)]
            submitted = client.submit(
                args.env,
                tasks,
                samples_per_task=args.samples,
                task_split=args.split,
                sampling_params={"temperature": 1.0, "max_new_tokens": 512},
                batch_id=f"{args.run}-step-{step}",
            )
            client.wait(submitted.batch_id)
            batch = client.batch(submitted.batch_id)
            advantages = group_advantages(batch)
            print(step_line(step, batch, advantages, time.monotonic() - started), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="A running service (default: start one locally)")
    parser.add_argument("--api-key")
    parser.add_argument("--env", default="builtin/shop")
    parser.add_argument("--split", default="train")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=8, help="Groups per step")
    parser.add_argument("--samples", type=int, default=8, help="Samples per group")
    parser.add_argument("--run", default=f"grpo-{int(time.time())}", help="Names the run's batches")
    args = parser.parse_args()
    if args.url:
        run(args, args.url)
    else:
        with local_service() as url:
            run(args, url)


if __name__ == "__main__":
    main()

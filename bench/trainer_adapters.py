"""The trainer adapters' overhead (rollout_client.verl, .trl, .skyrl, .areal, .openrlhf, and slime's
generate_rollout) against pulling the same groups with the bare client, for a step of `--groups` x
`--samples`.

`python -m service serve` runs in its own process on `--database`, against the simulated SGLang
worker in another (builtin/shop's oracle without its rambling turns): this process holds the
trainer side alone, so an adapter's CPU competes with no service thread for the GIL. The trainers
are the stand-ins under tests/ (verl's DataProto, TRL's trainer fields, SkyRL's
prepare_generator_input, slime's data source, AReaL's GroupedRolloutWorkflow, OpenRLHF's
generate_responses). Each way runs the same step shape, in turn:

- `bare_client` (the baseline): RolloutClient.submit, then GET /groups until every group came,
  the episodes decoded (EpisodeArrays) and nothing more;
- `slime`, `verl`, `trl`, `skyrl`, `areal`, `openrlhf`: the adapter's step, returning the trainer's
  own types (AReaL and OpenRLHF ask one sample per call: the step's calls, arriving within
  ROLLOUT_COALESCE_SECONDS of each other, are one service batch).

Per way: `cold`, a fresh step (its episodes run in the service), seconds, median over `--steps`;
`warm`, the same step asked again (its batch id is the step's, so the complete batch is pulled
again and converted), seconds, median over `--repeats`, with this process's CPU seconds
(`warm_cpu`) and the service's (`warm_service_cpu`). `overhead_of_step` = (warm - bare warm) /
bare cold step: what the adapter adds to a step's wall time (the goal: <= 0.05);
`cpu_overhead_of_step` the same with this process's CPU. `verl_vs_slime_cold`, `_warm` and
`_warm_cpu` compare verl's step with slime's generate_rollout on the same shape (the goal: <= 1).
The load average before and after is in the JSON.

Run from the repo root:
    .venv/bin/python bench/trainer_adapters.py [--groups 64] [--samples 8] [--steps 3] [--database sqlite]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
for standin in (
    "slime_standin",
    "verl_standin",
    "trl_standin",
    "skyrl_standin",
    "areal_standin",
    "openrlhf_standin",
):
    sys.path.insert(0, str(REPO / "tests" / standin))

import numpy as np  # noqa: E402
from areal.api.cli_args import GenerationHyperparameters  # noqa: E402
from areal.infra.remote_inf_engine import RemoteInfEngine  # noqa: E402
from openrlhf.trainer.ppo_utils.samples_generator import SamplingParams  # noqa: E402
from rollout_client import AsyncRolloutClient, RolloutClient  # noqa: E402
from rollout_client import areal as areal_adapter  # noqa: E402
from rollout_client import openrlhf as openrlhf_adapter  # noqa: E402
from rollout_client import skyrl as skyrl_adapter  # noqa: E402
from rollout_client import slime as slime_hooks  # noqa: E402
from rollout_client import trl as trl_adapter  # noqa: E402
from rollout_client import verl as verl_adapter  # noqa: E402
from rollout_client.steps import GROUPS_PER_PAGE, GROUPS_WAIT_SECONDS  # noqa: E402
from skyrl.train.generators.utils import prepare_generator_input  # noqa: E402
from slime.rollout.data_source import RolloutDataSource  # noqa: E402
from slime.utils.types import Sample  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from verl.protocol import DataProto  # noqa: E402

from bench.common import fresh_database, serve_process, sim_worker  # noqa: E402
from bench.workers import process_tree_cpu_seconds  # noqa: E402
from service.config import TEST_TOKENIZER_DIR  # noqa: E402

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8192}
OVERHEAD_GOAL = 0.05
GOAL = (
    "an adapter adds <= 5% to a step's wall time over pulling the same groups with the bare client; "
    "verl's step is no slower than slime's generate_rollout on the same batch"
)
MAX_TURNS = 30
# No rambling turns: every way has the same caps, and none cuts a response.
NO_RAMBLES = ("--policy", "bench.common:shop_oracle_without_rambles")
ADAPTERS = ("slime", "verl", "trl", "skyrl", "areal", "openrlhf")
PROMPT_LENGTH = 4096  # verl's prompt_length; TRL's and SkyRL's caps are set as high: no cut here
RESPONSE_LENGTH = 8192


class Attr(dict[str, Any]):
    """OmegaConf's DictConfig as verl reads it: attribute access and .get."""

    def __getattr__(self, name: str) -> Any:
        return self[name]


def verl_config(samples: int) -> Attr:
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
    return Attr(
        trainer=Attr(project_name="bench", experiment_name="verl"),
        actor_rollout_ref=Attr(
            model=Attr(path=str(TEST_TOKENIZER_DIR)),
            rollout=Attr(
                n=samples, prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH, **sampling,
                val_kwargs=Attr(sampling), agent=Attr(agent_loop_manager_class="bench"),
            ),
        ),
    )  # fmt: skip


class NumpyManager(verl_adapter.RolloutServiceAgentLoopManager):
    tensor = staticmethod(np.asarray)  # the stand-in's DataProto holds numpy for torch


class NumpyWorkflow(areal_adapter.RolloutServiceWorkflow):  # type: ignore[misc,name-defined]
    tensor = staticmethod(np.asarray)  # the stand-in's trajectories hold numpy for torch


def step_tasks(step: int, groups: int) -> list[int]:
    return [(step * groups + group) % 200 for group in range(groups)]  # builtin/shop's train split


def bare_client(url: str, step: int, groups: int, samples: int) -> int:
    with RolloutClient(url) as client:
        batch_id = f"bench-bare-{step}"
        client.submit(
            "builtin/shop", step_tasks(step, groups), samples_per_task=samples, task_split="train",
            sampling_params=SAMPLING, max_turns=MAX_TURNS, batch_id=batch_id,
        )  # fmt: skip
        taken: dict[int, list[Any]] = {}
        cursor = 0
        while len(taken) < groups:
            page = client.groups(cursor, GROUPS_PER_PAGE, GROUPS_WAIT_SECONDS, batch_id=batch_id)
            for (_, group), episodes in page.groups().items():
                taken[group] = episodes
            cursor = page.next
    return sum(len(episodes) for episodes in taken.values())


def slime_step(step: int, groups: int, samples: int) -> int:
    args = SimpleNamespace(
        rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1,
        rollout_max_response_len=RESPONSE_LENGTH, rollout_stop=None, rollout_stop_token_ids=None,
        rollout_skip_special_tokens=False,
        rollout_batch_size=groups, n_samples_per_prompt=samples, over_sampling_batch_size=groups,
        dynamic_sampling_filter_path=None, reward_key=None, hf_checkpoint=None, save="/bench", rollout_seed=1,
    )  # fmt: skip
    source = RolloutDataSource(args, [Sample(prompt=str(task)) for task in step_tasks(step, groups)])
    output = slime_hooks.generate_rollout(args, step, source)
    return sum(len(group) for group in output.samples)


def verl_step(manager: NumpyManager, step: int, groups: int, samples: int) -> int:
    tasks = step_tasks(step, groups)
    extra = np.empty(groups * samples, dtype=object)
    extra[:] = [{"index": task} for task in tasks for _ in range(samples)]
    uid = np.array([f"u{step}-{group}" for group in range(groups) for _ in range(samples)], dtype=object)
    prompts = DataProto.from_single_dict({"extra_info": extra, "uid": uid}, meta_info={"global_steps": step})
    return len(manager.generate_sequences(prompts))


def trl_step(
    rollout: trl_adapter.ServiceRollout, tokenizer: Any, step: int, groups: int, samples: int
) -> int:
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), num_generations=samples, num_generations_eval=samples,
        state=SimpleNamespace(global_step=step), accelerator=SimpleNamespace(process_index=0),
        args=SimpleNamespace(output_dir="/bench"), max_completion_length=RESPONSE_LENGTH,
        temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, processing_class=tokenizer,
    )  # fmt: skip
    prompts = [str(task) for task in step_tasks(step, groups) for _ in range(samples)]
    rollout._calls.clear()  # a restarted trainer: its first call of the step again
    return len(rollout(prompts, trainer)["completion_ids"])


def skyrl_step(generator: skyrl_adapter.RolloutServiceGenerator, step: int, groups: int, samples: int) -> int:
    rows = [
        {"prompt": [{"role": "user", "content": str(task)}], "env_class": None,
         "env_extras": {"task_index": task}, "uid": f"u{step}-{group}"}
        for group, task in enumerate(step_tasks(step, groups))
    ]  # fmt: skip
    sampling = {"max_tokens": RESPONSE_LENGTH, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    generator_input, _ = prepare_generator_input(rows, samples, sampling, "shop", "train", step)
    generator._calls.clear()  # a restarted trainer: its first call of the step again
    return len(asyncio.run(generator.generate(generator_input))["response_ids"])


def areal_step(service: Any, step: int, groups: int, samples: int) -> int:
    """AReaL's rollout of a step's prompts; the workflow is new (a restarted trainer), the engine's
    version the step, so the same step asks for the same batches."""
    workflow = NumpyWorkflow(
        GenerationHyperparameters(n_samples=samples, max_new_tokens=8192), service=service
    )
    engine = RemoteInfEngine()
    engine.set_version(step)
    data = [{"task_index": task} for task in step_tasks(step, groups)]
    engine.rollout_batch(data, workflow, None, group_size=samples)
    return sum(workflow.counts.statuses.values())  # AReaL takes the trained rows only


def openrlhf_step(service: Any, tokenizer: Any, step: int, groups: int, samples: int) -> int:
    """OpenRLHF's rollout actor on a step's prompts (generate_responses: `samples` execute calls
    each); a new executor, its run id the step's (OpenRLHF tells an executor no step)."""
    executor = openrlhf_adapter.AgentExecutor(service=replace(service, run_id=f"bench-openrlhf-{step}"))

    async def prompt(task: int) -> list[dict[str, Any]]:
        params = SamplingParams(max_tokens=8192, logprobs=1)
        calls = [
            executor.execute(str(task), str(task), params, PROMPT_LENGTH + RESPONSE_LENGTH, tokenizer, None)
            for _ in range(samples)
        ]
        return list(await asyncio.gather(*calls))

    async def rollout() -> list[list[dict[str, Any]]]:
        return list(await asyncio.gather(*[prompt(task) for task in step_tasks(step, groups)]))

    return sum(len(responses) for responses in asyncio.run(rollout()))


LAST_PAGE = [0.0]  # when a GET /groups last answered (time.monotonic)


def record_pages() -> None:
    """Every client's GET /groups notes when it answered, so that a step's tail (from its last page of
    groups to the trainer's types returned) is what the adapter adds once the groups are in. Only a
    timestamp: the clients' behaviour is untouched."""
    sync_groups, async_groups = RolloutClient.groups, AsyncRolloutClient.groups

    @functools.wraps(sync_groups)
    def groups(*args: Any, **kwargs: Any) -> Any:
        page = sync_groups(*args, **kwargs)
        LAST_PAGE[0] = time.monotonic()
        return page

    @functools.wraps(async_groups)
    async def groups_async(*args: Any, **kwargs: Any) -> Any:
        page = await async_groups(*args, **kwargs)
        LAST_PAGE[0] = time.monotonic()
        return page

    RolloutClient.groups = groups  # type: ignore[method-assign]
    AsyncRolloutClient.groups = groups_async  # type: ignore[method-assign]


def timed(way: Callable[[int], int], step: int) -> tuple[int, float, float, float]:
    """The rows a way's step returned, its wall seconds, this process's CPU seconds (all its
    threads: the adapter's and the client's own, none of the service's), and its tail: the seconds
    from its last page of groups to its end."""
    started, cpu = time.monotonic(), time.process_time()
    rows = way(step)
    ended = time.monotonic()
    return rows, ended - started, time.process_time() - cpu, ended - max(LAST_PAGE[0], started)


def run(url: str, service_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    record_pages()
    tokenizer = AutoTokenizer.from_pretrained(str(TEST_TOKENIZER_DIR))
    os.environ.update(
        ROLLOUT_SERVICE_URL=url, ROLLOUT_ENV="builtin/shop", ROLLOUT_TASK_SPLIT="train",
        ROLLOUT_MAX_TURNS=str(MAX_TURNS), ROLLOUT_RUN_ID="bench",
    )  # fmt: skip
    service = verl_adapter.ServiceConfig.from_env(adapter="bench")
    manager = NumpyManager(verl_config(args.samples), service=service)
    rollout = trl_adapter.ServiceRollout(service)
    skyrl_cfg = SimpleNamespace(generator=SimpleNamespace(max_input_length=PROMPT_LENGTH + RESPONSE_LENGTH))
    generator = skyrl_adapter.RolloutServiceGenerator(skyrl_cfg, tokenizer, service=service)
    g, n = args.groups, args.samples
    ways: dict[str, Callable[[int], int]] = {
        "bare_client": lambda step: bare_client(url, step, g, n),
        "slime": lambda step: slime_step(step, g, n),
        "verl": lambda step: verl_step(manager, step, g, n),
        "trl": lambda step: trl_step(rollout, tokenizer, step, g, n),
        "skyrl": lambda step: skyrl_step(generator, step, g, n),
        "areal": lambda step: areal_step(service, step, g, n),
        "openrlhf": lambda step: openrlhf_step(service, tokenizer, step, g, n),
    }
    names = list(ways)
    figures: dict[str, dict[str, list[float]]] = {
        way: {"cold": [], "cold_tail": [], "warm": [], "warm_cpu": [], "warm_service_cpu": []}
        for way in names
    }
    load_before = os.getloadavg()
    bare_client(url, -1, g, n)  # warm-up: first requests, caches
    for step in range(args.steps):
        order = names[step % len(names) :] + names[: step % len(names)]  # no way always first
        for way in order:
            # Each way's steps are its own (slime, verl, ... name their batches by the way's step
            # number): offset so that no two ways share a batch. 1000 * k is 0 modulo the split's 200
            # tasks: every way's step s runs the same tasks.
            rows, seconds, _, tail = timed(ways[way], 1000 * (names.index(way) + 1) + step)
            figures[way]["cold"].append(seconds)
            figures[way]["cold_tail"].append(tail)
            assert rows == g * n, (way, rows)
    for _ in range(args.repeats):
        for way in names:
            service_cpu = process_tree_cpu_seconds(service_pid)
            _, seconds, cpu, _ = timed(ways[way], 1000 * (names.index(way) + 1))
            figures[way]["warm_service_cpu"].append(process_tree_cpu_seconds(service_pid) - service_cpu)
            figures[way]["warm"].append(seconds)
            figures[way]["warm_cpu"].append(cpu)
    median = {
        way: {kind: statistics.median(values) for kind, values in f.items()} for way, f in figures.items()
    }
    bare = median["bare_client"]
    result: dict[str, Any] = {}
    for way in names:
        result[way] = {
            "cold_seconds": round(median[way]["cold"], 3),
            "cold_steps": [round(s, 3) for s in figures[way]["cold"]],
            "cold_tail_seconds": round(median[way]["cold_tail"], 4),
            "warm_seconds": round(median[way]["warm"], 4),
            "warm_steps": [round(s, 4) for s in figures[way]["warm"]],
            "warm_cpu_seconds": round(median[way]["warm_cpu"], 4),
            "warm_service_cpu_seconds": round(median[way]["warm_service_cpu"], 4),
            "overhead_of_step": round((median[way]["warm"] - bare["warm"]) / bare["cold"], 4),
            "tail_overhead_of_step": round((median[way]["cold_tail"] - bare["cold_tail"]) / bare["cold"], 4),
            "cpu_overhead_of_step": round((median[way]["warm_cpu"] - bare["warm_cpu"]) / bare["cold"], 4),
        }
    for kind in ("cold", "cold_tail", "warm"):
        result[f"verl_vs_slime_{kind}"] = round(median["verl"][kind] / median["slime"][kind], 3)
    result["verl_vs_slime_warm_cpu"] = round(median["verl"]["warm_cpu"] / median["slime"]["warm_cpu"], 3)
    result["load_average_before"] = [round(load, 2) for load in load_before]
    result["load_average_after"] = [round(load, 2) for load in os.getloadavg()]
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="cold steps per way")
    parser.add_argument("--repeats", type=int, default=5, help="warm pulls per way")
    parser.add_argument("--latency", type=float, default=0.05, help="the simulated engine's seconds per call")
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    args = parser.parse_args(argv)
    with (
        tempfile.TemporaryDirectory() as tmp,
        sim_worker(args.latency, Path(tmp), NO_RAMBLES) as (sim_url, _),
        fresh_database(args.database, Path(tmp), migrate=True) as database_url,
        serve_process(database_url, sim_url, Path(tmp)) as served,
    ):
        runs = run(served.url, served.pid, args)
    for way in ("bare_client", *ADAPTERS):
        print(way, json.dumps(runs[way]), flush=True)
    max_overhead = max(runs[way]["overhead_of_step"] for way in ADAPTERS)
    max_tail_overhead = max(runs[way]["tail_overhead_of_step"] for way in ADAPTERS)
    result = {
        "bench": "trainer_adapters",
        "database": args.database,
        "groups": args.groups,
        "samples": args.samples,
        **runs,
        "tail_overheads_of_step": {way: runs[way]["tail_overhead_of_step"] for way in ADAPTERS},
        "overheads_of_step": {way: runs[way]["overhead_of_step"] for way in ADAPTERS},
        "max_tail_overhead_of_step": max_tail_overhead,
        "max_overhead_of_step": max_overhead,
        "goal": GOAL,
        # What an adapter adds to a fresh step once its groups are in; the warm figure is the bound
        # for a step whose groups all come in one page (nothing converted while waiting).
        "overhead_goal_met": max_tail_overhead <= OVERHEAD_GOAL,
        "overhead_goal_met_warm": max_overhead <= OVERHEAD_GOAL,
        "verl_vs_slime_goal_met": runs["verl_vs_slime_cold_tail"] <= 1.0,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""rollout_client.trl under TRL's real GRPOTrainer (PyPI's trl 1.10.0, the release of the commit the
adapter and tests/trl_standin follow, f2cd57710ae345ea6428ae95363267fcf38a3dc8), which imports
torch: it runs in its own cached Python 3.11 virtualenv (scripts/ensure_trl.sh) with a tiny
random-weight model on the CPU, one GRPO step of `trainer.train()` against a live service and the
simulated SGLang worker. The test checks what TRL's own generation step made of the rollout
function's output (the tensors its loss is computed on) against the episodes as the service stored
them: the stand-in's contract, on the real types."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.sim.worker import SimWorker
from tests.support.cached_venv import ensure_cached_venv
from tests.support.trainer_service import stored_episodes

pytest_plugins = ("tests.support.trainer_fixtures",)
ROOT = Path(__file__).resolve().parents[1]
ENSURE_TIMEOUT_SECONDS = 1800  # the first run builds the virtualenv (torch from disk, TRL from PyPI)
STEP_TIMEOUT_SECONDS = 600
MAX_COMPLETION_LENGTH = 1024  # tests/support/trl_real_driver.py's
GENERATIONS = 4


def ensure_trl() -> tuple[str, str]:
    """(the TRL venv's python, the model directory); skips where TRL cannot be had (not on CI)."""
    values = ensure_cached_venv("ensure_trl.sh", "real TRL", ENSURE_TIMEOUT_SECONDS)
    return values["python"], values["model"]


def run_step(python: str, model: str, out: Path, tasks: list[int]) -> dict[str, Any]:
    env = os.environ | {
        "PYTHONPATH": str(ROOT / "client"),
        "HF_HUB_OFFLINE": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = [
        python,
        str(ROOT / "tests" / "support" / "trl_real_driver.py"),
        model,
        str(out),
        str(out.parent / "run"),
    ]
    done = subprocess.run(
        command + [str(task) for task in tasks],
        capture_output=True, text=True, env=env, timeout=STEP_TIMEOUT_SECONDS, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


# The database is not what this test is about (test_trl_adapter.py covers both); one TRL step on
# the CPU is the slow part.
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_trls_real_grpo_trainer_trains_on_exactly_the_stored_tokens(
    service: tuple[str, SimWorker], tokenizer: Any, tmp_path: Path
) -> None:
    python, model = await asyncio.to_thread(ensure_trl)
    url, _ = service
    tasks = [3, 7]
    result = await asyncio.to_thread(run_step, python, model, tmp_path / "step.json", tasks)
    [step] = result["steps"]
    episodes = await stored_episodes(url, step["episode_ids"])
    order = [episodes[e]["task_index"] for e in step["episode_ids"]]  # TRL's sampler shuffles the prompts
    assert sorted(order[::GENERATIONS]) == tasks and order == [
        t for t in order[::GENERATIONS] for _ in range(GENERATIONS)
    ]
    assert [episodes[e]["sample_index"] for e in step["episode_ids"]] == list(range(GENERATIONS)) * len(tasks)
    pad = tokenizer.pad_token_id
    untrained = 0
    for row, episode_id in enumerate(step["episode_ids"]):
        episode = episodes[episode_id]
        prompt, response = episode["prompt_ids"], episode["response_ids"]
        kept = min(len(response), MAX_COMPLETION_LENGTH)
        shown = max(kept, 1)  # an episode that sampled nothing: one masked pad token
        trained = episode["status"] in ("completed", "truncated")
        untrained += not trained
        width = len(step["prompt_ids"][row])
        assert step["prompt_ids"][row] == [pad] * (width - len(prompt)) + prompt
        assert step["prompt_mask"][row] == [0] * (width - len(prompt)) + [1] * len(prompt)
        width = len(step["completion_ids"][row])
        assert step["completion_ids"][row] == (response[:kept] or [pad]) + [pad] * (width - shown)
        assert step["completion_mask"][row] == [1] * shown + [0] * (width - shown)
        mask = (episode["loss_mask"][:kept] if trained else [0] * kept) or [0]
        # TRL pads its tool mask with 1; its loss mask is completion_mask * tool_mask.
        assert step["tool_mask"][row] == mask + [1] * (width - shown)
        logps = (episode["rollout_logprobs"][:kept] or [0.0]) + [0.0] * (width - shown)
        assert np.allclose(step["sampling_per_token_logps"][row], logps)
        if not trained:
            assert step["advantages"][row] == 0.0
    logged = result["logged"]
    assert logged["rollout_service/masked"] == untrained
    statuses = [episodes[e]["status"] for e in step["episode_ids"]]
    assert sum(logged.get(f"rollout_service/{s}", 0) for s in set(statuses)) == len(statuses)
    assert logged["rollout_service/cut"] == sum(
        len(e["response_ids"]) > MAX_COMPLETION_LENGTH for e in episodes.values()
    )
    assert np.isfinite(result["train_loss"])

"""One GRPO step of TRL's real GRPOTrainer with rollout_client.trl as its rollout function, on the
CPU with a tiny model: run by tests/test_trl_real.py in the TRL virtualenv (scripts/ensure_trl.sh),
not imported by the suite. Writes what TRL's generation step produced (and the episodes it came
from) to a JSON file for the test to compare with the stored episodes.

Usage: python trl_real_driver.py MODEL_DIR OUT_JSON OUTPUT_DIR TASK...
(the ROLLOUT_* environment variables name the service)
"""

from __future__ import annotations

import json
import sys
from typing import Any

from datasets import Dataset
from rollout_client import trl as service
from trl import GRPOConfig, GRPOTrainer

GENERATIONS = 4
MAX_COMPLETION_LENGTH = 1024


class RecordingTrainer(GRPOTrainer):  # type: ignore[misc]
    """GRPOTrainer, keeping what each generation step returned (what the loss is computed on)."""

    steps: list[dict[str, Any]] = []

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        self.steps.append({
            "episode_ids": [row["episode_id"] for row in inputs],
            "prompt_ids": output["prompt_ids"].tolist(),
            "prompt_mask": output["prompt_mask"].tolist(),
            "completion_ids": output["completion_ids"].tolist(),
            "completion_mask": output["completion_mask"].tolist(),
            "tool_mask": output["tool_mask"].tolist(),
            "sampling_per_token_logps": (
                output["sampling_per_token_logps"].tolist() if "sampling_per_token_logps" in output else None
            ),
            "advantages": output["advantages"].tolist(),
        })  # fmt: skip
        return output


def main(model: str, out: str, output_dir: str, tasks: list[int]) -> None:
    args = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=len(tasks) * GENERATIONS,
        num_generations=GENERATIONS,
        max_completion_length=MAX_COMPLETION_LENGTH,
        max_steps=1,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=1,
    )
    dataset = Dataset.from_dict({"prompt": [str(task) for task in tasks]})
    trainer = RecordingTrainer(
        model=model,
        reward_funcs=service.service_reward,
        args=args,
        train_dataset=dataset,
        rollout_func=service.rollout_func,
    )
    result = trainer.train()
    [logged, *_] = trainer.state.log_history  # the step's logged metrics, then the run's summary
    with open(out, "w") as file:
        json.dump(
            {"steps": RecordingTrainer.steps, "train_loss": result.training_loss, "logged": logged}, file
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], [int(task) for task in sys.argv[4:]])

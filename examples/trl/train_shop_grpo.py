"""GRPO on the service's builtin/shop tasks with TRL: the service runs the episodes, TRL trains.

ROLLOUT_SERVICE_URL=http://localhost:8000 ROLLOUT_ENV=builtin/shop python examples/trl/train_shop_grpo.py
"""

from datasets import Dataset
from rollout_client import trl as service
from trl import GRPOConfig, GRPOTrainer

TASKS = 200  # builtin/shop's train split

trainer = GRPOTrainer(
    model="Qwen/Qwen3-4B",
    args=GRPOConfig(output_dir="shop-grpo", num_generations=8, max_completion_length=8192),
    train_dataset=Dataset.from_dict({"prompt": [str(task) for task in range(TASKS)]}),
    rollout_func=service.rollout_func,
    reward_funcs=service.service_reward,
)
trainer.train()

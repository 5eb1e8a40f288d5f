from trl.trainer.grpo_trainer import GRPOConfig, GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]

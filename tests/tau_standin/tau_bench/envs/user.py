from __future__ import annotations


class HumanUser:
    """Like tau-bench's human user (stdin): tests must replace it before reset."""

    def reset(self, instruction: str | None = None) -> str:
        raise RuntimeError("the stand-in's human user reads stdin: replace env.user")

    def step(self, content: str) -> str:
        raise RuntimeError("the stand-in's human user reads stdin: replace env.user")

    def get_total_cost(self) -> float:
        return 0.0


def load_user(user_strategy: str, model: str | None = None, provider: str | None = None) -> HumanUser:
    if user_strategy != "human":
        raise ValueError("the stand-in only has the human user strategy (no LLM call at construction)")
    return HumanUser()

"""A single-turn verifiers taskset: a sum to answer; its rubric is an exact-match reward (weight 1)
and a zero-weight reward on the answer's length, which shows up in info but not in the reward."""

from __future__ import annotations

import verifiers.v1 as vf

__all__ = ["ArithmeticTaskset"]


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == str(self.data.answer))

    @vf.reward(weight=0.0)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) < 10)


class ArithmeticConfig(vf.TasksetConfig):
    offset: int = 0  # the test split's tasks start here


class ArithmeticTaskset(vf.Taskset[SumTask, ArithmeticConfig]):
    def load(self) -> list[SumTask]:
        start = self.config.offset
        return [
            SumTask(SumData(prompt=f"What is {a} + {a + 1}?", answer=2 * a + 1), self.config.task)
            for a in range(start, start + 20)
        ]

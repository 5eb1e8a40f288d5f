"""A multi-turn, tool-using verifiers taskset, played by verifiers' bash harness (bash and edit
tools run in the rollout's runtime): the task asks for a file; the rubric reads the runtime's file
and the model's last reply."""

from __future__ import annotations

import verifiers.v1 as vf

__all__ = ["FilesTaskset"]


class FileData(vf.TaskData):
    word: str


class FileTask(vf.Task[FileData]):
    @vf.reward
    async def wrote_file(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        try:
            text = (await runtime.read("answer.txt")).decode()
        except Exception:
            return 0.0
        return float(text.strip() == self.data.word)

    @vf.reward(weight=0.5)
    async def said_done(self, trace: vf.Trace) -> float:
        return float("done" in trace.last_reply.lower())


class FilesTaskset(vf.Taskset[FileTask, vf.TasksetConfig]):
    def load(self) -> list[FileTask]:
        words = ["apple", "river", "stone", "cloud"]
        return [
            FileTask(
                FileData(prompt=f"Write the word {word} to the file answer.txt, then say done.", word=word),
                self.config.task,
            )
            for word in words
        ]

"""openrlhf/trainer/ray/vllm_engine.py: how a rollout actor loads and calls the agent executor
(no Ray, no vLLM: the executor is the service's, it never calls the engine)."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

from openrlhf.utils.agent import AgentExecutorBase


def _load_agent_executor(agent_func_path: str) -> AgentExecutorBase:
    assert agent_func_path.endswith(".py"), "Agent path must be a Python file"
    spec = importlib.util.spec_from_file_location("agent_module", agent_func_path)
    assert spec is not None and spec.loader is not None
    agent_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent_module)
    assert hasattr(agent_module, "AgentExecutor"), "Agent module must contain AgentExecutor class"
    agent_executor_cls = agent_module.AgentExecutor
    assert issubclass(agent_executor_cls, AgentExecutorBase), (
        "AgentExecutor must inherit from AgentExecutorBase"
    )
    return agent_executor_cls()


class RolloutRayActor:
    def __init__(self, agent_func_path: str) -> None:
        self.executor = _load_agent_executor(agent_func_path)

    async def generate(
        self, prompt_token_ids: list[int], sampling_params: Any, multi_modal_data: Any = None
    ) -> Any:
        raise AssertionError("the service's executor must not generate with OpenRLHF's engine")

    async def generate_responses(
        self,
        prompt: str,
        label: str,
        sampling_params: Any,
        max_length: int,
        hf_tokenizer: Any,
        num_samples: int = 1,
        images: Any = None,
    ) -> list[dict[str, Any]]:
        tasks = [
            self.executor.execute(
                prompt=prompt,
                label=label,
                sampling_params=sampling_params,
                max_length=max_length,
                hf_tokenizer=hf_tokenizer,
                llm_engine=self,
                images=images,
            )
            for _ in range(num_samples)
        ]
        return list(await asyncio.gather(*tasks))

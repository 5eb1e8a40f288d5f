"""tau2-bench (retail, airline, telecom, mock) as Environments: tau2's own environment, user
simulator and evaluator, driven as tau2's orchestrator drives them.

- The policy is shown tau2's agent system prompt (its instruction and the domain policy) and the
  domain's agent tools. Its tool calls run in tau2's environment (`get_response`); its text goes
  to tau2's UserSimulator, on the OpenAI-compatible endpoint of USER_SIM_* (litellm, blocking: in
  the env worker's threads).
- Dual control (telecom): the simulated user's own tool calls (toggling roaming, rebooting) run
  in the environment inside the step, their results go back to the user, as in tau2's orchestrator;
  they show in the transcript (`env_only`), never in the policy's tokens.
- The episode ends when the user stops (###STOP###, ###TRANSFER###, ###OUT-OF-SCOPE###) or after
  MAX_ERRORS tool errors (tau2's limit); its reward is tau2's evaluator on the whole simulation
  (reward basis DB, ENV_ASSERTION, COMMUNICATE, ACTION, NL_ASSERTION), its breakdown in the info.

`tau2` is an optional install (not on PyPI) and imports litellm (~2.5 s): it is imported only
here, lazily, inside the env worker that builds an episode's environment.
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from typing import Any

from service.envs.base import Action, Reset, Step, UserSimConfig
from service.envs.tau2_data import TAU2_DOMAINS, data_dir, read_tasks

MAX_ERRORS = 10  # tool errors (either side) that end a simulation: tau2's orchestrator's default
USER_SIM_MAX_TOOL_ROUNDS = 20  # user tool calls in a row before a user turn is given up


@functools.cache
def _tau2() -> Any:
    """tau2's modules, imported once per process, quietly."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else litellm fetches it at import
    try:
        from loguru import logger

        logger.remove()  # tau2 logs every step at DEBUG to stderr
        import tau2.evaluator.evaluator_nl_assertions as nl_assertions
        from tau2.agent.llm_agent import AGENT_INSTRUCTION, SYSTEM_PROMPT
        from tau2.data_model import message, simulation
        from tau2.data_model.tasks import Task
        from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
        from tau2.orchestrator.orchestrator import DEFAULT_FIRST_AGENT_MESSAGE
        from tau2.registry import registry
        from tau2.user.user_simulator import UserSimulator
        from tau2.user.user_simulator_base import is_valid_user_history_message
        from tau2.utils.utils import get_now
    except ImportError as exc:
        raise ImportError(
            "tau2-bench environments need the tau2 package (tau2-bench's, not PyPI's `tau2`): see the "
            "docs/envs/catalogues.md (tau2)"
        ) from exc
    return type(
        "Tau2",
        (),
        {
            "nl_assertions": nl_assertions,
            "system_prompt": SYSTEM_PROMPT,
            "agent_instruction": AGENT_INSTRUCTION,
            "message": message,
            "simulation": simulation,
            "Task": Task,
            "EvaluationType": EvaluationType,
            "evaluate_simulation": evaluate_simulation,
            "greeting": DEFAULT_FIRST_AGENT_MESSAGE,
            "registry": registry,
            "UserSimulator": UserSimulator,
            "user_sees": is_valid_user_history_message,
            "get_now": get_now,
        },
    )


@functools.cache
def _tasks(domain: str, split: str) -> tuple[Any, ...]:
    """The split's tasks (tau2 Task objects), in the order task indexes address them."""
    root = data_dir()
    if root is None:
        raise ValueError("tau2's data folder is unknown: set TAU2_DATA_DIR")
    return tuple(_tau2().Task.model_validate(task) for task in read_tasks(root, domain, split))


def _use_judge(tau2: Any, config: UserSimConfig) -> None:
    """Points tau2's NL-assertion judge at JUDGE_* (module attributes: tau2 takes no argument)."""
    if config.judge_base_url:
        tau2.nl_assertions.DEFAULT_LLM_NL_ASSERTIONS = f"openai/{config.judge_model}"
        tau2.nl_assertions.DEFAULT_LLM_NL_ASSERTIONS_ARGS = {
            "temperature": 0.0,
            "api_base": config.judge_base_url,
            "api_key": config.judge_api_key.get_secret_value() or "none",
        }


class Tau2Environment:
    """One tau2 episode. Not thread-safe; lives in one env worker for its lifetime."""

    def __init__(self, domain: str, split: str, user_sim: UserSimConfig) -> None:
        if domain not in TAU2_DOMAINS:
            raise ValueError(f"unknown tau2 domain {domain!r}; known: {TAU2_DOMAINS}")
        self._tau2 = tau2 = _tau2()
        _use_judge(tau2, user_sim)
        self.domain, self.split, self._user_sim = domain, split, user_sim
        self._tasks = _tasks(domain, split)
        self._env = tau2.registry.get_env_constructor(domain)()
        self.system_prompt: str = tau2.system_prompt.format(
            agent_instruction=tau2.agent_instruction, domain_policy=self._env.get_policy()
        )
        self.tools: list[dict[str, Any]] = [tool.openai_schema for tool in self._env.get_tools()]
        self._task: Any = None
        self._user: Any = None
        self._user_state: Any = None
        self._trajectory: list[Any] = []
        self._errors = 0
        self._started = 0.0
        self._done = False

    @property
    def num_tasks(self) -> int:
        return len(self._tasks)

    def reset(self, task_index: int) -> Reset:
        if not 0 <= task_index < self.num_tasks:
            where = f"tau2/{self.domain} {self.split}"
            raise IndexError(f"task_index {task_index} out of range: {where} has {self.num_tasks} tasks")
        tau2, task = self._tau2, self._tasks[task_index]
        self._task, self._started, self._done, self._errors = task, time.perf_counter(), False, 0
        self._start_time = tau2.get_now()
        state = task.initial_state
        history = (
            [message.model_copy(deep=True) for message in (state.message_history or [])] if state else []
        )
        for message in history:
            message.turn_idx = None
        self._env.set_state(
            initialization_data=state.initialization_data if state else None,
            initialization_actions=state.initialization_actions if state else None,
            message_history=history,
        )
        try:
            user_tools = self._env.get_user_tools(include=task.user_tools) or None
        except ValueError:  # a domain without user tools (retail, airline)
            user_tools = None
        llm_args: dict[str, Any] = {
            "api_base": self._user_sim.base_url,
            "api_key": self._user_sim.api_key.get_secret_value() or "none",
            "temperature": self._user_sim.temperature,
        }
        if self._user_sim.seed is not None:
            llm_args["seed"] = self._user_sim.seed
        self._user = tau2.UserSimulator(
            llm=f"openai/{self._user_sim.model or 'user-simulator'}",
            instructions=str(task.user_scenario),
            tools=user_tools,
            llm_args=llm_args,
        )
        if history:  # tau2's tasks that start mid-conversation end their history with the agent's text
            last = history[-1]
            if last.role != "assistant" or last.is_tool_call():
                raise ValueError(
                    f"task {task.id!r}: a message history that ends with {last.role} is not supported"
                )
            self._trajectory = list(history)
            self._user_state = self._user.get_init_state([m for m in history[:-1] if tau2.user_sees(m)])
            opening = last
        else:
            opening = tau2.greeting.model_copy(deep=True)
            opening.timestamp = tau2.get_now()
            self._trajectory = [opening]
            self._user_state = self._user.get_init_state()
        self._env.sync_tools()
        reply, transcript = self._user_turn(opening)
        info = {"task_id": task.id, "task": task.model_dump(mode="json")}
        return Reset(observation=reply.content or "", info=info, transcript=transcript)

    def step(self, action: Action) -> Step:
        if self._done:
            raise RuntimeError("the episode is over: step() after done")
        message = self._tau2.message
        if action.name == "respond":
            said = message.AssistantMessage(role="assistant", content=str(action.kwargs.get("content", "")))
            self._trajectory.append(said)
            reply, transcript = self._user_turn(said)
            self._env.sync_tools()
            if self._user.is_stop(reply):
                return self._end(
                    self._tau2.simulation.TerminationReason.USER_STOP, reply.content or "", transcript
                )
            if self._errors >= MAX_ERRORS:
                return self._end(
                    self._tau2.simulation.TerminationReason.TOO_MANY_ERRORS, reply.content or "", transcript
                )
            return Step(observation=reply.content or "", reward=0.0, done=False, transcript=transcript)
        call = message.ToolCall(
            id=f"call_{uuid.uuid4().hex[:12]}",
            name=action.name,
            arguments=dict(action.kwargs),
            requestor="assistant",
        )
        self._trajectory.append(message.AssistantMessage(role="assistant", tool_calls=[call]))
        result = self._env.get_response(call)
        self._trajectory.append(result)
        self._errors += bool(result.error)
        self._env.sync_tools()
        if self._errors >= MAX_ERRORS:
            return self._end(
                self._tau2.simulation.TerminationReason.TOO_MANY_ERRORS, result.content or "", []
            )
        return Step(observation=result.content or "", reward=0.0, done=False)

    def _user_turn(self, incoming: Any) -> tuple[Any, list[dict[str, Any]]]:
        """The user's answer to `incoming`, after running its own tool calls (dual control): the
        user's text message, and the transcript of its tool calls and their results."""
        message = self._tau2.message
        transcript: list[dict[str, Any]] = []
        for _ in range(USER_SIM_MAX_TOOL_ROUNDS):
            reply, self._user_state = self._user.generate_next_message(incoming, self._user_state)
            reply.validate()
            self._trajectory.append(reply)
            if self._user.is_stop(reply) or not reply.is_tool_call():
                return reply, transcript
            results = [self._env.get_response(call) for call in reply.tool_calls]
            self._trajectory.extend(results)
            self._errors += sum(bool(result.error) for result in results)
            transcript.append(
                {
                    "role": "user",
                    "content": reply.content,
                    "tool_calls": [
                        {"name": call.name, "arguments": call.arguments} for call in reply.tool_calls
                    ],
                    "env_only": True,
                }
            )
            transcript.extend(
                {
                    "role": "tool",
                    "name": call.name,
                    "content": result.content,
                    "requestor": "user",
                    "env_only": True,
                }
                for call, result in zip(reply.tool_calls, results, strict=True)
            )
            incoming = (
                results[0]
                if len(results) == 1
                else message.MultiToolMessage(role="tool", tool_messages=results)
            )
        raise RuntimeError(
            f"the simulated user made {USER_SIM_MAX_TOOL_ROUNDS} tool calls in a row without a word"
        )

    def _end(self, reason: Any, observation: str, transcript: list[dict[str, Any]]) -> Step:
        self._done = True
        info = self._evaluate(reason)
        return Step(
            observation=observation,
            reward=info["reward_info"]["reward"],
            done=True,
            info=info,
            transcript=transcript,
        )

    def _evaluate(self, reason: Any) -> dict[str, Any]:
        tau2 = self._tau2
        for index, message in enumerate(self._trajectory):
            message.turn_idx = index
        run = tau2.simulation.SimulationRun(
            id=uuid.uuid4().hex,
            task_id=self._task.id,
            start_time=self._start_time,
            end_time=tau2.get_now(),
            duration=time.perf_counter() - self._started,
            termination_reason=reason,
            messages=self._trajectory,
            seed=self._user_sim.seed,
        )
        reward_info = tau2.evaluate_simulation(
            simulation=run,
            task=self._task,
            evaluation_type=tau2.EvaluationType.ALL,
            solo_mode=False,
            domain=self.domain,
        )
        return {
            "termination_reason": str(getattr(reason, "value", reason)),
            "reward_info": reward_info.model_dump(mode="json"),
            "trajectory": [message.model_dump(mode="json") for message in self._trajectory],
        }


def retail_env(split: str, user_sim: UserSimConfig) -> Tau2Environment:
    return Tau2Environment("retail", split, user_sim)


def airline_env(split: str, user_sim: UserSimConfig) -> Tau2Environment:
    return Tau2Environment("airline", split, user_sim)


def telecom_env(split: str, user_sim: UserSimConfig) -> Tau2Environment:
    return Tau2Environment("telecom", split, user_sim)


def mock_env(split: str, user_sim: UserSimConfig) -> Tau2Environment:
    return Tau2Environment("mock", split, user_sim)

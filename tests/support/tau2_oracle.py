"""An oracle for tau2-bench through the service, without an LLM: the policy (played by the simulated
SGLang worker) replays a task's ground-truth actions, and the simulated user (an OpenAI-compatible
stub that tau2's own UserSimulator calls) performs the user's share of them with its own tools
(telecom's dual control), then stops.

- The policy knows each episode's task from `episode_tasks` (filled from the submit's answer while
  the simulated worker is paused): telecom's tasks share their user scenarios, so the conversation
  cannot tell them apart.
- The policy's turns are the task's actions in order: the agent's own as `<tool_call>`s (the
  qwen25 format), the user's as a request `<user_action>{json}</user_action>` that the stub turns into
  its tool call; then a last message with every `communicate_info` and `<oracle_final/>`, which the
  stub answers `###STOP###` (`###TRANSFER###` after a transfer).
- tau2's NL-assertion judge, pointed at the same stub, finds every assertion met: NL_ASSERTION
  rewards here are not real judgements.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from service.sim.policy import parse_chatml

USER_ACTION = re.compile(r"<user_action>(.*?)</user_action>", re.S)
FINAL = "<oracle_final/>"
TRANSFER_TOOL = "transfer_to_human_agents"


class Tau2Oracle:
    """The policy and the user of episodes of tau2 tasks."""

    def __init__(self) -> None:
        self.episode_tasks: dict[str, dict[str, Any]] = {}  # episode id -> its tau2 task (JSON)
        self.user_requests: list[list[dict[str, Any]]] = []

    def plan(self, task: dict[str, Any]) -> list[str]:
        """The policy's texts for a task (tau2's JSON), turn by turn."""
        criteria = task.get("evaluation_criteria") or {}
        actions = criteria.get("actions") or []
        texts = []
        for action in actions:
            call = json.dumps({"name": action["name"], "arguments": action["arguments"]})
            if action.get("requestor", "assistant") == "assistant":
                texts.append(f"<tool_call>\n{call}\n</tool_call>")
            else:
                texts.append(f"Could you please do this on your device: <user_action>{call}</user_action>")
        said = [f"{info}." for info in criteria.get("communicate_info") or []]
        if any(action["name"] == TRANSFER_TOOL for action in actions):
            said.append("You are being transferred to a human agent.")
        texts.append(" ".join(["All done.", *said, FINAL]))
        return texts

    def policy(self, prompt_text: str, key: str) -> str:
        """The simulated SGLang worker's policy: the next text of the task's plan."""
        task = self.episode_tasks.get(key.split(":", 1)[0])
        if task is None:
            return "I do not know this episode's task."
        messages = parse_chatml(prompt_text)
        plan = self.plan(task)
        done = sum(1 for role, _, closed in messages if role == "assistant" and closed)
        return plan[min(done, len(plan) - 1)]

    def user(self, messages: list[dict[str, Any]]) -> str | dict[str, Any]:
        """The OpenAI stub's script: tau2's UserSimulator (roles flipped: the agent speaks as
        `user`), and tau2's NL-assertion judge."""
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        if "metExpectation" in system:  # the judge
            outcomes = ast.literal_eval(messages[-1]["content"].split("expectedOutcomes:", 1)[1].strip())
            return json.dumps(
                {
                    "results": [
                        {"expectedOutcome": o, "reasoning": "stub", "metExpectation": True} for o in outcomes
                    ]
                }
            )
        self.user_requests.append(messages)
        last = messages[-1]
        text = last.get("content") or ""
        if last["role"] == "tool":
            return f"Done. Here is what I see: {text[:200]}"
        if action := USER_ACTION.search(text):
            call = json.loads(action.group(1))
            name, arguments = call["name"], json.dumps(call["arguments"])
            return {
                "content": None,
                "tool_calls": [
                    {"id": f"call_user_{len(self.user_requests)}", "type": "function",
                     "function": {"name": name, "arguments": arguments}}
                ],
            }  # fmt: skip
        if FINAL in text:
            return "###TRANSFER###" if "transferred" in text else "Thanks! ###STOP###"
        return "Hi, I need some help, please."

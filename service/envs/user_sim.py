"""An LLM-simulated customer on any OpenAI-compatible /chat/completions endpoint.

It follows tau-bench's LLM user (same system prompt, `###STOP###` to end the conversation) but
sends our model, temperature and seed on every call, and fails loudly when the endpoint is down.
It is the `user` object of a tau-bench Env: reset(instruction) -> str, step(content) -> str,
get_total_cost() -> float. Synchronous: it runs inside an env worker.
"""

from __future__ import annotations

from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception_type, retry_if_result, stop_after_attempt

from service.envs.base import UserSimConfig
from service.retries import backoff

STOP_TOKEN = "###STOP###"
# The simulated customer speaks as the "assistant"; the agent's words arrive as "user" turns,
# starting from this greeting (tau-bench's).
AGENT_GREETING = "Hi! How can I help you today?"
USER_SIM_TIMEOUT_SECONDS = 120.0
USER_SIM_RETRIES = 2  # retries of a connection error or a 5xx, before UserSimulatorError
USER_SIM_BACKOFF_SECONDS = 0.25  # first retry delay; doubles, jittered
USER_SIM_BACKOFF_MAX_SECONDS = 4.0


class UserSimulatorError(RuntimeError):
    """The user simulator endpoint could not give a user turn (down, error status, bad reply)."""


def build_system_prompt(instruction: str | None) -> str:
    instruction_display = f"\n\nInstruction: {instruction}\n" if instruction is not None else ""
    return (
        f"You are a user interacting with an agent.{instruction_display}\n"
        "Rules:\n"
        "- Just generate one line at a time to simulate the user's message.\n"
        "- Do not give away all the instruction at once. Only provide the information that is "
        "necessary for the current step.\n"
        "- Do not hallucinate information that is not provided in the instruction. For example, if "
        "the agent asks for the order id but it is not mentioned in the instruction, do not make up "
        "an order id, just say you do not remember or have it.\n"
        f"- If the instruction goal is satisified, generate '{STOP_TOKEN}' as a standalone message "
        "without anything else to end the conversation.\n"
        "- Do not repeat the exact instruction in the conversation. Instead, use your own words to "
        "convey the same information.\n"
        "- Try to make the conversation as natural as possible, and stick to the personalities in "
        "the instruction."
    )


class OpenAIUserSimulator:
    """One episode's simulated user. Not thread-safe (one Env, one worker)."""

    def __init__(
        self,
        config: UserSimConfig,
        client: httpx.Client | None = None,
        retries: int = USER_SIM_RETRIES,
        backoff_seconds: float = USER_SIM_BACKOFF_SECONDS,
    ) -> None:
        if not config.base_url:
            raise UserSimulatorError("no user simulator endpoint configured (set USER_SIM_BASE_URL)")
        self.config = config
        self.url = config.base_url.rstrip("/") + "/chat/completions"
        self._client = client if client is not None else httpx.Client(timeout=USER_SIM_TIMEOUT_SECONDS)
        self._retries = retries
        self._backoff_seconds = backoff_seconds
        self.messages: list[dict[str, Any]] = []
        self.calls = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def reset(self, instruction: str | None = None) -> str:
        self.messages = [
            {"role": "system", "content": build_system_prompt(instruction)},
            {"role": "user", "content": AGENT_GREETING},
        ]
        return self._next_message()

    def step(self, content: str) -> str:
        self.messages.append({"role": "user", "content": content})
        return self._next_message()

    def get_total_cost(self) -> float:
        # A self-hosted endpoint has no price; token counts are kept in prompt/completion_tokens.
        return 0.0

    def _next_message(self) -> str:
        body = self._post(self.request_body())
        try:
            content = body["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as exc:
            raise UserSimulatorError(
                f"user simulator reply has no choices[0].message: {body!r:.500}"
            ) from exc
        if not isinstance(content, str):
            raise UserSimulatorError(f"user simulator reply has no text content: {body!r:.500}")
        usage = body.get("usage") or {}
        self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        self.completion_tokens += int(usage.get("completion_tokens") or 0)
        self.messages.append({"role": "assistant", "content": content})
        return content

    def request_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.config.model,
            "messages": self.messages,
            "temperature": self.config.temperature,
        }
        if self.config.seed is not None:
            body["seed"] = self.config.seed
        return body

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        api_key = self.config.api_key.get_secret_value()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        retrying = Retrying(
            stop=stop_after_attempt(self._retries + 1),
            wait=backoff(self._backoff_seconds, USER_SIM_BACKOFF_MAX_SECONDS),
            retry=retry_if_exception_type(httpx.TransportError)
            | retry_if_result(lambda response: response.status_code >= 500),
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
        )
        try:
            response: httpx.Response = retrying(self._client.post, self.url, json=body, headers=headers)
        except httpx.TransportError as exc:
            raise UserSimulatorError(
                f"user simulator at {self.url} unreachable: {type(exc).__name__}: {exc}"
            ) from exc
        self.calls += 1
        if response.status_code != 200:
            raise UserSimulatorError(
                f"user simulator at {self.url} answered HTTP {response.status_code}: {response.text[:500]}"
            )
        try:
            parsed = response.json()
        except ValueError as exc:
            raise UserSimulatorError(
                f"user simulator at {self.url} answered non-JSON: {response.text[:500]}"
            ) from exc
        if not isinstance(parsed, dict):
            raise UserSimulatorError(f"user simulator at {self.url} answered {parsed!r:.500}")
        return parsed

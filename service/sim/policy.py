"""The simulated worker's policy: pure functions of the prompt text and the episode's seed.

It decodes a ChatML prompt, finds the `builtin/shop` task by its first user message, and plays the
task's oracle plan with seeded mistakes; any other conversation gets the generic policy: each of
the prompt's tools called once (up to GENERIC_TOOL_CALLS) with arguments valid for its schema, then
an answer. `SimConfig.policy` (`sim-worker --policy module:function`) replaces both. Outputs are
token ids the way real sampling gives them, not always the canonical tokenization of the text.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from service.config import TEST_TOKENIZER_DIR
from service.envs.base import RESPOND_ACTION_NAME, Action
from service.envs.builtin.shop import REASONS, TOOL_FUNCTIONS, oracle_plan, task_by_instruction
from service.records import rid_attempt_key
from service.sim.arguments import arguments_for

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_RESPONSE = "<tool_response>"
UNKNOWN_REPLY = "Hello! I am a simulated assistant. How can I help you today?"  # no tools to call
GENERIC_ANSWER = "I have checked everything I can with the tools. Goodbye."
GENERIC_TOOL_CALLS = 3  # tool calls the generic policy makes before it answers
TOOLS_START, TOOLS_END = "<tools>", "</tools>"
AFTER_PLAN_REPLY = "Thank you for contacting us. Goodbye."
RAMBLE_SENTENCE = "Let me think about this once more, step by step, to be completely sure. "
WRONG_REASON = "changed my mind"  # not one of shop.REASONS: the tool refuses it


@dataclass(frozen=True)
class SimConfig:
    tokenizer_path: str = str(TEST_TOKENIZER_DIR)  # a HF tokenizer dir with tokenizer.json
    model_path: str = "sim/shop-oracle"  # reported by /get_model_info and /v1/models
    context_length: int = 32768  # longer inputs (or input + max_new_tokens) are refused with 400
    latency_seconds: float = 0.02  # fixed time of every request (queueing + prefill)
    per_token_latency_seconds: float = 0.0  # decode time per output token
    # Per-episode mistake rates (an episode is "<episode_id>:<attempt>", the rid without its turn).
    wrong_argument_rate: float = 0.12  # a write action with a wrong reason or address: reward 0
    malformed_call_rate: float = 0.06  # broken JSON in one <tool_call>: the episode is aborted
    ramble_rate: float = 0.08  # one turn is a long reply cut by max_new_tokens
    noncanonical_rate: float = 0.05  # per token: sampled as two or more smaller tokens
    # Stragglers: this share of episodes (by episode id) takes `slow_episode_factor` times as long
    # per request (latency and decoding).
    slow_episode_rate: float = 0.0
    slow_episode_factor: float = 20.0
    include_stop_token: bool = True  # output_ids end with <|im_end|> on a stop (some builds omit it)
    max_queued_requests: int | None = None  # more requests in flight than this: 503
    weight_version: str = "default"
    stream_interval: int = 8  # output tokens per SSE chunk
    seed: int = 0  # mixed into every random choice
    request_log_limit: int = 100_000  # oldest entries of SimWorker.requests are dropped beyond this
    # The worker's prefix cache (prefix_cache.py): tokens held (SGLang's max_total_num_tokens), and
    # the page size its lookups hash by (matches stay exact to the token). 0 tokens: no cache.
    prefix_cache_tokens: int = 1_000_000
    prefix_page_tokens: int = 16
    # Another policy than builtin/shop's oracle: (prompt text, "<episode_id>:<attempt>") -> the
    # assistant's next text. The sampling (non-canonical tokens, logprobs, stops) stays the sim's.
    policy: Callable[[str, str], str] | None = None


def parse_chatml(text: str) -> list[tuple[str, str, bool]]:
    """(role, content, closed) of each `<|im_start|>role\\n...<|im_end|>` message; the last may be open."""
    messages = []
    for block in text.split(IM_START)[1:]:
        header, _, rest = block.partition("\n")
        content, closed, _ = rest.partition(IM_END)
        messages.append((header.strip(), content, bool(closed)))
    return messages


def render_action(action: Action) -> str:
    if action.name == RESPOND_ACTION_NAME:
        return str(action.kwargs.get("content", ""))
    call = json.dumps({"name": action.name, "arguments": action.kwargs})
    return f"<tool_call>\n{call}\n</tool_call>"


def _wrong_arguments(action: Action) -> Action:
    kwargs = dict(action.kwargs)
    if "reason" in kwargs:
        kwargs["reason"] = WRONG_REASON if kwargs["reason"] in REASONS else REASONS[0]
    if "address" in kwargs:
        number, _, street = str(kwargs["address"]).partition(" ")
        kwargs["address"] = f"{int(number) + 1 if number.isdigit() else 1} {street}"
    return Action(action.name, kwargs)


def prompt_tools(messages: list[tuple[str, str, bool]]) -> list[dict[str, Any]]:
    """The OpenAI function schemas the chat template listed in the system message (one JSON object
    a line between <tools> and </tools>, as Qwen's and Hermes' templates write them)."""
    system = next((content for role, content, _ in messages if role == "system"), "")
    tools = []
    # Every <tools>...</tools> span (the instructions name the tags too): the schemas are its lines.
    lines = [
        line for block in system.split(TOOLS_START)[1:] for line in block.split(TOOLS_END)[0].splitlines()
    ]
    for line in lines:
        try:
            tool = json.loads(line)
        except ValueError:
            continue
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            tools.append(function)
    return tools


def generic_reply(messages: list[tuple[str, str, bool]], key: str, config: SimConfig) -> str:
    """Any environment: the prompt's tools in turn, each called once with arguments valid for its
    schema (seeded by the episode), then an answer; with no tools, a greeting."""
    tools = prompt_tools(messages)
    if not tools or {tool["name"] for tool in tools} == set(TOOL_FUNCTIONS):
        return UNKNOWN_REPLY  # no tools, or builtin/shop's with none of its tasks: as before
    turn = sum(1 for role, _, closed in messages if role == "assistant" and closed)
    if turn >= min(len(tools), GENERIC_TOOL_CALLS):
        return GENERIC_ANSWER
    tool = tools[turn]
    rng = random.Random(f"{config.seed}:{key}:{turn}:arguments")
    return render_action(Action(tool["name"], arguments_for(tool.get("parameters"), rng)))


def policy_reply(prompt_text: str, key: str, config: SimConfig) -> tuple[str, bool]:
    """The assistant's next text for this prompt, and whether it rambles (to be cut by max_new_tokens)."""
    messages = parse_chatml(prompt_text)
    first_user = next((content for role, content, _ in messages if role == "user"), None)
    task = task_by_instruction().get(first_user) if first_user is not None else None
    if task is None:
        return generic_reply(messages, key, config), False
    turn = sum(1 for role, _, closed in messages if role == "assistant" and closed)
    plan = oracle_plan(task)
    if turn >= len(plan):
        return AFTER_PLAN_REPLY, False

    # Every draw happens in the same order whatever the turn: the episode's mistakes are fixed.
    rng = random.Random(f"{config.seed}:{key}:mistakes")
    wrong = rng.random() < config.wrong_argument_rate
    malformed = rng.random() < config.malformed_call_rate
    tool_turns = [index for index, action in enumerate(plan) if action.name != RESPOND_ACTION_NAME]
    malformed_turn = rng.choice(tool_turns) if tool_turns else -1
    ramble = rng.random() < config.ramble_rate
    ramble_turn = rng.randrange(len(plan))

    if ramble and turn == ramble_turn:
        return RAMBLE_SENTENCE, True
    action = plan[turn]
    if wrong and turn > task.confirm_before:
        action = _wrong_arguments(action)
    text = render_action(action)
    if malformed and turn == malformed_turn:
        text = text.replace("}\n</tool_call>", "\n</tool_call>", 1)  # drops the closing brace
    return text, False


def latency_factor(rid: str, config: SimConfig) -> float:
    """How much slower than the configured latency this request's episode runs (a straggler's)."""
    if config.slow_episode_rate <= 0:
        return 1.0
    episode_id = rid.split(":", 1)[0]
    slow = random.Random(f"{config.seed}:{episode_id}:slow").random() < config.slow_episode_rate
    return config.slow_episode_factor if slow else 1.0


class SimTokens:
    """Tokenizer work of the sim: canonical encodings, split into non-canonical pieces at random."""

    def __init__(self, tokenizer_path: str) -> None:
        path = Path(tokenizer_path)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
        vocab = self.tokenizer.get_vocab(with_added_tokens=False)
        added = self.tokenizer.get_added_tokens_decoder()
        eos_id = self.tokenizer.token_to_id(IM_END)
        if eos_id is None:
            raise ValueError(f"{tokenizer_path} has no {IM_END} token")
        self.eos_id: int = eos_id
        self.assistant_header = self.encode(f"{IM_START}assistant\n")
        self._vocab = {token: token_id for token, token_id in vocab.items() if token_id not in added}
        self._pieces = {token_id: token for token, token_id in self._vocab.items()}

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def sample(self, text: str, rng: random.Random, noncanonical_rate: float) -> list[int]:
        """Ids whose bytes are `text`: canonical tokens, some split into smaller vocab pieces."""
        ids: list[int] = []
        for token_id in self.encode(text):
            piece = self._pieces.get(token_id)  # None for added tokens: a model samples those whole
            if piece is not None and len(piece) > 1 and rng.random() < noncanonical_rate:
                ids.extend(self._vocab[part] for part in self._split(piece, rng))
            else:
                ids.append(token_id)
        return ids

    def _split(self, piece: str, rng: random.Random) -> list[str]:
        # Byte-level BPE: each character of a piece is one byte, and every byte is in the vocab.
        cut = rng.randint(1, len(piece) - 1)
        parts = []
        for part in (piece[:cut], piece[cut:]):
            parts.extend([part] if part in self._vocab else self._split(part, rng))
        return parts


@dataclass
class PlannedOutput:
    ids: list[int]
    logprobs: list[float]
    finish_reason: dict[str, Any]


def open_turn_start(tokens: SimTokens, prompt_ids: list[int]) -> int | None:
    """Where the prompt's last assistant turn starts, if that turn is open and holds tokens: the
    request resumes a turn an abort cut short (its input is the prompt plus what was sampled)."""
    header = tokens.assistant_header
    for start in range(len(prompt_ids) - len(header), -1, -1):
        if prompt_ids[start : start + len(header)] == header:
            begin = start + len(header)
            if begin < len(prompt_ids) and tokens.eos_id not in prompt_ids[begin:]:
                return begin
            return None
    return None


def plan_output(
    tokens: SimTokens, config: SimConfig, prompt_ids: list[int], sampling_params: dict[str, Any], rid: str
) -> PlannedOutput:
    """The full (not aborted) output of one request, deterministic in the rid's episode and the
    prompt. A request that resumes an open assistant turn continues that turn's plan after the
    tokens it already holds, as a model continues its own prefix."""
    key = rid_attempt_key(rid)
    start = open_turn_start(tokens, prompt_ids)
    context = prompt_ids if start is None else prompt_ids[:start]
    sampled = [] if start is None else prompt_ids[start:]
    prompt_text = tokens.decode(context, skip_special_tokens=False)
    if config.policy is not None:
        text, ramble = config.policy(prompt_text, key), False
    else:
        text, ramble = policy_reply(prompt_text, key, config)
    max_new_tokens = int(sampling_params.get("max_new_tokens", 128))
    rng = random.Random(f"{config.seed}:{key}:{len(context)}:sample")
    ids = tokens.sample(text, rng, config.noncanonical_rate)
    while ramble and len(ids) <= len(sampled) + max_new_tokens:
        ids += tokens.sample(RAMBLE_SENTENCE, rng, config.noncanonical_rate)
    ids.append(tokens.eos_id)
    logprobs = [-3.0 * rng.random() for _ in ids]
    if ids[: len(sampled)] == sampled:
        ids, logprobs = ids[len(sampled) :], logprobs[len(sampled) :]
    stop_ids = {int(token) for token in sampling_params.get("stop_token_ids") or []}
    finish: dict[str, Any] = {"type": "stop", "matched": tokens.eos_id}
    for index, token in enumerate(ids):
        if token in stop_ids:
            ids, logprobs = ids[: index + 1], logprobs[: index + 1]
            finish = {"type": "stop", "matched": token}
            break
    # Stop strings (`stop`): the output ends with the token that completes the first one the text
    # holds; the ids keep it (SGLang trims only its text), and `matched` is the string.
    stops = sampling_params.get("stop") or []
    stops = [stop for stop in ([stops] if isinstance(stops, str) else stops) if stop]
    for end in range(1, len(ids) + 1) if stops else ():
        text = tokens.decode(ids[:end])
        matched = next((stop for stop in stops if stop in text), None)
        if matched is not None:
            ids, logprobs = ids[:end], logprobs[:end]
            finish = {"type": "stop", "matched": matched}
            break
    # SGLang checks the length before the stop token: a stop token at the limit reads "length".
    if len(ids) >= max_new_tokens:
        ids, logprobs = ids[:max_new_tokens], logprobs[:max_new_tokens]
        finish = {"type": "length", "length": max_new_tokens}
    elif not config.include_stop_token and not isinstance(finish["matched"], str):
        ids, logprobs = ids[:-1], logprobs[:-1]
    return PlannedOutput(ids, logprobs, finish)

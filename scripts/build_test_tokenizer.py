"""Builds the project's small test tokenizer into service/assets/tokenizer/.

A byte-level BPE (every byte is a token, so any text and any non-canonical split of it can be
encoded) trained on Python's own standard-library sources, with Qwen2.5's special tokens and a
ChatML tool-calling chat template in the Qwen2.5 format. The output is committed; this script
records how it was made: `python scripts/build_test_tokenizer.py`.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

OUT_DIR = Path(__file__).resolve().parents[1] / "service" / "assets" / "tokenizer"
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5 has these as added (non-special) tokens: they survive skip_special_tokens.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CORPUS_PACKAGES = ["json", "email", "http", "asyncio", "unittest", "logging", "collections"]

CHAT_TEMPLATE = (Path(__file__).resolve().parent / "chatml_tools.jinja").read_text()


def corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for package in CORPUS_PACKAGES:
        for path in sorted((stdlib / package).rglob("*.py")):
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts


def main() -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    tokenizer.add_tokens(ADDED_TOKENS)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
    )
    fast.chat_template = CHAT_TEMPLATE
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(OUT_DIR))
    # A class name that transformers 4.x and 5.x both load.
    config_path = OUT_DIR / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (OUT_DIR / "README.md").write_text(
        "Small byte-level BPE test tokenizer with a ChatML tool-calling template (Qwen2.5 format).\n"
        "Built by scripts/build_test_tokenizer.py; not a model's tokenizer.\n"
    )
    print(json.dumps({"vocab_size": fast.vocab_size + len(ADDED_TOKENS), "out": str(OUT_DIR)}))


if __name__ == "__main__":
    main()

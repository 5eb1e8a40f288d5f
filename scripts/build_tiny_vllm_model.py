"""Builds a tiny random-weight Qwen3-architecture model for the real-vLLM tests (no model hub).

Usage: python scripts/build_tiny_vllm_model.py TOKENIZER_DIR OUT_DIR   (run with the vLLM venv's Python)

The weights are random (fixed seed), float32, with two changes so that generations are readable,
end by themselves within a few dozen tokens and meet stop strings, while the per-token distribution
stays spread (logits of standard deviation LOGIT_STD over a few dozen tokens) so that logprobs are a
meaningful check: hidden dimension 0 holds a constant (every embedding has it, no layer writes it),
and the output head reads it to push every other token LOGIT_FLOOR below and the end-of-turn token
EOS_BOOST above.
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

SEED = 29
HIDDEN = 128
LOGIT_STD = 3.0
LOGIT_FLOOR = 20.0
EOS_BOOST = 3.0
VOCAB_TEXT = (
    "the a an of to and is in it you that was for on are with as I his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how said "
    "Hello world yes no maybe 0 1 2 3 4 5 6 7 8 9 . , ! ? : ;\n"
)


def main(tokenizer_dir: Path, out: Path) -> None:
    torch.manual_seed(SEED)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    vocab_size = (len(tokenizer) + 63) // 64 * 64
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad_id = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    favoured = sorted(set(tokenizer.encode(VOCAB_TEXT, add_special_tokens=False)) | {eos_id})
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, 0] = embed[:, 1:].std()  # the constant: after the final norm, about 1
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
        head = model.lm_head.weight
        head.zero_()
        head[:, 0] = -LOGIT_FLOOR
        rows = torch.randn(len(favoured), HIDDEN) * (LOGIT_STD / HIDDEN**0.5)
        rows[:, 0] = 0.0
        head[torch.tensor(favoured)] = rows
        head[eos_id, 0] = EOS_BOOST
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, out / name)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "pad_token_id": pad_id}, indent=2) + "\n"
    )
    print(f"{out}: vocab {vocab_size}, {len(favoured)} favoured tokens, eos {eos_id}", file=sys.stderr)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))

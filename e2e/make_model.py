"""Generate a random-weight Llama-style model that real vLLM can serve: `make_model.py DIR [SHAPE]`.

Runs inside `.venv-e2e` (it needs torch, transformers and tokenizers, which vLLM brings).
No hub, no download: the tokenizer is a byte-level BPE trained here on the Python standard
library's own source files, the weights are random with a fixed seed. What it says is
noise; what matters is that vLLM loads it, schedules it and counts its steps like any model.

Two shapes, both with head size 64 (a size the CPU backend's attention kernels take) and
the same 2,048-entry vocabulary and tokenizer:

- ``tiny`` (the default): 2 layers, hidden 256, 2,048 positions, about 2.4 M parameters
  (~5 MB). Its steps take milliseconds, as a GPU engine's do.
- ``slow``: big enough that one step of a long prompt takes tens of seconds on a CPU core
  (see SHAPES), for the slow-engine scenario of ``test_longsteps.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE = 2048
MAX_POSITIONS = 2048
# LlamaConfig arguments per shape, besides the vocabulary and special tokens.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITIONS,
    },
    "slow": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
    },
}
TRAINING_FILES = 400
SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
# A minimal chat template: vLLM's /v1/chat/completions refuses a tokenizer without one.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def training_text() -> list[str]:
    """Local text only: the first few hundred stdlib modules, in a fixed order."""
    stdlib = Path(os.__file__).resolve().parent
    files = sorted(stdlib.glob("*.py"))[:TRAINING_FILES]
    return [path.read_text(encoding="utf-8", errors="replace") for path in files]


def build_tokenizer(out: Path, max_positions: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        model_max_length=max_positions,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_model(out: Path, tokenizer: PreTrainedTokenizerFast, shape: dict[str, int]) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        **shape,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write the model into")
    parser.add_argument("shape", nargs="?", choices=sorted(SHAPES), default="tiny")
    args = parser.parse_args()
    out: Path = args.out
    shape = SHAPES[args.shape]
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, shape["max_position_embeddings"])
    build_model(out, tokenizer, shape)
    size = sum(path.stat().st_size for path in out.iterdir() if path.is_file())
    print(f"model written to {out} ({size / 1e6:.1f} MB, vocab {len(tokenizer)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Generate a tiny random-weight Llama-style model that real vLLM can serve: `make_model.py DIR`.

Runs inside `.venv-e2e` (it needs torch, transformers and tokenizers, which vLLM brings).
No hub, no download: the tokenizer is a byte-level BPE trained here on the Python standard
library's own source files, the weights are random with a fixed seed. What it says is
noise; what matters is that vLLM loads it, schedules it and counts its steps like any model.

The shape is chosen for the CPU backend: head size 64 (a size its attention kernels take),
2 layers, a 2,048-entry vocabulary and 2,048 positions, about 2.4 M parameters (~5 MB).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE = 2048
MAX_POSITIONS = 2048
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


def build_tokenizer(out: Path) -> PreTrainedTokenizerFast:
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
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_model(out: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: make_model.py DIR", file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    build_model(out, tokenizer)
    size = sum(path.stat().st_size for path in out.iterdir() if path.is_file())
    print(f"model written to {out} ({size / 1e6:.1f} MB, vocab {len(tokenizer)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

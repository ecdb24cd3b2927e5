"""A tiny chat model for CLI tests: tiny-llama with random weights, a byte-level tokenizer
(no merges: 3 special tokens, then the 256 byte symbols) and a plain chat template."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import transformers
from kvtier.engine.config import named_config
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def save_byte_tokenizer(directory: Path) -> transformers.PreTrainedTokenizerFast:
    """Write the byte-level tokenizer with CHAT_TEMPLATE into `directory`."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return tokenizer


def save_chat_model(directory: Path) -> Path:
    """tiny-llama (seed 0) sized to the byte tokenizer, saved as a Hugging Face directory."""
    tokenizer = save_byte_tokenizer(directory)
    config = dataclasses.replace(named_config("tiny-llama"), vocab_size=len(tokenizer))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config.to_hf(), dtype=torch.float32) \
        .save_pretrained(directory)
    return directory

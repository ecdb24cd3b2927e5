"""Prompts as callers give them: text, token ids, vLLM's mappings, and chat conversations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Prompt = str | Sequence[int]
#: One chat: a list of {"role": "system" | "user" | "assistant", "content": str} messages.
Conversation = Sequence[Mapping[str, Any]]


def as_prompt_list(prompts: Any) -> list[Prompt]:
    """One prompt or a list of them (text, token ids, or vLLM's mappings) as a list of
    prompts. Raises ValueError for an empty list or a mapping without a prompt."""
    if isinstance(prompts, (str, Mapping)):
        prompts = [prompts]
    items = list(prompts)
    if not items:
        raise ValueError("no prompts given")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # one prompt given as token ids
    return [prompt_of(item) for item in items]


def prompt_of(item: Any) -> Prompt:
    """A prompt given as text, token ids, or vLLM's {"prompt": ...} /
    {"prompt_token_ids": ...} mapping."""
    if not isinstance(item, Mapping):
        return item
    if "prompt_token_ids" in item:
        return list(item["prompt_token_ids"])
    if isinstance(item.get("prompt"), str):
        return item["prompt"]
    raise ValueError(f"a prompt mapping needs 'prompt' (text) or 'prompt_token_ids'; got "
                     f"keys {sorted(item)}")


def render_chat(tokenizer: Any, messages: Conversation, model_id: str) -> str:
    """The text of `messages` through `tokenizer`'s chat template, ending with the prompt
    for the assistant's turn. Raises ValueError for an empty or malformed conversation, or
    a tokenizer without a chat template (naming `model_id`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {model_id} has no chat template; use generate() with a raw "
                         "prompt")
    if isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("a conversation is a non-empty list of {'role': ..., "
                         "'content': ...} messages")
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError("each chat message must be a mapping with a string 'role' "
                             f"and a string 'content'; got {message!r}")
    return tokenizer.apply_chat_template([dict(m) for m in messages],
                                         add_generation_prompt=True, tokenize=False)

"""The OpenAI API's request bodies (the fields kvtier serves) and its error body.

Unknown fields are ignored, as OpenAI-compatible servers do, so clients that send extra
options still work. Fields kvtier cannot honour with a non-default value (n > 1, logprobs,
penalties, echo) are refused with a 400 that names them, never silently ignored. vLLM's
extensions that matter for KV caching are accepted: `cache_salt`, `top_k`,
`stop_token_ids`, `ignore_eos`, `return_token_ids`.
"""

from __future__ import annotations

from typing import Any, Literal

from kvtier.engine.sampler import SamplingParams
from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error answered with an OpenAI-style JSON body and an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = -1
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    cache_salt: str | None = None
    return_token_ids: bool = False
    user: str | None = None

    def check_supported(self) -> None:
        """Raise APIError(400) for an option kvtier does not serve."""
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported; kvtier serves n=1 (send the "
                           "request several times with different seeds instead)", param="n")
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported by kvtier serve", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise APIError(400, f"{name} is not supported by kvtier serve; leave it 0",
                               param=name)
        if self.cache_salt is not None and not self.cache_salt:
            raise APIError(400, "cache_salt must be a non-empty string", param="cache_salt")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams; APIError(400) for a value out of range."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                max_tokens=self.max_tokens if self.max_tokens is not None
                else default_max_tokens,
                temperature=self.temperature, top_p=self.top_p,
                top_k=max(self.top_k, 0), seed=self.seed,
                stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
                stop=tuple(s for s in stop if s))
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions: one prompt, as text or as token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported by kvtier serve", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by kvtier serve", param="suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request; APIError(400) for a batch or an empty one."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"{len(prompt)} prompts in one request; kvtier serve takes "
                               "one prompt per request", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text (the text parts of a multi-part content)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(400, f"message content of type {part.get('type')!r} is not "
                               "supported; send text", param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def chat_messages(self) -> list[dict[str, str]]:
        """Plain role/content dicts for the chat template."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)

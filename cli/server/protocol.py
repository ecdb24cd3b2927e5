"""The OpenAI API's request bodies (the fields kvtier serves), its error body, and the
limits that bound what one request may ask of the server.

Every field of OpenAI's and vLLM's request bodies is either honoured or, when set to
anything but its default, refused with a 400 that names it (`REFUSED_FIELDS`); fields
neither API knows are ignored, as OpenAI-compatible servers do. Honoured: the sampling
fields the engine has (temperature, top_p, top_k, min_p, repetition / presence / frequency
penalties, seed, stop, stop_token_ids, ignore_eos, max_tokens), `n`, `logprobs` (and
`top_logprobs` in chat), streaming with usage, and vLLM's `cache_salt` and
`return_token_ids`.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any, Literal

from kvtier.engine.sampler import SamplingParams
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtier.validation import ConfigError


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


#: Seconds `kvtier serve` and `kvtier router` keep an idle connection open, and (well
#: below it) how long their own clients reuse one. A client that reuses a connection the
#: server is closing at that moment sees it reset; uvicorn's default (5 s) equals httpx's,
#: which made that race common between bursts of handoffs.
SERVER_KEEPALIVE_S = 30.0
CLIENT_KEEPALIVE_S = 10.0


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one request may ask of the server; beyond a limit it gets a 400 (413 for the
    body) naming the limit and its `kvtier serve` option.

    max_body_bytes: request body size. max_prompt_chars: characters of a text prompt, or of
    all messages of a chat together. max_messages: messages of a chat. max_stop: stop
    strings and stop token ids (each). max_stop_chars: characters of one stop string (the
    engine matches them after every token). max_n: completions per request. max_logprobs:
    most likely tokens returned per position. Prompt tokens are bounded by the model's
    context (`max_model_len`).
    """

    max_body_bytes: int = 8 * 2**20
    max_prompt_chars: int = 1_000_000
    max_messages: int = 4096
    max_stop: int = 16
    max_stop_chars: int = 1024
    max_n: int = 16
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 1:
                raise ValueError(f"the server limit {name} must be at least 1, got "
                                 f"{getattr(self, name)}")


def check_api_key(authorization: str, api_key: str | None) -> None:
    """Raise a 401 APIError unless `authorization` (the request's Authorization header) is
    "Bearer <api_key>"; nothing when no key is set. Compared in constant time."""
    if api_key is None:
        return
    if not hmac.compare_digest(authorization.encode(), f"Bearer {api_key}".encode()):
        raise APIError(401, "invalid or missing API key; send 'Authorization: Bearer "
                       "<key>'", type_="authentication_error", code="invalid_api_key")


def limit_error(name: str, limit: int, what: str, param: str | None = None) -> APIError:
    option = "--" + name.replace("_", "-")
    return APIError(400, f"{what}; the server's limit {name} is {limit} (kvtier serve "
                    f"{option})", param=param, code="limit_exceeded")


#: Fields of OpenAI's or vLLM's request bodies that kvtier does not honour, with the values
#: that mean "not used" (accepted). Any other value is refused with a 400 naming the field.
REFUSED_FIELDS: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "prompt_logprobs": (None,),
    "min_tokens": (None, 0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,), "structured_outputs": (None,),
    "chat_template": (None,), "chat_template_kwargs": (None, {}),
    "continue_final_message": (None, False), "add_generation_prompt": (None, True),
    "documents": (None,), "mm_processor_kwargs": (None,),
    "priority": (None, 0),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,),
    "logits_processors": (None,), "vllm_xargs": (None,), "kv_transfer_params": (None,),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


_Stop = str | list[str] | None


class _GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: _Stop = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    return_token_ids: bool = False
    user: str | None = None
    request_id: str | None = None

    def check_supported(self, limits: ServerLimits) -> None:
        """Raise APIError(400) for an option kvtier does not serve or a limit exceeded."""
        fields = {**self.__dict__, **(self.model_extra or {})}
        for name, accepted in REFUSED_FIELDS.items():
            if name in fields and not any(fields[name] == value and
                                          type(fields[name]) is type(value) or
                                          fields[name] is value for value in accepted):
                raise APIError(400, f"{name} is not supported by kvtier serve; leave it out",
                               param=name)
        if self.n is not None and self.n > limits.max_n:
            raise limit_error("max_n", limits.max_n, f"n={self.n} completions asked", "n")
        stops = self.stop_strings()
        if len(stops) > limits.max_stop or len(self.stop_token_ids or ()) > limits.max_stop:
            raise limit_error("max_stop", limits.max_stop, "too many stop strings or stop "
                              "token ids", "stop")
        for stop in stops:
            check_text(stop, "stop")
            if len(stop) > limits.max_stop_chars:
                raise limit_error("max_stop_chars", limits.max_stop_chars,
                                  f"a stop string of {len(stop)} characters", "stop")
        if self.cache_salt is not None:
            if not self.cache_salt:
                raise APIError(400, "cache_salt must be a non-empty string", param="cache_salt")
            check_text(self.cache_salt, "cache_salt")

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def num_logprobs(self) -> int | None:
        """How many most likely tokens to return per position (None: no logprobs)."""
        return None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams; APIError(400) naming the field for a value out of
        range."""
        given = {name: getattr(self, name) for name in (
            "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
            "presence_penalty", "frequency_penalty", "seed", "n")}
        values = {name: value for name, value in given.items() if value is not None}
        values.setdefault("temperature", 1.0)  # OpenAI's default, not the engine's greedy
        try:
            return SamplingParams(
                **values,
                max_tokens=self.max_tokens if self.max_tokens is not None
                else default_max_tokens,
                logprobs=self.num_logprobs(),
                stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                stop=tuple(s for s in self.stop_strings() if s))
        except ConfigError as exc:
            field = str(exc).split(":", 1)[0].removeprefix("SamplingParams.").split(".")[0]
            message = str(exc).replace("SamplingParams.", "")
            raise APIError(400, message, param=field if field in given or field in (
                "stop_token_ids", "stop", "max_tokens", "logprobs") else None) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def check_text(text: str, param: str) -> None:
    """APIError(400) for a string that is not valid Unicode text (a lone surrogate, which
    JSON's \\u escapes can carry but no encoder can write)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{param} contains an unpaired surrogate code point "
                       f"(U+{ord(text[exc.start]):04X} at character {exc.start}); send valid "
                       "Unicode text", param=param) from None


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions: one prompt, as text or as token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0)

    def check_supported(self, limits: ServerLimits) -> None:
        super().check_supported(limits)
        if self.logprobs is not None and self.logprobs > limits.max_logprobs:
            raise limit_error("max_logprobs", limits.max_logprobs,
                              f"logprobs={self.logprobs}", "logprobs")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self, limits: ServerLimits) -> str | list[int]:
        """The one prompt of the request; APIError(400) for a batch, an empty one, or one
        over the limits."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"{len(prompt)} prompts in one request; kvtier serve takes "
                               "one prompt per request", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        if isinstance(prompt, str):
            check_prompt_text(prompt, limits)
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text (the text parts of a multi-part content)."""
        if self.model_extra and self.model_extra.get("tool_calls"):
            raise APIError(400, "tool_calls in messages are not supported by kvtier serve",
                           param="messages")
        if self.content is None or isinstance(self.content, str):
            text = self.content or ""
        else:
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text", ""), str):
                    raise APIError(400, f"message content of type {part.get('type')!r} is "
                                   "not supported; send text", param="messages")
                parts.append(part.get("text", ""))
            text = "".join(parts)
        check_text(text, "messages")
        return text


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)

    def check_supported(self, limits: ServerLimits) -> None:
        super().check_supported(limits)
        if self.top_logprobs is not None and self.top_logprobs > limits.max_logprobs:
            raise limit_error("max_logprobs", limits.max_logprobs,
                              f"top_logprobs={self.top_logprobs}", "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self, limits: ServerLimits) -> list[dict[str, str]]:
        """Plain role/content dicts for the chat template."""
        return chat_messages(self.messages, limits)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)


def chat_messages(messages: list[ChatMessage], limits: ServerLimits) -> list[dict[str, str]]:
    """Plain role/content dicts for the chat template; APIError(400) for no message, or
    more characters than the limit."""
    if not messages:
        raise APIError(400, "messages must hold at least one message", param="messages")
    plain = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
             for m in messages]
    num_chars = sum(len(m["content"]) for m in plain)
    if num_chars > limits.max_prompt_chars:
        raise limit_error("max_prompt_chars", limits.max_prompt_chars,
                          f"messages of {num_chars} characters", "messages")
    return plain


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages through the template."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids back to text."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def parse_body(model: type[BaseModel], raw: Any, limits: ServerLimits) -> Any:
    """`raw` (decoded JSON) as `model`; APIError(400) naming each bad field."""
    if not isinstance(raw, dict):
        raise APIError(400, "the request body must be a JSON object")
    messages = raw.get("messages")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise limit_error("max_messages", limits.max_messages,
                          f"{len(messages)} messages", "messages")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:5])
        first = errors[0]["loc"][0] if errors and errors[0]["loc"] else None
        raise APIError(400, f"invalid request: {problems}",
                       param=str(first) if first is not None else None) from None


def check_prompt_text(prompt: str, limits: ServerLimits) -> None:
    """Raise APIError(400) for a text prompt that is not valid text or over the limit."""
    check_text(prompt, "prompt")
    if len(prompt) > limits.max_prompt_chars:
        raise limit_error("max_prompt_chars", limits.max_prompt_chars,
                          f"a prompt of {len(prompt)} characters", "prompt")

"""The OpenAI-compatible HTTP protocol's requests, pure: parsing and validation (the answers:
scheduler/serving/api_responses.py; the text of a stream: scheduler/serving/text_stream.py).

``parse_completion`` / ``parse_chat`` turn a raw body into a :class:`GenerationRequest` or raise
:class:`ApiError` (status, message naming the field, OpenAI error body). SmartExit request extras:
``mode`` (bounded | exact | full) and ``sla`` (ttft_ms, tpot_ms).

Chat prompt format (the model has no chat template): each message becomes ``"<Role>: <text>\\n\\n"``
with Role System (system and developer messages), User or Assistant, and the prompt ends with
``"Assistant:"``; generation stops at ``"\\nUser:"`` besides the request's own ``stop`` strings, and
the reply's leading whitespace is dropped.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from edge.runtime.settings import SLA_TPOT_MS, SLA_TTFT_MS

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "service_unavailable"}
CHAT_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
CHAT_STOP = "\nUser:"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
INT64 = 2 ** 63


class ApiError(Exception):
    """An HTTP error with an OpenAI error body; ``param`` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(max(1, round(self.retry_after_s)))}


def backend_error(err: dict[str, Any]) -> ApiError:
    """The HTTP error for a worker's error chunk (``triton_client.error_to_dict``)."""
    msg, retry = str(err.get("message", "")), err.get("retry_after_s")
    if err.get("kind") == "rejected":
        code = err.get("code")
        if code == "overloaded":
            return ApiError(429, f"the server is overloaded: {msg}", code="overloaded", retry_after_s=retry or 1.0)
        if code == "invalid_request":
            return ApiError(400, msg, param=err.get("field"), code="invalid_request")
        return ApiError(500, f"the engine failed: {msg}", code="internal")
    return ApiError(503, f"the model is unavailable: {msg}", code="unavailable", retry_after_s=retry or 1.0)


# -- requests ----------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # JSON types as sent; unknown keys ignored


class Sla(_Strict):
    ttft_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    tpot_ms: float | None = Field(None, gt=0, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None
    seed: int | None = Field(None, ge=0, lt=INT64)  # the engine seeds numpy's default_rng: non-negative
    n: int = 1
    user: str | None = None
    logprobs: Any = None
    mode: Literal["bounded", "exact", "full"] | None = None
    sla: Sla | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            if isinstance(v, list) and len(v) > 4:
                raise ValueError("at most 4 stop sequences")
            return v
        raise ValueError("must be a string, a list of strings or null")


class CompletionRequest(_Common):
    prompt: Any
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        if isinstance(v, list) and v and all(isinstance(t, (str, list)) for t in v):
            raise ValueError("batched prompts are not supported: send one string or one list of token ids")
        raise ValueError("must be a string or a list of token ids (integers)")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any  # a string, or text parts [{"type": "text", "text": ...}] joined into one
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> str:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in v):
            return "".join(p["text"] for p in v)
        raise ValueError('must be a string or a list of text parts {"type": "text", "text": "..."}')


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


@dataclass(frozen=True)
class Limits:
    """What the server accepts: its model, the token limits, the defaults for SmartExit extras."""
    model_name: str
    max_tokens_limit: int
    context_window: int
    vocab_size: int
    default_mode: str = "bounded"
    default_sla_ttft_ms: float = SLA_TTFT_MS.default  # the server's (ServeConfig's); these for a bare Limits
    default_sla_tpot_ms: float = SLA_TPOT_MS.default
    # the most characters of text one token stands for (ingress_input.max_token_chars): a text over
    # max_token_chars * context_window characters is refused before tokenizing it; None: no such check
    max_token_chars: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request, tokenized, as the worker needs it (``payload``) and the answer needs it."""
    kind: Literal["completion", "chat"]
    model: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    mode: str
    sla_ttft_ms: float
    sla_tpot_ms: float

    def payload(self, request_id: str, stop_ids: Sequence[int] = ()) -> dict[str, Any]:
        """The keyword arguments of ``TritonClient.generate`` (what ``Worker.generate`` takes)."""
        return {"request_id": request_id, "prompt_ids": list(self.prompt_ids), "max_tokens": self.max_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                "stop_ids": list(stop_ids), "mode": self.mode, "sla_ttft_ms": self.sla_ttft_ms,
                "sla_tpot_ms": self.sla_tpot_ms}


def decode_body(body: bytes) -> dict[str, Any]:
    """The JSON object in a request body.

    Raises:
        ApiError: 400 for non-UTF-8, malformed JSON (nested too deep included), a non-object, or a
            string that UTF-8 cannot encode (:func:`_check_utf8`).
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") \
            from None
    except RecursionError:
        raise ApiError(400, "request body is malformed: JSON nested too deeply") from None
    except ValueError as exc:  # e.g. an integer over Python's 4300-digit conversion limit
        raise ApiError(400, f"request body is malformed: {exc}") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(obj).__name__}")
    _check_utf8(obj)
    return obj


def _check_utf8(obj: dict[str, Any]) -> None:
    """Raises ApiError 400 naming the first string (key or value) UTF-8 cannot encode.

    JSON's ``\\ud800`` escapes decode to lone surrogates, which the tokenizer and the response's own
    encoding refuse; iterative, so a body as deep as ``json.loads`` allows cannot overflow the stack.
    """
    todo: list[tuple[str, Any]] = [("", obj)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                where = path or "request body"
                raise ApiError(400, f"{where}: not encodable as UTF-8 (lone surrogate U+{ord(value[exc.start]):04X} "
                               f"at character {exc.start})", param=path or None) from None
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, dict):
            for key, v in value.items():
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    raise ApiError(400, f"{path or 'request body'}: a key is not encodable as UTF-8 (lone "
                                   "surrogate)", param=path or None) from None
                todo.append((f"{path}.{key}" if path else key, v))


def _validate(model: type[_Strict], obj: dict[str, Any]) -> Any:
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".") or None
        why = "is required" if err["type"] == "missing" else err["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {why}" if param else why, param=param) from None


def _common(req: _Common, limits: Limits, prompt_ids: list[int], prompt_param: str, max_tokens: int | None,
            kind: Literal["completion", "chat"], extra_stop: tuple[str, ...] = ()) -> GenerationRequest:
    if req.n != 1:
        raise ApiError(400, f"n: only n=1 is supported, got {req.n}", param="n")
    if req.logprobs not in (None, False, 0):
        raise ApiError(400, "logprobs: not supported by this server", param="logprobs")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options")
    if not prompt_ids:
        raise ApiError(400, f"{prompt_param}: the prompt is empty (it must hold at least one token)",
                       param=prompt_param)
    bad = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ApiError(400, f"{prompt_param}: token id {bad[0]} is outside the vocabulary "
                       f"[0, {limits.vocab_size})", param=prompt_param)
    room = limits.context_window - len(prompt_ids)
    if max_tokens is None and kind == "chat":
        if room < 1:  # checked before the default below, which would be <= 0 and blamed on max_tokens
            raise ApiError(400, f"{prompt_param}: the prompt's {len(prompt_ids)} tokens plus at least 1 generated "
                           f"token exceed the context window of {limits.context_window} tokens; shorten the "
                           f"prompt", param=prompt_param, code="context_length_exceeded")
        max_tokens = min(limits.max_tokens_limit, room)
    elif max_tokens is None:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    if max_tokens <= 0:
        raise ApiError(400, f"max_tokens: must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens > limits.max_tokens_limit:
        raise ApiError(400, f"max_tokens: {max_tokens} is above this server's limit of "
                       f"{limits.max_tokens_limit}", param="max_tokens")
    if len(prompt_ids) + max_tokens > limits.context_window:
        raise ApiError(400, f"{prompt_param}: the prompt's {len(prompt_ids)} tokens plus max_tokens "
                       f"{max_tokens} exceed the context window of {limits.context_window} tokens; "
                       f"shorten the prompt or lower max_tokens", param=prompt_param,
                       code="context_length_exceeded")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    sla = req.sla or Sla()
    return GenerationRequest(
        kind=kind, model=req.model, prompt_ids=prompt_ids, max_tokens=max_tokens,
        temperature=req.temperature, top_p=req.top_p, seed=req.seed,
        stop=tuple(s for s in stop + extra_stop if s), stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        mode=req.mode or limits.default_mode,
        sla_ttft_ms=sla.ttft_ms if sla.ttft_ms is not None else limits.default_sla_ttft_ms,
        sla_tpot_ms=sla.tpot_ms if sla.tpot_ms is not None else limits.default_sla_tpot_ms)


def _check_chars(text: str, limits: Limits, param: str) -> None:
    """Raises ApiError 400 when ``text`` alone must overflow the context window, before tokenizing it:
    no token stands for more than ``limits.max_token_chars`` characters, so ``len(text) / max_token_chars``
    is a lower bound on its tokens (a huge prompt costs no tokenizer time)."""
    most = limits.max_token_chars
    if most is None or len(text) <= most * limits.context_window:
        return
    raise ApiError(400, f"{param}: the prompt's {len(text)} characters are at least "
                   f"{math.ceil(len(text) / most)} tokens (a lower bound: no token covers more than {most} "
                   f"characters), which exceed the context window of {limits.context_window} tokens; shorten "
                   f"the prompt", param=param, code="context_length_exceeded")


def _check_model(req: _Common, limits: Limits) -> None:
    if req.model != limits.model_name:
        raise ApiError(404, f"The model '{req.model}' does not exist; this server serves "
                       f"'{limits.model_name}'", param="model", code="model_not_found")


def parse_completion(body: bytes, limits: Limits, encode: Callable[[str], list[int]]) -> GenerationRequest:
    """``POST /v1/completions``: validate, tokenize, check the limits.

    Raises:
        ApiError: 400 (malformed body, a field's type or range, limits), 404 (unknown model).
    """
    req: CompletionRequest = _validate(CompletionRequest, decode_body(body))
    _check_model(req, limits)
    for param, bad in (("echo", req.echo), ("best_of", req.best_of not in (None, 1)), ("suffix", req.suffix)):
        if bad:
            raise ApiError(400, f"{param}: not supported by this server", param=param)
    if isinstance(req.prompt, str):
        _check_chars(req.prompt, limits, "prompt")
    ids = encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
    return _common(req, limits, ids, "prompt", req.max_tokens, "completion")


def chat_prompt(messages: Sequence[ChatMessage]) -> str:
    """The prompt text for a conversation (format in the module doc)."""
    return "".join(f"{CHAT_ROLES[m.role]}: {m.content}\n\n" for m in messages) + "Assistant:"


def parse_chat(body: bytes, limits: Limits, encode: Callable[[str], list[int]]) -> GenerationRequest:
    """``POST /v1/chat/completions``: validate, format (module doc), tokenize, check the limits.

    Raises:
        ApiError: as :func:`parse_completion`; the prompt's field is ``messages``.
    """
    req: ChatRequest = _validate(ChatRequest, decode_body(body))
    _check_model(req, limits)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    prompt = chat_prompt(req.messages)
    _check_chars(prompt, limits, "messages")
    return _common(req, limits, encode(prompt), "messages", max_tokens, "chat", (CHAT_STOP,))

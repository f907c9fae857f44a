"""The OpenAI-compatible HTTP protocol's answers, pure (the requests: scheduler/serving/api.py): response
bodies, stream chunks and their SSE framing, in the OpenAI shapes (``text_completion``, ``chat.completion``,
``chat.completion.chunk``); each choice may carry the SmartExit extension ``exit_layers`` (the layer each
token left at), which OpenAI clients ignore.
"""
from __future__ import annotations

import json
from typing import Any

# wire finish reasons -> OpenAI's; the wire reason rides along as `smartexit_finish_reason` if it differs
FINISH_REASONS = {"stop": "stop", "length": "length", "deadline": "length", "cancelled": "length"}
SSE_DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finish(choice: dict[str, Any], reason: str | None) -> dict[str, Any]:
    choice["finish_reason"] = None if reason is None else FINISH_REASONS.get(reason, reason)
    if reason is not None and choice["finish_reason"] != reason:
        choice["smartexit_finish_reason"] = reason
    return choice


def _envelope(obj: str, rid: str, created: int, model: str, choices: list, usage_: dict | None) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
            "system_fingerprint": None, "usage": usage_}


def completion_response(rid: str, created: int, model: str, text: str, finish_reason: str,
                        exit_layers: list[int], usage_: dict[str, int]) -> dict[str, Any]:
    choice = _finish({"index": 0, "text": text, "logprobs": None, "exit_layers": exit_layers}, finish_reason)
    return _envelope("text_completion", rid, created, model, [choice], usage_)


def chat_response(rid: str, created: int, model: str, text: str, finish_reason: str,
                  exit_layers: list[int], usage_: dict[str, int]) -> dict[str, Any]:
    choice = _finish({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "exit_layers": exit_layers}, finish_reason)
    return _envelope("chat.completion", rid, created, model, [choice], usage_)


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None = None,
                     exit_layers: list[int] | None = None) -> dict[str, Any]:
    choice = _finish({"index": 0, "text": text, "logprobs": None, "exit_layers": exit_layers or []},
                     finish_reason)
    return _envelope("text_completion", rid, created, model, [choice], None)


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, str], finish_reason: str | None = None,
               exit_layers: list[int] | None = None) -> dict[str, Any]:
    choice = _finish({"index": 0, "delta": delta, "logprobs": None, "exit_layers": exit_layers or []},
                     finish_reason)
    return _envelope("chat.completion.chunk", rid, created, model, [choice], None)


def usage_chunk(kind: str, rid: str, created: int, model: str, usage_: dict[str, int]) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, the request's usage."""
    return _envelope("chat.completion.chunk" if kind == "chat" else "text_completion", rid, created, model,
                     [], usage_)


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"

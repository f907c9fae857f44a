"""What the ingress does with a request before it is a generation: read its body within the size limit, parse
and tokenize it off the event loop when it is large, bound a prompt's tokens from its characters, and answer
Starlette's own errors (404, 405) in the API's error shape (docs/serving.md, Errors). Kept apart from
:mod:`scheduler.serving.app`, whose ``Ingress`` uses them."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from scheduler.serving import api

# a body up to this size parses on the event loop (~1 ms: tokenizing costs ~0.3 ms per KiB of prompt on
# one CPU core); a larger one in a thread, whose hop costs ~50 us
INLINE_PARSE_BYTES = 4096
STARLETTE_CODES = {404: "not_found", 405: "method_not_allowed"}


def max_token_chars(tok: Any) -> int | None:
    """The most characters of text one token of ``tok`` (a ``tokenizers.Tokenizer``) stands for
    (``api.Limits.max_token_chars``): its longest decoded token, special tokens included (they match in
    the text too). A token's decoding has at least one character per character it overlaps (a split
    one decodes to U+FFFD), so a text's characters are at most this times its tokens.

    None (no character pre-check) unless every character of a text lands in some token: a byte-level
    pre-tokenizer, all 256 bytes in the vocabulary, no normalizer (edge/model/tokenizer.py's); otherwise
    characters may vanish (a normalizer, a whitespace-splitting pre-tokenizer, a byte missing).
    """
    from tokenizers import pre_tokenizers

    if (tok.normalizer is not None or not isinstance(tok.pre_tokenizer, pre_tokenizers.ByteLevel)
            or any(tok.token_to_id(c) is None for c in pre_tokenizers.ByteLevel.alphabet())):
        return None
    decoded = tok.decode_batch([[i] for i in range(tok.get_vocab_size())], skip_special_tokens=False)
    return max(map(len, decoded))


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused past ``limit`` bytes: by its Content-Length before reading, else
    (a chunked body) as soon as the bytes read pass it, so an oversized body is never held whole.

    Raises:
        ApiError: 413 ``request_too_large``.
    """
    def too_large(size: str) -> api.ApiError:
        return api.ApiError(413, f"request body of {size} bytes is over this server's limit of {limit} bytes",
                            code="request_too_large")

    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(length)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(f"more than {limit}")
    return bytes(body)


async def parse_request(parse: Callable[..., api.GenerationRequest], body: bytes, limits: api.Limits,
                        tok: Any) -> api.GenerationRequest:
    """``parse(body, limits, encode)`` with ``tok``'s (a ``tokenizers.Tokenizer``) encoding; a body over
    ``INLINE_PARSE_BYTES`` in a worker thread, so that its decoding and tokenizing do not stall the other
    requests on this event loop.

    Raises:
        ApiError: as ``parse``.
    """
    if len(body) <= INLINE_PARSE_BYTES:
        return parse(body, limits, lambda s: tok.encode(s, add_special_tokens=False).ids)
    # encode holds the GIL throughout (the loop would wait anyway); encode_batch releases it, same ids
    return await asyncio.to_thread(parse, body, limits,
                                   lambda s: tok.encode_batch([s], add_special_tokens=False)[0].ids)


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (404 no such route, 405 wrong method) as OpenAI error bodies, their
    headers (405's ``Allow``) kept."""
    allow = (exc.headers or {}).get("Allow")
    msg = f"{exc.detail}: {request.method} {request.url.path}" + (f" (allowed: {allow})" if allow else "")
    err = api.ApiError(exc.status_code, msg, code=STARLETTE_CODES.get(exc.status_code))
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

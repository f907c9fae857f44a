"""Bad input at the front end (QA's reproductions): each gets an OpenAI-shaped 4xx naming the field, and
the ingress keeps answering: negative seeds, oversized bodies, prompts the character count alone puts
over the context, deep JSON, lone surrogates, chat's default max_tokens, Starlette's 404 / 405.

The ingress is driven without Ray: its ASGI app (404 / 405) and ``Ingress._serve`` on a bare instance."""
from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.requests import Request
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from edge.core.errors import ConfigError
from scheduler.serving import api
from scheduler.serving import ingress_input
from scheduler.serving.config import ServeConfig
from tests.unit.scheduler.serving.test_serve_api import LIMITS, TOK, body, chat, encode

pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince20")


@pytest.fixture(scope="module")
def app():
    from scheduler.serving import app  # imports ray
    return app


def api_error(parse, raw: bytes, limits: api.Limits = LIMITS, enc=encode) -> api.ApiError:
    with pytest.raises(api.ApiError) as info:
        parse(raw, limits, enc)
    return info.value


def refuse(text: str) -> list[int]:
    raise AssertionError(f"tokenized {len(text)} characters that the character check should have refused")


# -- 1. seed -------------------------------------------------------------------------------------------
def test_a_seed_outside_0_to_2_63_is_refused_by_name():
    for seed in (-5, -1, -2 ** 63, 2 ** 63):  # numpy's default_rng takes no negative seed
        err = api_error(api.parse_completion, body(prompt="def main(", max_tokens=4, seed=seed, temperature=0.8))
        assert (err.status, err.param) == (400, "seed") and err.message.startswith("seed:")
    for seed in (0, 2 ** 63 - 1):
        assert api.parse_completion(body(prompt="x", seed=seed), LIMITS, encode).seed == seed


# -- 2a. body size ---------------------------------------------------------------------------------------
def test_max_body_bytes_is_a_checked_setting():
    assert ServeConfig().max_body_bytes == 8 * 1024 * 1024
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match=r"serve\.max_body_bytes"):
            ServeConfig(max_body_bytes=bad)


def request(raw: bytes, headers: dict[str, str] | None = None, chunk: int | None = None,
            method: str = "POST", path: str = "/v1/completions") -> tuple[dict, object, list[int]]:
    """An ASGI scope and receive callable sending ``raw`` in chunks; ``reads`` counts the bytes taken."""
    headers = {"content-length": str(len(raw))} if headers is None else headers
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "server": ("testserver", 80), "client": ("127.0.0.1", 1),
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    size = chunk or max(len(raw), 1)
    parts = [raw[i:i + size] for i in range(0, len(raw), size)] or [b""]
    reads = []

    async def receive():
        part = parts.pop(0) if parts else b""
        reads.append(len(part))
        return {"type": "http.request", "body": part, "more_body": bool(parts)}
    return scope, receive, reads


def test_a_body_over_the_limit_is_413_before_it_is_read(app):
    scope, receive, reads = request(b"x" * 101)
    with pytest.raises(api.ApiError) as info:
        asyncio.run(ingress_input.read_body(Request(scope, receive), 100))
    assert (info.value.status, info.value.code) == (413, "request_too_large") and reads == []
    assert "101 bytes" in info.value.message and "limit of 100 bytes" in info.value.message
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_a_chunked_body_is_cut_off_once_past_the_limit(app):
    scope, receive, reads = request(b"x" * 1000, headers={}, chunk=30)  # no Content-Length
    with pytest.raises(api.ApiError, match="more than 100 bytes") as info:
        asyncio.run(ingress_input.read_body(Request(scope, receive), 100))
    assert info.value.status == 413 and sum(reads) == 120  # 4 chunks of 30, not the whole 1000
    for headers in ({}, None):  # at the limit, with or without Content-Length: read whole
        scope, receive, _ = request(b"y" * 100, headers=headers, chunk=30)
        assert asyncio.run(ingress_input.read_body(Request(scope, receive), 100)) == b"y" * 100


def bare_ingress(app, **cfg):
    """An Ingress without Ray: what ``_serve`` reads before it opens a stream; capacity 0, so a request
    that passes every check is answered 429."""
    from scheduler.serving.metrics import ServeMetrics
    cls = next(c for c in app.Ingress.func_or_class.__mro__ if "_serve" in vars(c))  # the class as written
    ing = object.__new__(cls)
    ing._cfg, ing._limits, ing._tok = ServeConfig(**cfg), LIMITS, TOK
    ing._metrics, ing._inflight, ing._capacity = ServeMetrics([3, 6], 12), 0, 0
    return ing


def serve(ing, raw: bytes, headers: dict[str, str] | None = None, chunk: int | None = None):
    scope, receive, reads = request(raw, headers, chunk)
    resp = asyncio.run(ing._serve(Request(scope, receive), api.parse_completion))
    return resp.status_code, json.loads(resp.body), reads


def test_the_ingress_answers_413_for_a_big_body_and_goes_on_answering(app):
    ing = bare_ingress(app, max_body_bytes=1000)
    status, out, reads = serve(ing, body(prompt="x" * 2000))
    assert (status, out["error"]["code"]) == (413, "request_too_large") and reads == []
    status, out, _ = serve(ing, body(prompt="x" * 2000), headers={}, chunk=256)
    assert (status, out["error"]["code"]) == (413, "request_too_large")
    status, out, _ = serve(ing, body(prompt="def main(", max_tokens=4))
    assert (status, out["error"]["code"]) == (429, "too_many_requests")  # parsed: only the capacity is left


# -- 2b. the character pre-check ----------------------------------------------------------------------------
def test_max_token_chars_bounds_the_characters_of_every_token(app):
    most = ingress_input.max_token_chars(TOK)
    longest = max(len(TOK.decode([i], skip_special_tokens=False)) for i in range(TOK.get_vocab_size()))
    assert most == longest and most >= len(app.EOS)


@settings(max_examples=80, deadline=None)
@given(st.text(max_size=200) | st.text(alphabet=" \n\tabcdef(){}<|>endoftx", max_size=400))
def test_no_text_has_more_characters_than_max_token_chars_times_its_tokens(app, text):
    assert len(text) <= ingress_input.max_token_chars(TOK) * len(encode(text))


def test_no_bound_for_a_tokenizer_that_may_drop_characters(app):
    normalized = Tokenizer.from_str(TOK.to_str())
    normalized.normalizer = normalizers.Strip()
    words = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()  # " " * 10**6 is no token at all
    assert ingress_input.max_token_chars(normalized) is None and ingress_input.max_token_chars(words) is None


CHARS = api.Limits("smartexit-tiny", max_tokens_limit=32, context_window=64, vocab_size=TOK.get_vocab_size(),
                   max_token_chars=4)


def test_a_prompt_whose_characters_overflow_the_context_is_refused_untokenized():
    err = api_error(api.parse_completion, body(prompt="x" * (4 * 64 + 1)), CHARS, refuse)
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")
    assert "257 characters are at least 65 tokens (a lower bound" in err.message
    assert "context window of 64 tokens" in err.message
    msgs = [{"role": "user", "content": "x" * 200}, {"role": "user", "content": [{"type": "text", "text": "y" * 60}]}]
    err = api_error(api.parse_chat, body(messages=msgs), CHARS, refuse)
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")
    text = "x" * (4 * 64)  # at the bound: tokenized, the token count decides as before
    err = api_error(api.parse_completion, body(prompt=text), CHARS)
    assert f"prompt's {len(encode(text))} tokens plus max_tokens 16" in err.message
    req = api.parse_completion(body(prompt="Hello world"), CHARS, encode)
    assert req == api.parse_completion(body(prompt="Hello world"), LIMITS, encode)


# -- 2c. tokenizing off the event loop -----------------------------------------------------------------------
BIG = api.Limits("smartexit-tiny", max_tokens_limit=32, context_window=10 ** 6, vocab_size=TOK.get_vocab_size())


def test_a_long_prompt_is_tokenized_while_the_loop_keeps_running(app):
    text = "def main(x):\n    return x + 1\n" * 8000  # ~250 KB: ~0.1 s of tokenizing

    async def main():
        ticks, t = [], [0.0, 0.0]

        async def ticker():
            while True:
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.001)
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.005)
        t[0] = time.perf_counter()
        req = await ingress_input.parse_request(api.parse_completion, body(prompt=text, max_tokens=4), BIG, TOK)
        t[1] = time.perf_counter()
        task.cancel()
        return req, sum(t[0] < x < t[1] for x in ticks), t[1] - t[0]

    req, ticks, took = asyncio.run(main())
    assert req.prompt_ids == encode(text)
    assert ticks >= 10, f"the event loop ran {ticks} times in the {took:.3f} s of tokenizing"


def test_a_small_body_is_parsed_on_the_loop_and_a_large_one_in_a_thread(app):
    seen = []

    def parse(raw, limits, enc):
        seen.append(threading.current_thread() is threading.main_thread())
        return api.parse_completion(raw, limits, enc)

    small, large = body(prompt="Hello world"), body(prompt="Hello world " * 500)
    assert len(small) <= ingress_input.INLINE_PARSE_BYTES < len(large)
    for raw in (small, large):
        assert asyncio.run(ingress_input.parse_request(parse, raw, BIG, TOK)) == api.parse_completion(raw, BIG, encode)
    assert seen == [True, False]


# -- 3. malformed bodies ----------------------------------------------------------------------------------
@pytest.mark.parametrize("raw,words", [
    (b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}", "nested too deeply"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"model": "smartexit-tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "malformed"),
])
def test_bodies_json_cannot_decode_are_400_not_500(raw, words):
    for parse in (api.parse_completion, api.parse_chat):
        err = api_error(parse, raw)
        assert (err.status, err.param) == (400, None) and "request body" in err.message and words in err.message


def test_the_ingress_answers_deep_json_with_a_json_400(app):
    status, out, _ = serve(bare_ingress(app), b'{"a": ' + b"[" * 2500 + b"]" * 2500 + b"}")
    assert status == 400 and "nested too deeply" in out["error"]["message"]


# -- 4. lone surrogates --------------------------------------------------------------------------------------
@pytest.mark.parametrize("parse,raw,param", [
    (api.parse_completion, body(prompt="\ud800"), "prompt"),
    (api.parse_completion, body(prompt="\udfff x"), "prompt"),
    (api.parse_completion, body(prompt="x", stop="\ud800"), "stop"),
    (api.parse_completion, body(prompt="x", stop=["ok", "a\udfff"]), "stop[1]"),
    (api.parse_completion, json.dumps({"model": "\ud800", "prompt": "x"}).encode(), "model"),
    (api.parse_chat, body(messages=[{"role": "user", "content": "\ud800"}]), "messages[0].content"),
    (api.parse_chat, body(messages=[{"role": "user", "content": "hi"}, {"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": "\udbff"}]}]), "messages[1].content[1].text"),
    (api.parse_chat, chat(stop=["\ud800"]), "stop[0]"),
    (api.parse_chat, chat(**{"\ud800": 1}), None),  # an (ignored) key
])
def test_strings_utf8_cannot_encode_are_refused_by_field(parse, raw, param):
    assert b"\\ud" in raw.lower()  # sent as JSON escapes, as a client would
    err = api_error(parse, raw)
    assert (err.status, err.param) == (400, param) and "not encodable as UTF-8" in err.message
    assert err.message.startswith(param or "request body")
    json.dumps(err.body(), ensure_ascii=False).encode("utf-8")  # the answer itself can be sent


def test_a_surrogate_pair_is_a_character_and_half_of_one_an_error():
    req = api.parse_completion(body(prompt="a \ud83d\ude00"), LIMITS, encode)  # json escapes the pair
    assert req.prompt_ids == encode("a 😀")
    err = api_error(api.parse_completion, body(prompt="a \ud83d"))
    assert (err.param, err.message) == ("prompt", "prompt: not encodable as UTF-8 (lone surrogate U+D83D at "
                                                  "character 2)")


# -- 5. chat's default max_tokens --------------------------------------------------------------------------
def test_a_chat_prompt_filling_the_context_is_a_context_error_not_a_max_tokens_one():
    limits = api.Limits("smartexit-tiny", max_tokens_limit=256, context_window=512, vocab_size=TOK.get_vocab_size())
    err = api_error(api.parse_chat, body(messages=[{"role": "user", "content": " a" * 505}]), limits)
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")
    assert "exceed the context window of 512 tokens" in err.message and "max_tokens" not in err.message


def test_chat_default_max_tokens_at_the_context_edge():
    def messages(n):
        return body(messages=[{"role": "user", "content": " a" * n}])
    n = next(n for n in range(1, 64) if len(encode(api.chat_prompt([api.ChatMessage(
        role="user", content=" a" * n)]))) == LIMITS.context_window - 1)
    assert api.parse_chat(messages(n), LIMITS, encode).max_tokens == 1  # one token of room: answered
    err = api_error(api.parse_chat, messages(n + 1))  # none left
    assert (err.param, err.code) == ("messages", "context_length_exceeded")


# -- 6. Starlette's own errors ------------------------------------------------------------------------------
def served_app(app):
    """The copy of ``fastapi_app`` that ``@serve.ingress`` froze when ``Ingress`` was defined: what the
    replicas serve (a handler added to ``fastapi_app`` after the class would be missing here)."""
    return inspect.getclosurevars(app.Ingress.func_or_class.__init__).nonlocals["frozen_app_or_func"]


def call(asgi, method: str, path: str) -> tuple[int, dict[str, str], dict]:
    scope, receive, _ = request(b"", method=method, path=path)
    sent = []

    async def send(msg):
        sent.append(msg)
    asyncio.run(asgi(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


@pytest.mark.parametrize("method,path,status,code", [
    ("GET", "/v1/completions", 405, "method_not_allowed"),
    ("PUT", "/v1/chat/completions", 405, "method_not_allowed"),
    ("POST", "/v1/models", 405, "method_not_allowed"),
    ("GET", "/v1/nothing", 404, "not_found"),
    ("POST", "/", 404, "not_found"),
])
def test_unknown_routes_and_methods_get_openai_error_bodies(app, method, path, status, code):
    for asgi in (served_app(app), app.fastapi_app):
        got, headers, out = call(asgi, method, path)
        assert got == status and headers["content-type"] == "application/json"
        assert set(out) == {"error"} and out["error"]["code"] == code
        assert out["error"]["type"] == "invalid_request_error" and f"{method} {path}" in out["error"]["message"]
        if status == 405:
            assert headers["allow"] == ("GET" if path == "/v1/models" else "POST")
            assert f"allowed: {headers['allow']}" in out["error"]["message"]

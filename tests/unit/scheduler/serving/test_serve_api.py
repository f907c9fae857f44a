"""The OpenAI protocol of the front end: every bad input's status and field, response shapes checked
with the ``openai`` package's own types, SSE framing, incremental detokenization on the bundled
tokenizer, and the ingress glue (worker chunks -> answers, control tick) with fakes."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tokenizers import Tokenizer

from edge.core.errors import ConfigError
from scheduler.serving import api, api_responses, text_stream
from scheduler.serving.config import BundleInfo, ServeConfig

# ray.serve's own pydantic models warn on import; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince20")
TOKENIZER = Path(__file__).parents[4] / "edge" / "assets" / "tiny" / "tokenizer.json"
TOK = Tokenizer.from_file(str(TOKENIZER))
LIMITS = api.Limits("smartexit-tiny", max_tokens_limit=32, context_window=64, vocab_size=TOK.get_vocab_size())


def encode(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False).ids


def decode(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=True)


def body(**fields) -> bytes:
    return json.dumps({"model": "smartexit-tiny", **fields}).encode()


def completion_error(raw: bytes) -> api.ApiError:
    with pytest.raises(api.ApiError) as info:
        api.parse_completion(raw, LIMITS, encode)
    return info.value


LONG = " ".join(["word"] * 80)  # well over 64 tokens

BAD_COMPLETIONS = [  # (body, status, param, words the message must hold)
    (b"\xff\xfe{}", 400, None, "UTF-8"),
    (b'{"model": "smartexit-tiny", "prompt": ', 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    (json.dumps({"prompt": "hi"}).encode(), 400, "model", "model: is required"),
    (body(), 400, "prompt", "prompt: is required"),
    (body(prompt=5), 400, "prompt", "string or a list of token ids"),
    (body(prompt=["a", "b"]), 400, "prompt", "batched prompts"),
    (body(prompt=[1, "x"]), 400, "prompt", "list of token ids"),
    (body(prompt=""), 400, "prompt", "empty"),
    (body(prompt=[1, 999999]), 400, "prompt", "999999 is outside the vocabulary"),
    (body(prompt="hi", max_tokens="8"), 400, "max_tokens", "valid integer"),
    (body(prompt="hi", max_tokens=2.5), 400, "max_tokens", "valid integer"),
    (body(prompt="hi", max_tokens=True), 400, "max_tokens", "valid integer"),
    (body(prompt="hi", max_tokens=0), 400, "max_tokens", "at least 1"),
    (body(prompt="hi", max_tokens=-3), 400, "max_tokens", "at least 1"),
    (body(prompt="hi", max_tokens=33), 400, "max_tokens", "limit of 32"),
    (body(prompt=LONG, max_tokens=8), 400, "prompt", "max_tokens 8 exceed the context window of 64"),
    (body(prompt=list(range(1, 60)), max_tokens=8), 400, "prompt", "59 tokens"),
    (body(prompt="hi", temperature=2.5), 400, "temperature", "less than or equal to 2"),
    (body(prompt="hi", temperature="hot"), 400, "temperature", "valid number"),
    (body(prompt="hi", top_p=0), 400, "top_p", "greater than 0"),
    (body(prompt="hi", stream="yes"), 400, "stream", "valid boolean"),
    (body(prompt="hi", stop=5), 400, "stop", "string, a list of strings"),
    (body(prompt="hi", stop=["a", "b", "c", "d", "e"]), 400, "stop", "at most 4"),
    (body(prompt="hi", seed=2 ** 63), 400, "seed", "less than"),
    (body(prompt="hi", n=2), 400, "n", "only n=1"),
    (body(prompt="hi", logprobs=5), 400, "logprobs", "not supported"),
    (body(prompt="hi", echo=True), 400, "echo", "not supported"),
    (body(prompt="hi", best_of=3), 400, "best_of", "not supported"),
    (body(prompt="hi", stream_options={"include_usage": True}), 400, "stream_options", "stream is true"),
    (body(prompt="hi", mode="turbo"), 400, "mode", "'bounded', 'exact' or 'full'"),
    (body(prompt="hi", sla={"ttft_ms": -1}), 400, "sla.ttft_ms", "greater than 0"),
    (body(prompt="hi", sla={"tpot_ms": "fast"}), 400, "sla.tpot_ms", "valid number"),
    (body(prompt="hi", sla=[1]), 400, "sla", "sla:"),
    (json.dumps({"model": "gpt-4", "prompt": "hi"}).encode(), 404, "model", "'gpt-4' does not exist"),
]


@pytest.mark.parametrize("raw,status,param,words", BAD_COMPLETIONS)
def test_bad_completion_requests_name_the_field(raw, status, param, words):
    err = completion_error(raw)
    assert (err.status, err.param) == (status, param)
    assert words in err.message
    if param:
        assert param.split(".")[0] in err.message
    out = err.body()["error"]
    assert set(out) == {"message", "type", "param", "code"} and out["param"] == param
    assert out["type"] == "invalid_request_error"


def test_unknown_model_is_openai_model_not_found():
    err = completion_error(json.dumps({"model": "gpt-4", "prompt": "hi"}).encode())
    assert err.body()["error"]["code"] == "model_not_found" and "smartexit-tiny" in err.message


def chat(**fields) -> bytes:
    return body(**{"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("raw,param,words", [
    (body(), "messages", "messages: is required"),
    (body(messages=[]), "messages", "at least 1 item"),
    (body(messages="hi"), "messages", "valid list"),
    (body(messages=[{"role": "robot", "content": "x"}]), "messages[0].role", "'system', 'developer', 'user'"),
    (body(messages=[{"role": "user"}]), "messages[0].content", "is required"),
    (body(messages=[{"role": "user", "content": 5}]), "messages[0].content", "a string or a list of text parts"),
    (body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content", "a string or a list of text parts"),
    (body(messages=[{"role": "user", "content": LONG}], max_tokens=8), "messages", "exceed the context window"),
    (chat(max_completion_tokens=0), "max_tokens", "at least 1"),
    (chat(n=3), "n", "only n=1"),
])
def test_bad_chat_requests_name_the_field(raw, param, words):
    with pytest.raises(api.ApiError) as info:
        api.parse_chat(raw, LIMITS, encode)
    assert (info.value.status, info.value.param) == (400, param)
    assert words in info.value.message


def test_a_good_completion_gets_openai_defaults_and_the_server_defaults():
    req = api.parse_completion(body(prompt="Hello world"), LIMITS, encode)
    assert req.prompt_ids == encode("Hello world") and req.kind == "completion"
    assert (req.max_tokens, req.temperature, req.top_p, req.seed, req.stream) == (16, 1.0, 1.0, None, False)
    assert (req.mode, req.sla_ttft_ms, req.sla_tpot_ms, req.stop) == ("bounded", 1000.0, 100.0, ())
    req = api.parse_completion(body(prompt=[5, 6], max_tokens=4, temperature=0, stop="\n", seed=7, mode="exact",
                                    sla={"ttft_ms": 250}, stream=True, stream_options={"include_usage": True},
                                    user="u", presence_penalty=0, unknown_field=1), LIMITS, encode)
    assert (req.prompt_ids, req.max_tokens, req.temperature, req.stop, req.seed, req.mode) == \
        ([5, 6], 4, 0.0, ("\n",), 7, "exact")
    assert (req.sla_ttft_ms, req.sla_tpot_ms, req.stream, req.include_usage) == (250.0, 100.0, True, True)
    assert req.payload("cmpl-1", [0])["stop_ids"] == [0]


def test_chat_prompt_format_and_default_max_tokens():
    req = api.parse_chat(body(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"}]), LIMITS, encode)
    text = "System: Be brief.\n\nUser: Hi there\n\nAssistant: Hello.\n\nUser: Bye?\n\nAssistant:"
    assert req.prompt_ids == encode(text) and api.CHAT_STOP in req.stop
    assert req.max_tokens == min(LIMITS.max_tokens_limit, LIMITS.context_window - len(req.prompt_ids))
    assert api.parse_chat(chat(max_tokens=3, max_completion_tokens=5), LIMITS, encode).max_tokens == 5


# -- responses -----------------------------------------------------------------------------------------
def test_responses_validate_as_openai_types_and_keep_exit_layers():
    u = api_responses.usage(5, 3)
    c = Completion.model_validate(
        api_responses.completion_response("cmpl-1", 1, "m", "abc", "length", [3, 6, 12], u))
    assert (c.choices[0].text, c.choices[0].finish_reason, c.usage.total_tokens) == ("abc", "length", 8)
    assert c.choices[0].model_extra["exit_layers"] == [3, 6, 12]
    cc = ChatCompletion.model_validate(api_responses.chat_response("chatcmpl-1", 1, "m", "hey", "stop", [3], u))
    assert (cc.choices[0].message.content, cc.choices[0].message.role, cc.usage.completion_tokens) == ("hey", "assistant", 3)
    deadline = api_responses.completion_response("cmpl-1", 1, "m", "", "deadline", [], u)
    assert Completion.model_validate(deadline).choices[0].finish_reason == "length"
    assert deadline["choices"][0]["smartexit_finish_reason"] == "deadline"


def test_chunks_validate_as_openai_types():
    for chunk in (api_responses.chat_chunk("c", 1, "m", {"role": "assistant", "content": ""}),
                  api_responses.chat_chunk("c", 1, "m", {"content": "x"}, None, [3]),
                  api_responses.chat_chunk("c", 1, "m", {}, "length", [6]),
                  api_responses.usage_chunk("chat", "c", 1, "m", api_responses.usage(2, 2))):
        parsed = ChatCompletionChunk.model_validate(chunk)
        assert parsed.object == "chat.completion.chunk"
    with_usage = api_responses.usage_chunk("chat", "c", 1, "m", api_responses.usage(2, 1))
    assert ChatCompletionChunk.model_validate(with_usage).usage.total_tokens == 3
    last = Completion.model_validate(api_responses.completion_chunk("c", 1, "m", "z", "stop", [3]))
    assert (last.object, last.choices[0].text, last.usage) == ("text_completion", "z", None)
    # OpenAI streams finish_reason null until the end
    middle = api_responses.completion_chunk("c", 1, "m", "y", None, [3])
    assert middle["choices"][0]["finish_reason"] is None and middle["object"] == "text_completion"
    usage_only = api_responses.usage_chunk("completion", "c", 1, "m", api_responses.usage(1, 1))
    assert Completion.model_validate(usage_only).choices == []


def test_sse_framing():
    assert api_responses.sse({"a": 1, "b": "é"}) == 'data: {"a":1,"b":"é"}\n\n'.encode()
    assert api_responses.SSE_DONE == b"data: [DONE]\n\n"
    stream = api_responses.sse({"x": 1}) + api_responses.sse({"x": 2}) + api_responses.SSE_DONE
    events = [e.removeprefix(b"data: ") for e in stream.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]" and [json.loads(e)["x"] for e in events[:-1]] == [1, 2]


def test_error_bodies_and_retry_after():
    err = api.ApiError(429, "slow down", code="too_many_requests", retry_after_s=2.4)
    assert err.body() == {"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                                    "code": "too_many_requests"}}
    assert err.headers() == {"Retry-After": "2"}
    assert api.ApiError(429, "x", retry_after_s=0.2).headers() == {"Retry-After": "1"}  # never 0
    assert api.ApiError(400, "x").headers() == {}


# -- incremental text -----------------------------------------------------------------------------------
def test_incremental_detokenization_holds_back_split_characters():
    text = "café € 😀 ok"
    ids = encode(text)
    detok = text_stream.IncrementalDetokenizer(decode)
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert not any("\ufffd" in d for d in deltas)
    assert len(ids) > len(text.split()) + 3  # the multi-byte characters really span several tokens


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40), st.lists(st.integers(1, 4), min_size=1, max_size=40))
def test_detokenized_deltas_concatenate_to_the_text(text, sizes):
    ids, detok, out, i = encode(text), text_stream.IncrementalDetokenizer(decode), [], 0
    for n in sizes * (len(ids) + 1):
        if i >= len(ids):
            break
        out.append(detok.push(ids[i:i + n]))
        i += n
    assert "".join(out) + detok.flush() == decode(ids)
    assert not any(d.endswith("\ufffd") for d in out)


def test_stop_strings_across_chunks_and_hold_back():
    m = text_stream.StopMatcher(["\nUser:", "END"])
    assert m.push("Hel") == "Hel"
    assert m.push("lo\nUs") == "lo"            # "\nUs" may begin a stop string
    assert m.push("er: more") == "" and m.stopped
    assert m.push("anything") == "" and m.flush() == ""
    m = text_stream.StopMatcher(["\nUser:"])
    assert m.push("ab\nU") == "ab" and m.push("nicorn") == "\nUnicorn"
    m = text_stream.StopMatcher(["xyz"])
    assert m.push("ax") == "a" and m.flush() == "x"
    assert text_stream.StopMatcher([]).push("abc") == "abc"


def test_text_stream_trims_a_chat_reply_and_cuts_at_stop():
    ts = text_stream.TextStream(decode, ["\nUser:"], lstrip=True)
    out = ts.push(encode(" Hi")) + ts.push(encode(" there\nUser: again"))
    assert out + ts.flush() == "Hi there" and ts.stopped and ts.text == "Hi there"


# -- config --------------------------------------------------------------------------------------------
def test_serve_config_checks_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="serve.api_key is required"):
        ServeConfig(host="0.0.0.0")
    ServeConfig(host="0.0.0.0", api_key="k")
    ServeConfig(host="::1")
    ServeConfig(hang_restart_s=None)
    for kw, field in ((dict(port=70000), "serve.port"), (dict(replicas=0), "serve.replicas"),
                      (dict(policy="sarathi"), "serve.policy"), (dict(fallback_policy="ppo"), "serve.fallback_policy"), (dict(default_mode="fast"), "serve.default_mode"),
                      (dict(control_tick_s=0), "serve.control_tick_s"), (dict(max_inflight=True), "serve.max_inflight"),
                      (dict(triton_url="nohost"), "serve.triton_url"),
                      (dict(stream_via="http"), "serve.stream_via"),
                      (dict(triton_host="server"), "serve.triton_host"),
                      (dict(triton_host="ingress", triton_url="127.0.0.1:8001"), "serve.triton_host: ingress"),
                      (dict(ingress="nginx"), "serve.ingress"), (dict(port=0), "serve.port 0"),
                      (dict(restart_backoff_s=5, restart_backoff_max_s=1), "serve.restart_backoff_max_s"),
                      (dict(hang_restart_s=0), "serve.hang_restart_s"), (dict(hang_restart_s="x"), "serve.hang_restart_s")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            ServeConfig(**kw)
    with pytest.raises(ConfigError, match="serve.bundle_dir is required"):
        BundleInfo.load(None)
    with pytest.raises(ConfigError, match="bundle.json is missing"):
        BundleInfo.load(tmp_path)
    (tmp_path / "bundle.json").write_text(json.dumps({"model": {"max_positions": 512, "num_layers": 12,
                                                                "exit_layers": [6, 3, 12]}}))
    (tmp_path / "tokenizer.json").write_bytes(TOKENIZER.read_bytes())
    b = BundleInfo.load(tmp_path)
    assert (b.max_positions, b.num_layers, b.exit_layers) == (512, 12, (3, 6, 12))
    assert ServeConfig(bundle_dir=tmp_path).with_bundle(b).context_window == 512
    repo = tmp_path / "repo"
    (repo / "smartexit" / "1").mkdir(parents=True)
    (repo / "smartexit" / "1" / "bundle").symlink_to(tmp_path)  # `smartexit repo`'s layout
    resolved = ServeConfig().resolve_bundle(repo)
    assert (resolved.bundle_dir, resolved.context_window) == (repo / "smartexit" / "1" / "bundle", 512)
    with pytest.raises(ConfigError, match="serve.bundle_dir is required"):
        ServeConfig().resolve_bundle(None)
    assert ServeConfig(context_window=300).with_bundle(b).context_window == 300
    with pytest.raises(ConfigError, match="serve.max_tokens_limit 256 must be below"):
        ServeConfig(context_window=256).with_bundle(b)
    with pytest.raises(ConfigError, match="context_window 1024 exceeds"):
        ServeConfig(context_window=1024).with_bundle(b)
    (tmp_path / "bundle.json").write_text(json.dumps({"model": {"max_positions": 512, "num_layers": 12,
                                                                "exit_layers": [13]}}))
    with pytest.raises(ConfigError, match="model.exit_layers"):
        BundleInfo.load(tmp_path)


# -- ingress glue: worker chunks -> answers (fakes for the worker stream; generation.py imports ray) ------
@pytest.fixture(scope="module")
def answers():
    from scheduler.serving import generation
    return generation


class FakeStream:
    """Stands in for a DeploymentResponseGenerator: async-iterable chunks, ``cancel()`` recorded;
    ``hang=True`` waits forever after the chunks (a slow engine)."""

    def __init__(self, chunks, raise_after=None, hang=False):
        self.chunks, self.raise_after, self.hang, self.cancelled = chunks, raise_after, hang, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for c in self.chunks:
            yield c
        if self.raise_after is not None:
            raise self.raise_after
        if self.hang:
            await asyncio.Event().wait()

    def cancel(self):
        self.cancelled = True


def steps(text, reason="length", layer=3):
    ids = encode(text)
    out = [{"token_ids": [i], "exit_layers": [layer], "finish_reason": ""} for i in ids]
    out[-1]["finish_reason"] = reason
    return out


def generation(answers, raw, stream, kind="completion"):
    from scheduler.serving.metrics import ServeMetrics
    req = (api.parse_chat if kind == "chat" else api.parse_completion)(raw, LIMITS, encode)
    released = []
    gen = answers.Generation(stream, req, text_stream.TextStream(decode, req.stop, lstrip=kind == "chat"),
                         ServeMetrics([3, 6], 12), 0.0, lambda: released.append(1))
    return gen, released


def requests_total(gen):
    from prometheus_client.parser import text_string_to_metric_families
    fams = {f.name: f for f in text_string_to_metric_families(gen._metrics.render().decode())}
    return {s.labels["status"]: s.value for s in fams["smartexit_requests"].samples if s.name.endswith("_total")}


def test_complete_aggregates_the_stream(answers):
    stream = FakeStream(steps("Hello world"))
    gen, released = generation(answers, body(prompt="Say", max_tokens=8), stream)
    out = Completion.model_validate(asyncio.run(answers.complete(gen, "cmpl-1")))
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("Hello world", "length")
    assert out.choices[0].model_extra["exit_layers"] == [3] * len(encode("Hello world"))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(encode("Say")), len(encode("Hello world")))
    assert not stream.cancelled
    gen.finish(200)
    gen.finish(200)  # once only
    assert released == [1] and requests_total(gen) == {"200": 1.0}


def test_a_stop_string_ends_the_answer_and_cancels_the_worker(answers):
    stream = FakeStream(steps("Hi END and more text"))
    gen, _ = generation(answers, body(prompt="x", stop="END"), stream)
    out = asyncio.run(answers.complete(gen, "cmpl-2"))
    assert (out["choices"][0]["text"], out["choices"][0]["finish_reason"]) == ("Hi ", "stop")
    assert stream.cancelled


def test_worker_errors_become_http_errors(answers):
    from ray.exceptions import RayError
    overloaded = {"error": {"kind": "rejected", "code": "overloaded", "message": "queue full", "field": None,
                            "retry_after_s": 3.0}}
    for stream, status in ((FakeStream([overloaded]), 429), (FakeStream([], raise_after=RayError("died")), 503),
                           (FakeStream(steps("ab", reason="")), 503)):  # stream ended without a final chunk
        gen, _ = generation(answers, body(prompt="x"), stream)
        with pytest.raises(api.ApiError) as info:
            asyncio.run(answers.complete(gen, "cmpl-3"))
        assert info.value.status == status
    assert info.value.headers() == {"Retry-After": "1"}


def test_a_disconnect_cancels_the_worker_stream(answers):
    stream = FakeStream(steps("one two", reason=""), hang=True)
    gen, _ = generation(answers, body(prompt="x"), stream)

    async def main():
        task = asyncio.create_task(answers.complete(gen, "cmpl-4"))
        await asyncio.sleep(0.05)
        task.cancel()  # what Serve does to the ingress request when the HTTP client goes away
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert stream.cancelled


def sse_events(answers, gen):
    async def main():
        return [e async for e in answers.sse_events(gen, "chatcmpl-1")]
    raw = b"".join(asyncio.run(main()))
    assert raw.endswith(api_responses.SSE_DONE)
    return [json.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n") if e and e != b"data: [DONE]"]


def test_chat_stream_events(answers):
    stream = FakeStream(steps(" Fine thanks\nUser: more"))
    gen, released = generation(answers, chat(stream=True, stream_options={"include_usage": True}), stream, "chat")
    events = sse_events(answers, gen)
    chunks = [ChatCompletionChunk.model_validate(e) for e in events]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Fine thanks"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop" and stream.cancelled
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(gen.req.prompt_ids)
    assert sum(len(e["choices"][0]["exit_layers"]) for e in events if e["choices"]) == gen.tokens
    assert released == [1] and requests_total(gen) == {"200": 1.0}


def test_completion_stream_events_and_errors(answers):
    gen, _ = generation(answers, body(prompt="x", stream=True), FakeStream(steps("ab cd")))
    events = sse_events(answers, gen)
    assert "".join(e["choices"][0]["text"] for e in events) == "ab cd"
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
    assert all(e["usage"] is None for e in events)  # no usage chunk unless asked
    # an error before the first event raises (the caller answers with its status) ...
    gen, _ = generation(answers, body(prompt="x", stream=True),
                        FakeStream([{"error": {"kind": "unavailable", "message": "down"}}]))
    with pytest.raises(api.ApiError, match="unavailable"):
        sse_events(answers, gen)
    assert requests_total(gen) == {"503": 1.0}
    # ... after it, it travels in the stream
    from ray.exceptions import RayError
    gen, _ = generation(answers, body(prompt="x", stream=True), FakeStream(steps("ab", reason=""),
                                                                       raise_after=RayError("died")))
    events = sse_events(answers, gen)
    assert events[-1]["error"]["code"] == "unavailable" and requests_total(gen) == {"503": 1.0}


class FakeClient:
    def __init__(self, stats):
        self.stats, self.ops = stats, []

    async def control(self, op):
        self.ops.append(op)
        if op["op"] == "set":
            self.stats = {**self.stats, **{k: v for k, v in op.items() if k != "op"}}
        return self.stats


class FakePolicy:
    """The scheduler.control.policies interface: act(observation) -> an action with prefill_budget, max_running."""

    def __init__(self, budget, running):
        self.action = type("Action", (), {"prefill_budget": budget, "max_running": running})()
        self.seen = []

    def act(self, obs):
        self.seen.append(obs)
        return self.action


def test_control_step_applies_only_what_changed():
    from scheduler.serving import engine_host
    client = FakeClient({"waiting": 2, "prefill_budget": 128, "max_running": 8})
    policy = FakePolicy(256, 8)
    stats = asyncio.run(engine_host.control_step(client, policy, lambda s: ("obs", s["waiting"])))
    assert client.ops == [{"op": "stats"}, {"op": "set", "prefill_budget": 256}]
    assert stats["prefill_budget"] == 256 and policy.seen == [("obs", 2)]
    client.ops.clear()
    asyncio.run(engine_host.control_step(client, policy, lambda s: s))
    assert client.ops == [{"op": "stats"}]  # nothing to change: no set

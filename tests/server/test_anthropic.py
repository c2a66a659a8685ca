"""Anthropic's Messages API (`/v1/messages`) through the official `anthropic` SDK against the
real server: text, streaming events, a tool loop with tool_use / tool_result, x-api-key auth
and Anthropic-shaped errors."""
import anthropic
import jsonschema
import pytest
import requests

from conftest import Server

MODEL = "smol"
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused")


def test_text_reply_whole_and_streamed(claude):
    kw = dict(model=MODEL, max_tokens=24, extra_body={"temperature": 0}, system="Be brief.",
              messages=[{"role": "user", "content": "Say hello."}])
    m = claude.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0
    with claude.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text == final.content[0].text
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens


def test_a_matched_stop_sequence_is_reported(claude):
    kw = dict(model=MODEL, max_tokens=24, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "Say hello."}])
    full = claude.messages.create(**kw).content[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    m = claude.messages.create(stop_sequences=[stop, "zzzz"], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop, m
    assert stop not in m.content[0].text and full.startswith(m.content[0].text)
    with claude.messages.stream(stop_sequences=[stop], **kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_tool_loop(claude):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, max_tokens=200, extra_body={"temperature": 0}, tools=[WEATHER], tool_choice={"type": "any"})
    m = claude.messages.create(messages=messages, **kw)
    assert m.stop_reason == "tool_use", m
    use = next(b for b in m.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with claude.messages.stream(messages=messages, **kw) as s:
        final = s.get_final_message()
    streamed = next(b for b in final.content if b.type == "tool_use")
    assert (streamed.name, streamed.input) == (use.name, use.input) and final.stop_reason == "tool_use"
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": "18 degrees and sunny"}]}]},
    ]
    reply = claude.messages.create(model=MODEL, max_tokens=30, extra_body={"temperature": 0}, tools=[WEATHER],
                                   tool_choice={"type": "none"}, messages=messages)
    assert reply.content and reply.content[0].type == "text" and reply.stop_reason != "tool_use"


def test_named_tool_and_bad_requests(claude):
    m = claude.messages.create(model=MODEL, max_tokens=200, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather"},
                               messages=[{"role": "user", "content": "Hi"}])
    assert [b.name for b in m.content if b.type == "tool_use"] == ["get_weather"]
    # A forced call cut by max_tokens is reported as cut, not as a finished call.
    cut = claude.messages.create(model=MODEL, max_tokens=6, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"},
                                 messages=[{"role": "user", "content": "Hi"}])
    assert cut.stop_reason == "max_tokens", cut
    # The SDK will not send a request without max_tokens: raw HTTP, Anthropic's error shape.
    r = requests.post(str(claude.base_url).rstrip("/") + "/v1/messages",
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="image"):
        claude.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])


def test_x_api_key():
    s = Server("--api-key", "sekrit")
    try:
        ok = anthropic.Anthropic(base_url=s.url, api_key="sekrit")
        assert ok.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}]).content
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=s.url, api_key="wrong").messages.create(
                model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    finally:
        s.stop()

"""Every tool-call parser on the real server: forced calls (tool_choice required / named) come
out in the parser's format and validate against the tools' schemas, and a streamed call arrives
as OpenAI streams it (index, id, type and name first, then argument fragments) with the same
name and arguments as the whole response."""
import json

import jsonschema
import openai
import pytest

from conftest import Server
from test_structured import TOOLS, ask

MODEL = "smol"
PARSERS = ["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"]


@pytest.fixture(scope="module", params=PARSERS)
def parser_client(request):
    s = Server("--enable-auto-tool-choice", "--tool-call-parser", request.param)
    yield request.param, openai.OpenAI(base_url=s.url + "/v1", api_key="unused")
    s.stop()


def validate(name, arguments):
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), schema)


def test_forced_calls_validate(parser_client):
    parser, client = parser_client
    for seed in range(3):
        for choice, names in [("required", {"get_weather", "now"}),
                              ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})]:
            c = client.chat.completions.create(model=MODEL, messages=ask("What is the weather in Paris?"),
                                               tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed,
                                               max_tokens=300).choices[0]
            assert c.finish_reason == "tool_calls", (parser, c)
            for call in c.message.tool_calls:
                assert call.function.name in names and call.id.startswith("call_"), call
                validate(call.function.name, call.function.arguments)


def test_streamed_call_matches_the_whole_response(parser_client):
    parser, client = parser_client
    kw = dict(model=MODEL, messages=ask("Weather in Oslo, please."), tools=TOOLS, temperature=0, max_tokens=300,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls, fragments, finish = {}, 0, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for tc in choice.delta.tool_calls or []:
            if tc.index not in calls:
                # The first delta of a call names it.
                assert tc.id and tc.type == "function" and tc.function.name, (parser, tc)
                calls[tc.index] = {"name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and tc.function.name is None, (parser, tc)
                calls[tc.index]["arguments"] += tc.function.arguments
                fragments += 1
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole], parser
    validate(whole[0].function.name, whole[0].function.arguments)
    if parser != "pythonic":  # pythonic arguments go out whole, at the call's ")"
        assert fragments >= 2, (parser, calls)


def test_a_forced_call_cut_by_max_tokens_reports_length(parser_client):
    """The call is unfinished: the finish reason says the reply was cut, whole and streamed
    (vLLM reports `length` too), never `tool_calls`."""
    parser, client = parser_client
    kw = dict(model=MODEL, messages=ask("What is the weather in Paris?"), tools=TOOLS, temperature=0,
              max_tokens=6, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert client.chat.completions.create(**kw).choices[0].finish_reason == "length", parser
    finish = [c.choices[0].finish_reason for c in client.chat.completions.create(stream=True, **kw)
              if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"], (parser, finish)


def test_a_cut_forced_reply_leaks_no_markup_into_content(parser_client):
    """`required` with parallel calls, cut at several points: the finished calls come back,
    and the unfinished one's markup (`<tool_call>\\n{"`, `[TOOL_CALLS]`...) is not content."""
    parser, client = parser_client
    for max_tokens in (30, 60, 100):
        kw = dict(model=MODEL, messages=ask("What is the weather in Paris?"), tools=TOOLS,
                  temperature=0, max_tokens=max_tokens, tool_choice="required")
        c = client.chat.completions.create(**kw).choices[0]
        assert not c.message.content, (parser, max_tokens, c)
        content = "".join(ch.choices[0].delta.content or "" for ch in
                          client.chat.completions.create(stream=True, **kw) if ch.choices)
        assert not content, (parser, max_tokens, content)

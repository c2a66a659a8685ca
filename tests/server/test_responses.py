"""OpenAI's Responses API (`/v1/responses`) through the official `openai` SDK against the real
server: text whole and streamed, a function tool, and a conversation continued with
`previous_response_id` and a `function_call_output`."""
import json

import jsonschema
import openai
import pytest

MODEL = "smol"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


def test_text_whole_and_streamed(client):
    kw = dict(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=20, temperature=0)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.id.startswith("resp") and r.status in ("completed", "incomplete")
    assert r.output_text and r.output[0].type == "message" and r.usage.output_tokens > 0
    deltas, kinds, final = [], [], None
    for e in client.responses.create(stream=True, **kw):
        kinds.append(e.type)
        if e.type == "response.output_text.delta":
            deltas.append(e.delta)
        if e.type in ("response.completed", "response.incomplete"):
            final = e.response
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"], kinds
    assert "".join(deltas) == r.output_text == final.output_text
    assert [e for e in kinds if e.endswith(".done")] == \
        ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_function_tool_and_previous_response(client):
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice="required", temperature=0, max_output_tokens=200,
                                parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id, r.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    # Streamed: the call's arguments arrive as deltas that add up to the whole response's.
    args = "".join(e.delta for e in client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
        temperature=0, max_output_tokens=200, parallel_tool_calls=False, stream=True) if e.type == "response.function_call_arguments.delta")
    assert args == calls[0].arguments
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], temperature=0,
                                     max_output_tokens=30, tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "18 degrees and sunny"}])
    assert follow.previous_response_id == r.id and follow.output_text


def test_unknown_previous_response_and_bad_input(client):
    with pytest.raises(openai.NotFoundError, match="no response"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_missing")
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.responses.create(model=MODEL, input=[{"type": "web_search_call", "id": "x"}])

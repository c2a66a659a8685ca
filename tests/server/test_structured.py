"""Structured output through the real server with the official `openai` client: every output
must validate against what was asked (jsonschema is the independent checker)."""
import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic
import pytest
import requests

MODEL = "smol"


def ask(text):
    return [{"role": "user", "content": text}]


class City(pydantic.BaseModel):
    name: str
    country: str
    population: int
    coastal: bool


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(
        model=MODEL, messages=ask("Describe Paris as JSON."), response_format=City,
        temperature=0, max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    assert isinstance(c.message.parsed, City), c.message.content


def test_json_object(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ask("Describe a cat in JSON with two keys: name and color."),
        response_format={"type": "json_object"}, temperature=0, max_tokens=300)
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    assert isinstance(json.loads(c.message.content), dict)


def random_schema(rng, depth=0):
    """A schema whose every instance is finite: bounded strings, arrays and numbers, closed
    objects."""
    # No unbounded floats: a sampled model may write digits until its token budget runs out.
    kinds = ["string", "integer", "boolean", "enum", "pattern", "null"]
    if depth < 2:
        kinds += ["object", "object", "array", "anyOf"]
    # The top level is an object, as a tool's arguments or an API's reply are.
    kind = rng.choice(kinds) if depth else "object"
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 16)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(
            ["^[a-z]{1,8}$", "^[A-Z][a-z]{0,6}$", "^[0-9]{3}-[0-9]{4}$", "^(yes|no|maybe)$"])}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "magenta", "black"], rng.randint(1, 4))}
    if kind == "array":
        lo = rng.randint(0, 1)
        return {"type": "array", "items": random_schema(rng, depth + 1),
                "minItems": lo, "maxItems": lo + rng.randint(0, 3)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1), random_schema(rng, depth + 1)]}
    names = rng.sample(["id", "name", "tags", "score", "ok", "kind", "items", "meta", "note"], rng.randint(1, 3))
    props = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def run_schema(client, i, schema):
    kw = dict(model=MODEL, messages=ask("Answer with a JSON value."), temperature=0.8, seed=i,
              max_tokens=400, response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
    if i % 2:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    else:
        c = client.chat.completions.create(**kw).choices[0]
        text, finish = c.message.content, c.finish_reason
    return text, finish


def test_200_random_schemas_validate_streamed_and_not(client):
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(200)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda a: run_schema(client, *a), enumerate(schemas)))
    for i, (schema, (text, finish)) in enumerate(zip(schemas, results)):
        assert finish == "stop", f"schema {i} {json.dumps(schema)}: {finish} after {text!r}"
        jsonschema.validate(json.loads(text), schema)


def test_regex_choice_and_grammar(client):
    # vLLM's `structured_outputs` and its legacy `guided_*` fields.
    for extra, check in [
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,4}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2,4}", t)),
        ({"guided_regex": "(cat|dog)s? are (great|fine)"}, lambda t: re.fullmatch("(cat|dog)s? are (great|fine)", t)),
        ({"structured_outputs": {"choice": ["positive", "negative", "neutral"]}}, lambda t: t in ("positive", "negative", "neutral")),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"grammar": 'start: "SELECT " COL " FROM t"\nCOL: "a" | "b" | "*"'}},
         lambda t: t in ("SELECT a FROM t", "SELECT b FROM t", "SELECT * FROM t")),
    ]:
        for seed in range(3):
            c = client.chat.completions.create(
                model=MODEL, messages=ask("Say something."), temperature=1.0, seed=seed,
                max_tokens=60, extra_body=extra).choices[0]
            assert c.finish_reason == "stop" and check(c.message.content), (extra, c.message.content)


def test_completions_and_n_choices_follow_the_constraint(client):
    r = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=10, n=3,
                                  temperature=1.0, seed=1, extra_body={"guided_choice": ["sunny", "rainy"]})
    assert len(r.choices) == 3
    assert all(c.text in ("sunny", "rainy") and c.finish_reason == "stop" for c in r.choices), r.choices


@pytest.mark.parametrize("kw,msg", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wizard"}}}), "does not compile"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "needs a `schema`"),
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(extra_body={"guided_regex": "(unclosed"}), "does not compile"),
    (dict(extra_body={"guided_choice": []}), "guided_choice"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "takes one of"),
    (dict(extra_body={"structured_outputs": {"jsonn": {}}}), "structured_outputs.jsonn"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "only one"),
])
def test_bad_constraints_get_400(client, kw, msg):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=5, **kw)
    assert msg in str(e.value)


def token_id(server, text):
    ids = requests.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_logit_bias_and_allowed_token_ids(client, server):
    cat = token_id(server, " cat")
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(cat): 100})
    assert r.choices[0].text == " cat cat cat"
    free = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0)
    top = token_id(server, free.choices[0].text)
    banned = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0,
                                       logit_bias={str(top): -100})
    assert banned.choices[0].text != free.choices[0].text
    yes, no = token_id(server, " yes"), token_id(server, " no")
    r = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=6, temperature=1.0, seed=3,
                                  extra_body={"allowed_token_ids": [yes, no]})
    assert re.fullmatch("( yes| no)+", r.choices[0].text), r.choices[0].text
    for bias, msg in [({"x": 1}, "token ids"), ({str(cat): 101}, "[-100, 100]"), ({"999999999": 1}, "outside the vocabulary")]:
        with pytest.raises(openai.BadRequestError, match=re.escape(msg)):
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, logit_bias=bias)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "unit": {"enum": ["c", "f"]}},
                    "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "description": "The time",
     "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
]


def check_calls(message, names):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.function.name in names, call
        args = json.loads(call.function.arguments)
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(args, schema)


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice_always_call(client, stream):
    for seed in range(4):
        for choice, names in [("required", {"get_weather", "now"}),
                              ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})]:
            kw = dict(model=MODEL, messages=ask("Hello there!"), tools=TOOLS, tool_choice=choice,
                      temperature=1.0, seed=seed, max_tokens=400)
            if not stream:
                c = client.chat.completions.create(**kw).choices[0]
                assert c.finish_reason == "tool_calls", c
                check_calls(c.message, names)
                # A named function is called once; `required` makes at most 4 calls.
                assert len(c.message.tool_calls) <= (1 if isinstance(choice, dict) else 4)
                continue
            calls, finish = {}, None
            for chunk in client.chat.completions.create(stream=True, **kw):
                if not chunk.choices:
                    continue
                d = chunk.choices[0]
                finish = d.finish_reason or finish
                for tc in d.delta.tool_calls or []:
                    e = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    e["name"] += (tc.function.name or "") if tc.function else ""
                    e["arguments"] += (tc.function.arguments or "") if tc.function else ""
            assert finish == "tool_calls" and calls, (finish, calls)
            for e in calls.values():
                assert e["name"] in names
                json.loads(e["arguments"])


def test_a_three_turn_tool_loop_with_null_content(client):
    """What agents send back: the assistant's call with `content: null`, then the tool's result."""
    messages = ask("What is the weather in Paris?")
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=400, parallel_tool_calls=False)
    call = r.choices[0].message.tool_calls[0]
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=30)
    m2 = r2.choices[0].message
    assert m2.content or m2.tool_calls
    messages += [{"role": "assistant", "content": m2.content or ""}, {"role": "user", "content": "And tomorrow?"}]
    r3 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                        temperature=0, max_tokens=400)
    check_calls(r3.choices[0].message, {"get_weather", "now"})


def test_forced_tools_and_a_response_format_conflict(client):
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        client.chat.completions.create(model=MODEL, messages=ask("hi"), tools=TOOLS, tool_choice="required",
                                       response_format={"type": "json_object"}, max_tokens=5)

"""`--reasoning-parser` on the real server: the text inside <think>...</think> is
`reasoning_content`, the rest content (and tool calls), whole and streamed alike. The test model
does not think on its own, so under `qwen3` (an output may open a block) a regex constraint
makes it write one; under `deepseek_r1` (the prompt opened the block) a grammar starts only
once the block has closed, as vLLM applies it."""
import json

import openai
import pytest

from conftest import Server
from test_structured import ask

MODEL = "smol"
THINK = r"<think>[a-z ]{3,20}</think>"


@pytest.fixture(scope="module")
def client():
    s = Server("--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused")
    s.stop()


@pytest.fixture(scope="module")
def r1():
    s = Server("--reasoning-parser", "deepseek_r1")
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused")
    s.stop()


def streamed(client, **kw):
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        finish = c.finish_reason or finish
        reasoning += getattr(c.delta, "reasoning_content", None) or ""
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            e = calls.setdefault(tc.index, ["", ""])
            e[0] += tc.function.name or ""
            e[1] += tc.function.arguments or ""
    return reasoning, content, list(calls.values()), finish


def test_think_block_becomes_reasoning_content(client):
    kw = dict(model=MODEL, messages=ask("Say hi."), temperature=0, max_tokens=60,
              extra_body={"structured_outputs": {"regex": THINK + r"[A-Z][a-z ]{2,20}"}})
    m = client.chat.completions.create(**kw).choices[0].message
    assert m.reasoning_content and "<think>" not in m.reasoning_content, m
    assert m.content and m.content[0].isupper() and "think>" not in m.content, m
    assert streamed(client, **kw)[:2] == (m.reasoning_content, m.content)


def test_unconstrained_output_without_an_end_is_all_reasoning(r1):
    # DeepSeek-R1's template opens <think> in the prompt: output that never closes it is thinking.
    m = r1.chat.completions.create(model=MODEL, messages=ask("Say hi."), temperature=0,
                                   max_tokens=12).choices[0].message
    assert m.reasoning_content and m.content is None, m


def test_the_grammar_waits_for_the_reasoning_to_end(r1):
    kw = dict(model=MODEL, temperature=0, max_tokens=24, response_format={"type": "json_object"})
    # Still thinking (the test model never writes </think>): nothing is constrained yet.
    m = r1.chat.completions.create(messages=ask("Describe a cat."), **kw).choices[0].message
    assert m.reasoning_content and m.content is None, m
    # A block the prompt already closed: the answer is constrained from its first token.
    closed = ask("Describe a cat.") + [{"role": "assistant", "content": "<think>A cat.</think>"}]
    m = r1.chat.completions.create(messages=closed, extra_body={"continue_final_message": True,
                                                                "add_generation_prompt": False},
                                   **kw).choices[0].message
    assert getattr(m, "reasoning_content", None) is None and isinstance(json.loads(m.content), dict), m


def test_reasoning_then_a_tool_call(client):
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    kw = dict(model=MODEL, messages=ask("What time is it?"), tools=tools, temperature=0, max_tokens=80,
              extra_body={"structured_outputs": {
                  "regex": THINK + r'<tool_call>\n\{"name": "now", "arguments": \{\}\}\n</tool_call>'}})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.reasoning_content, c
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == [("now", "{}")]
    reasoning, content, calls, finish = streamed(client, **kw)
    assert (reasoning, calls, finish) == (c.message.reasoning_content, [["now", "{}"]], "tool_calls")

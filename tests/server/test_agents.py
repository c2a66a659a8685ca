"""Coding agents against ferrite: the Claude Code and Codex CLIs themselves (pinned releases from
npm, installed by scripts/test.sh), run non-interactively for two turns of one session, and the
requests they send (captured once from those releases: tests/server/fixtures/) replayed through
the official `anthropic` and `openai` SDKs' parsers, with a tool-result turn and a streamed tool
call each.

The CLIs run against SmolLM2 (8K context, an instruct model that ends its turns) with greedy
defaults (`--override-generation-config '{"temperature": 0}'`: the CLIs send no temperature) and
short system prompts (`claude --bare --system-prompt`, Codex's `model_instructions_file`):
after Claude Code's default 9K-token prompt no model this small ends its turn, and Claude Code
calls a reply cut by `max_tokens` an error. The full requests are replayed against Gemma 3 270M
(32K context)."""
import copy
import json
import os
import subprocess

import anthropic
import openai
import pytest
import requests

from conftest import ROOT, Server

CLIS = os.path.join(ROOT, "target", "test-venv", "agent-clis", "node_modules", ".bin")
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
SYSTEM = "You are a terse assistant. Reply with one short sentence."


def fixture(name):
    return json.load(open(os.path.join(FIXTURES, name)))


@pytest.fixture(scope="module")
def smol():
    s = Server("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--override-generation-config", '{"temperature": 0}',
               max_model_len=8192, kv_bytes=400 << 20, name="smol")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gemma():
    path = subprocess.check_output([os.path.join(ROOT, "scripts", "fetch-model.sh"), "gemma3"], text=True).strip()
    s = Server("--enable-auto-tool-choice", "--tool-call-parser", "gemma3", model=path, name="gemma",
               max_model_len=16384, kv_bytes=600 << 20)
    yield s
    s.stop()


def cli(name):
    path = os.path.join(CLIS, name)
    assert os.access(path, os.X_OK), f"{path} is missing: scripts/test.sh installs the agent CLIs"
    return path


def test_claude_code_completes_two_turns_the_second_cached(smol, tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "ANTHROPIC_BASE_URL": smol.url, "ANTHROPIC_API_KEY": "unused",
           "ANTHROPIC_MODEL": "smol", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}

    def turn(*args):
        p = subprocess.run([cli("claude"), "-p", *args, "--output-format", "json", "--bare", "--tools", "",
                            "--system-prompt", SYSTEM], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        r = json.loads(p.stdout.strip().splitlines()[-1])
        assert not r["is_error"] and r["result"].strip(), r
        return r

    first = turn("Say hi")
    second = turn("Now say bye", "--resume", first["session_id"])
    assert second["session_id"] == first["session_id"]
    assert second["usage"]["cache_read_input_tokens"] > 0, second["usage"]


def test_codex_completes_two_turns_the_second_cached(smol, tmp_path):
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "smol"\nmodel_provider = "ferrite"\n[model_providers.ferrite]\nname = "ferrite"\n'
        f'base_url = "{smol.url}/v1"\nwire_api = "responses"\n')
    (home / "instructions.md").write_text(SYSTEM + "\n")
    flags = ["-c", f"model_instructions_file={home / 'instructions.md'}", "-c", "include_permissions_instructions=false",
             "-c", "include_environment_context=false", "-c", "web_search=disabled"]

    def turn(*args):
        p = subprocess.run([cli("codex"), "exec", "--skip-git-repo-check", "--json", *flags, *args],
                           env={**os.environ, "CODEX_HOME": str(home)}, cwd=tmp_path, capture_output=True,
                           text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert p.returncode == 0, p.stdout + p.stderr
        events = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
        assert not [e for e in events if e["type"] in ("error", "turn.failed")], events
        texts = [e["item"]["text"] for e in events
                 if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
        assert texts and texts[-1].strip(), events
        return next(e["usage"] for e in events if e["type"] == "turn.completed")

    turn("Say hi")
    usage = turn("resume", "--last", "Thanks.")
    assert usage["cached_input_tokens"] > 0, usage


def test_a_cap_past_the_context_is_cut_to_it(smol):
    """Clients send fixed caps (Claude Code 32,000): the reply runs to the end of the context
    and ends with the length reason, on each API."""
    words = "one two three " * 40
    n = requests.post(smol.url + "/tokenize", json={"prompt": words}).json()["count"]
    small = Server("--override-generation-config", '{"temperature": 0}', max_model_len=n + 64, name="smol")
    try:
        c = openai.OpenAI(base_url=small.url + "/v1", api_key="unused")
        r = c.completions.create(model="smol", prompt=words, max_tokens=32000, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 64, r
        m = anthropic.Anthropic(base_url=small.url, api_key="unused", timeout=120).messages.create(
            model="smol", max_tokens=32000, messages=[{"role": "user", "content": words}])
        u = m.usage
        assert m.stop_reason == "max_tokens", m
        assert u.input_tokens + u.cache_read_input_tokens + u.output_tokens == n + 64, u
        with pytest.raises(openai.BadRequestError, match="leaves no room for output"):
            c.completions.create(model="smol", prompt=words * 2, max_tokens=1)
    finally:
        small.stop()


def claude_code_request():
    """The captured request, for the served model; the reply capped (the base model rambles)."""
    body = fixture("claude_code_request.json")
    body.update(model="gemma", max_tokens=8)
    return body


def replay_messages(client, body, **kw):
    """`body` sent as Claude Code sends it (its fields the SDK does not type go as extra body),
    streamed, and accumulated by the SDK's stream helper."""
    typed = {k: body[k] for k in ("model", "max_tokens", "messages", "system", "tools", "metadata")}
    extra = {k: v for k, v in body.items() if k not in typed and k != "stream"}
    with client.messages.stream(**typed, **kw, extra_body=extra) as s:
        events = [e.type for e in s]
        return events, s.get_final_message()


def test_claude_code_request_replayed(gemma):
    client = anthropic.Anthropic(base_url=gemma.url, api_key="unused")
    body = claude_code_request()
    assert [m["role"] for m in body["messages"]] == ["user", "system"]
    assert body["thinking"]["type"] == "adaptive" and "context_management" in body
    events, m = replay_messages(client, body)
    assert events[0] == "message_start" and events[-1] == "message_stop", events
    assert m.stop_reason == "max_tokens" and m.content[0].type == "text" and m.content[0].text
    # The second turn of a session resends the prefix: the prefix cache serves it.
    _, again = replay_messages(client, body)
    assert again.usage.cache_read_input_tokens > 0.9 * (again.usage.input_tokens
                                                       + again.usage.cache_read_input_tokens), again.usage


def test_claude_code_tool_result_turn_and_streamed_tool_call(gemma):
    client = anthropic.Anthropic(base_url=gemma.url, api_key="unused")
    body = claude_code_request()
    body["messages"] += [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Listing the folder."},
            {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "ls", "description": "List"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "is_error": True,
             "content": [{"type": "text", "text": "ls: cannot open directory '.': Permission denied"}]},
            {"type": "text", "text": "Try again with sudo."}]},
    ]
    body["max_tokens"] = 400
    events, m = replay_messages(client, body, tool_choice={"type": "tool", "name": "Bash"})
    assert "content_block_delta" in events, events
    assert m.stop_reason == "tool_use", m
    call = next(b for b in m.content if b.type == "tool_use")
    assert call.name == "Bash" and isinstance(call.input, dict) and "command" in call.input, call


def codex_request():
    body = fixture("codex_request.json")
    body.update(model="gemma", max_output_tokens=8)
    return body


def replay_responses(client, body, **kw):
    typed = {k: body[k] for k in ("model", "input", "tools", "tool_choice", "parallel_tool_calls", "reasoning",
                                  "store", "include", "prompt_cache_key", "max_output_tokens")}
    typed.update(kw)
    extra = {k: v for k, v in body.items() if k not in typed and k != "stream"}
    events = list(client.responses.create(**typed, stream=True, extra_body=extra))
    return events, events[-1].response


def test_codex_request_replayed(gemma):
    client = openai.OpenAI(base_url=gemma.url + "/v1", api_key="unused")
    body = codex_request()
    assert {t["type"] for t in body["tools"]} == {"function", "namespace", "web_search"}
    assert [i["role"] for i in body["input"]] == ["developer", "developer", "user", "user"]
    events, r = replay_responses(client, body)
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete", events[-1]
    assert r.output and r.output[-1].type == "message" and r.output_text
    _, again = replay_responses(client, body)
    assert again.usage.input_tokens_details.cached_tokens > 0.9 * again.usage.input_tokens, again.usage


def test_codex_tool_output_turn_and_a_namespaced_call(gemma):
    client = openai.OpenAI(base_url=gemma.url + "/v1", api_key="unused")
    body = codex_request()
    body["input"] = body["input"] + [
        {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nsrc"},
        {"type": "function_call", "call_id": "call_2", "namespace": "multi_agent_v1", "name": "wait_agent",
         "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_2", "output": "no agents"},
    ]
    body["max_output_tokens"] = 400
    events, r = replay_responses(client, body,
                                 tool_choice={"type": "function", "name": "multi_agent_v1__spawn_agent"})
    assert "response.function_call_arguments.delta" in {e.type for e in events}
    call = next(o for o in r.output if o.type == "function_call")
    raw = call.model_dump()
    assert (raw["name"], raw.get("namespace")) == ("spawn_agent", "multi_agent_v1"), raw
    json.loads(call.arguments)
    # The call goes back in the next turn as Codex sends it.
    follow = copy.deepcopy(body)
    follow["input"] += [raw, {"type": "function_call_output", "call_id": call.call_id, "output": "spawned"}]
    follow["max_output_tokens"] = 8
    _, r2 = replay_responses(client, follow)
    assert r2.status in ("completed", "incomplete") and r2.output

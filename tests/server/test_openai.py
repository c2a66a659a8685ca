"""The OpenAI API of `ferrite serve`, driven by the official `openai` Python client."""
import json
import os
import signal
import subprocess
import threading
import time

import openai
import pytest
import requests

from conftest import BINARY, MODEL as MODEL_PATH, ROOT, Server

MODEL = "smol"
# The default int8 path answers this one right; it says "L'Etoile" to the capital of France
# (the f32 path says Paris): README, "Quick start".
ASK = [{"role": "user", "content": "What is the capital of Germany?"}]


def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert requests.get(server.url + "/health").status_code == 200
    assert "version" in requests.get(server.url + "/version").json()
    # Logs redirected to a file carry no terminal colour codes.
    log = open(server.log.name).read()
    assert "KV cache:" in log and "\x1b[" not in log


def test_chat_answer_and_usage(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=30, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert "Berlin" in c.message.content
    assert c.finish_reason == "stop"
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_concatenates_to_the_whole_response(client):
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_sse_wire_format(server):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 3, "stream": True, "temperature": 0}
    with requests.post(server.url + "/v1/chat/completions", json=body, stream=True) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [l for l in r.iter_lines(decode_unicode=True) if l]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert list(first)[:5] == ["id", "object", "created", "model", "choices"]
    assert first["object"] == "chat.completion.chunk"


def test_n_choices_stop_and_length(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, n=3, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("length", "stop") for c in r.choices)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=30, temperature=0, stop=["Berlin", "Germany"])
    assert r.choices[0].finish_reason == "stop"
    assert "Berlin" not in r.choices[0].message.content and "Germany" not in r.choices[0].message.content


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=20, temperature=1.0, seed=42)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3
        assert tok.logprob <= 0
        assert tok.logprob == pytest.approx(tok.top_logprobs[0].logprob, abs=1e-4)  # greedy = top-1


def test_completions_prompt_forms_echo_and_legacy_logprobs(client, server):
    r = client.completions.create(model=MODEL, prompt=["The sky is", "Water boils at"], max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and all(c.text for c in r.choices)
    ids = requests.post(server.url + "/tokenize", json={"prompt": "The sky is"}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text
    e = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, echo=True, logprobs=2)
    c = e.choices[0]
    assert c.text.startswith("The sky is")
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == c.text
    stream = list(client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0, stream=True))
    whole = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0)
    assert "".join(s.choices[0].text for s in stream) == whole.choices[0].text


def test_tokenize_detokenize_roundtrip(server):
    t = requests.post(server.url + "/tokenize", json={"prompt": "naïve café 🚀"}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 2048
    assert requests.post(server.url + "/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == "naïve café 🚀"
    chat = requests.post(server.url + "/tokenize", json={"messages": ASK}).json()
    assert chat["count"] > t["count"]


def test_continue_final_message_leaves_the_last_message_open(server, client):
    chat = ASK + [{"role": "assistant", "content": "Hello there, my"}]
    open_ = {"continue_final_message": True, "add_generation_prompt": False}
    ids = requests.post(server.url + "/tokenize", json={"messages": chat, **open_}).json()["tokens"]
    text = requests.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nHello there, my"), text
    # The reply continues the message: what a completion of exactly those tokens says.
    kw = dict(model=MODEL, max_tokens=8, temperature=0)
    c = client.chat.completions.create(messages=chat, extra_body=open_, **kw).choices[0]
    assert c.message.content == client.completions.create(prompt=ids, **kw).choices[0].text
    closed = client.chat.completions.create(messages=chat, **kw).choices[0]
    assert closed.message.content != c.message.content


def test_unsupported_content_parts_are_named(client):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=image)
    assert "content parts of type `image_url` are not supported" in str(e.value), e.value
    assert "Some(" not in str(e.value)


@pytest.mark.parametrize("kw,param", [
    (dict(extra_body={"continue_final_message": True, "add_generation_prompt": True}), "continue_final_message"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(response_format={"type": "json_schema"}), "response_format"),
    (dict(n=0), "n"),
    (dict(top_p=0.0), "top_p"),
    (dict(response_format={"type": 5}), "response_format"),
    (dict(extra_body={"stop_token_ids": [10 ** 9]}), "stop_token_ids"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages"),
    (dict(extra_body={"bad_words": "cat"}), "bad_words"),
    (dict(stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs"),
])
def test_bad_chat_requests_get_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": MODEL, "messages": ASK, **kw})
    assert param in str(e.value)


def test_prompt_logprobs_on_chat_and_completions(client, server):
    ids = requests.post(server.url + "/tokenize", json={"messages": ASK}).json()["tokens"]
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body={"prompt_logprobs": 2})
    lps = r.model_extra["prompt_logprobs"]
    assert len(lps) == len(ids) == r.usage.prompt_tokens and lps[0] is None
    for tok, entry in zip(ids[1:], lps[1:]):
        assert str(tok) in entry and 2 <= len(entry) <= 3, entry
        assert all(e["logprob"] <= 0 and e["rank"] >= 1 and isinstance(e["decoded_token"], str) for e in entry.values())
    c = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 0})
    same = c.choices[0].model_extra["prompt_logprobs"]
    assert [None if e is None else e[str(t)]["logprob"] for t, e in zip(ids, same)][1:] == \
        pytest.approx([e[str(t)]["logprob"] for t, e in zip(ids[1:], lps[1:])], abs=1e-4)


def test_bad_words_are_never_generated(client):
    kw = dict(model=MODEL, prompt="The three primary colors are", max_tokens=24, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    words = [w.strip(".,;:") for w in text.split() if len(w.strip(".,;:")) >= 4]
    assert words, text
    banned = words[:2]
    again = client.completions.create(**kw, extra_body={"bad_words": banned}).choices[0].text
    assert again != text
    for w in banned:
        assert f" {w}" not in again and not again.startswith(w), (banned, again)


def test_other_bad_requests(client, server):
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="hello " * 3000, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=MODEL, prompt="def f(", suffix="return x", max_tokens=5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=ASK)
    r = requests.post(server.url + "/v1/chat/completions", data="{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert requests.get(server.url + "/health").status_code == 200


def test_tools_are_accepted_and_output_is_never_empty(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, max_tokens=20, temperature=0)
    m = r.choices[0].message
    assert m.content or m.tool_calls


def metric(server, name):
    for line in requests.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_disconnect_aborts_and_frees_blocks(server):
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with requests.post(server.url + "/v1/completions", json=body, stream=True) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.time() + 5
    while time.time() < deadline:
        if metric(server, "vllm:num_requests_running") == 0 and metric(server, "vllm:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.05)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0


def test_metrics_have_vllm_names(server, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    text = requests.get(server.url + "/metrics").text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_sum"]:
        assert name in text, name
    assert metric(server, "vllm:generation_tokens_total") > 0


def test_usage_equals_tokenizer_counts(client, server):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    t = requests.post(server.url + "/tokenize", json={"messages": ASK}).json()
    assert r.usage.prompt_tokens == t["count"]
    out = requests.post(server.url + "/tokenize", json={"prompt": r.choices[0].message.content, "add_special_tokens": False}).json()
    # The completion's own tokens re-tokenize to the same count (EOS is not part of the text).
    assert r.usage.completion_tokens in (out["count"], out["count"] + 1)


def test_greedy_output_equals_ferrite_generate(client):
    prompt = "The three primary colors are"
    cli = subprocess.run([BINARY, "generate", MODEL_PATH, "--prompt", prompt, "--max-tokens", "24",
                          "--kv-cache-memory", str(100 << 20), "--max-model-len", "2048", "--log-level", "error"],
                         capture_output=True, text=True, check=True).stdout
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert cli.rstrip("\n") == r.choices[0].text
    chat_cli = subprocess.run([BINARY, "generate", MODEL_PATH, "--chat", "--prompt", ASK[0]["content"], "--max-tokens", "24",
                               "--kv-cache-memory", str(100 << 20), "--max-model-len", "2048", "--log-level", "error"],
                              capture_output=True, text=True, check=True).stdout
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0)
    assert chat_cli.rstrip("\n") == r.choices[0].message.content


def test_32_concurrent_streams_and_16_disconnects_leave_nothing_behind(server, client):
    results = [None] * 32

    def run(i):
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Write a line about the number {i}."}],
            max_tokens=16, temperature=0.7, seed=i, stream=True)
        text, finish = "", None
        for c in chunks:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
        results[i] = (text, finish)

    def disconnect(i):
        body = {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with requests.post(server.url + "/v1/completions", json=body, stream=True) as r:
            lines = r.iter_lines()
            for _ in range(2):
                next(lines)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    threads += [threading.Thread(target=disconnect, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(r is not None and r[0] and r[1] in ("stop", "length") for r in results), results
    deadline = time.time() + 10
    while time.time() < deadline and (metric(server, "vllm:num_requests_running") or metric(server, "vllm:kv_cache_usage_perc")):
        time.sleep(0.05)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:num_requests_waiting") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0
    assert requests.get(server.url + "/health").status_code == 200


def test_oversized_body_and_unknown_route(server):
    r = requests.post(server.url + "/v1/completions", data=b"x" * (33 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    r = requests.get(server.url + "/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = requests.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "MethodNotAllowedError"


def test_browsers_may_call_the_api(server):
    # CORS as vLLM's default (--allowed-origins '*'): the preflight and the answer allow the origin.
    origin = {"Origin": "http://localhost:3000"}
    pre = requests.options(server.url + "/v1/chat/completions", headers={
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == "*"
    assert "POST" in pre.headers["access-control-allow-methods"] or pre.headers["access-control-allow-methods"] == "*"
    r = requests.get(server.url + "/v1/models", headers=origin)
    assert r.headers["access-control-allow-origin"] == "*"


def test_huge_prompts_and_prompt_lists_are_refused_before_any_work(client, server):
    import threading, time
    # 20 MB of text cannot fit 2,048 tokens: refused without tokenizing it, and /health
    # answers meanwhile (tokenization runs off the async runtime).
    slow = []
    def poll():
        for _ in range(20):
            t = time.time()
            requests.get(server.url + "/health", timeout=10)
            slow.append(time.time() - t)
            time.sleep(0.05)
    t = threading.Thread(target=poll)
    t.start()
    with pytest.raises(openai.BadRequestError, match="more than a context of 2048 tokens"):
        client.completions.create(model=MODEL, prompt="word " * (4 << 20), max_tokens=1)
    t.join()
    assert max(slow) < 1.0, slow
    with pytest.raises(openai.BadRequestError, match="more than 1024 completions"):
        client.completions.create(model=MODEL, prompt=["hi"] * 600, n=2, max_tokens=1)


def test_a_vanishing_temperature_is_greedy_and_crashes_no_step(client):
    # 1 / 1e-40 overflows f32: such requests sample greedily (as vLLM below 1e-5), and
    # requests sharing their step are unharmed.
    import concurrent.futures
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=4)
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        tiny = pool.submit(client.completions.create, temperature=1e-40, extra_body={"min_p": 0.1}, **kw)
        others = [pool.submit(client.completions.create, temperature=0.8, seed=i, **kw) for i in range(4)]
        r = tiny.result()
        assert all(o.result().choices[0].finish_reason == "length" for o in others)
    greedy = client.completions.create(temperature=0, **kw)
    assert r.choices[0].text == greedy.choices[0].text


def test_api_key_tools_template_and_sigterm_drain():
    s = Server("--api-key", "sekrit", "--tool-call-parser", "hermes",
               "--chat-template", os.path.join(ROOT, "examples", "tool_chat_template_smollm2.jinja"))
    try:
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong")
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit")
        assert good.models.list().data[0].id == MODEL
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            good.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="auto")
        for route in ["/v1/completions", "/v1/chat/completions"]:
            assert requests.post(s.url + route, json={}).status_code == 401
        # Tools are rendered into the prompt by the chat template, and the call is answered.
        weather = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
        auth = {"Authorization": "Bearer sekrit"}
        body = {"messages": ASK, "tools": weather}
        ids = requests.post(s.url + "/tokenize", json=body, headers=auth).json()["tokens"]
        rendered = requests.post(s.url + "/detokenize", json={"tokens": ids}, headers=auth).json()["prompt"]
        assert "get_weather" in rendered and '"city"' in rendered
        r = good.chat.completions.create(model=MODEL, messages=ASK, tools=weather, tool_choice="required", max_tokens=30, temperature=0)
        m = r.choices[0].message
        assert (m.content or m.tool_calls) and r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        # SIGTERM: the in-flight stream completes, then the process exits cleanly.
        stream = good.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, stream=True,
                                         extra_body={"ignore_eos": True})
        it = iter(stream)
        first = next(it)
        s.proc.send_signal(signal.SIGTERM)
        rest = list(it)
        assert rest[-1].choices[0].finish_reason == "length"
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
        assert text
        assert s.proc.wait(timeout=30) == 0
    finally:
        if s.proc.poll() is None:
            s.stop()
        else:
            s.log.close()


def test_shutdown_is_bounded_by_the_drain_timeout_and_a_second_signal():
    import socket, time
    # A connection that sent half its headers would hold a graceful shutdown forever.
    s = Server("--drain-timeout", "2")
    try:
        half = socket.create_connection(("127.0.0.1", s.port))
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.2)
        t = time.time()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=15) == 0
        assert 1.5 < time.time() - t < 10
        half.close()
    finally:
        if s.proc.poll() is None:
            s.stop()
        s.log.close()
    # A second signal ends the drain of a long stream at once.
    s = Server()
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused")
        stream = iter(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1500,
                                                stream=True, extra_body={"ignore_eos": True}))
        next(stream)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert s.proc.poll() is None  # still draining the stream
        t = time.time()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(timeout=10)
        assert time.time() - t < 5
    finally:
        if s.proc.poll() is None:
            s.stop()
        s.log.close()


def test_bench_serve_numbers_match_the_server(server, tmp_path):
    before_gen = metric(server, "vllm:generation_tokens_total")
    before_prompt = metric(server, "vllm:prompt_tokens_total")
    out = tmp_path / "res.json"
    subprocess.run([BINARY, "bench", "serve", "--base-url", server.url + "/v1", "--model-name", MODEL,
                    "--tokenizer", MODEL_PATH, "--dataset", "random", "--num-prompts", "6", "--input-len", "64",
                    "--max-tokens", "5", "--ignore-eos", "--concurrency", "1,3", "--warmup", "0",
                    "--out", str(out)], check=True, capture_output=True)
    report = json.loads(out.read_text())
    assert [l["concurrency"] for l in report["levels"]] == [1, 3]
    for level in report["levels"]:
        assert level["completed"] == 6 and level["failed"] == 0
        assert level["total_output_tokens"] == 30
        assert level["total_input_tokens"] == 6 * 64
        assert level["mean_ttft_s"] > 0 and level["mean_e2e_s"] >= level["mean_ttft_s"]
    # What the benchmark counted is what the server counted.
    assert metric(server, "vllm:generation_tokens_total") - before_gen == 60
    assert metric(server, "vllm:prompt_tokens_total") - before_prompt == 2 * 6 * 64
    for chart in ["ttft.svg", "throughput.svg", "itl.svg"]:
        assert (tmp_path / chart).read_text().startswith("<svg")


def test_prefix_cache_metrics_n_sharing_and_reset(server, client):
    assert requests.post(server.url + "/reset_prefix_cache").status_code == 200
    msgs = [{"role": "user", "content": "Summarize the plot of a long novel about a lighthouse keeper. " * 6}]
    h0, q0 = metric(server, "vllm:prefix_cache_hits_total"), metric(server, "vllm:prefix_cache_queries_total")
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, n=2, temperature=1.0, seed=1)
    assert len(r.choices) == 2
    prompt = r.usage.prompt_tokens
    # The second choice starts once the first has computed the prompt: all its full blocks hit.
    assert metric(server, "vllm:prefix_cache_queries_total") - q0 == 2 * prompt
    assert metric(server, "vllm:prefix_cache_hits_total") - h0 == (prompt - 1) // 16 * 16
    # A repeat of the same prompt hits too; after a reset it does not.
    h1 = metric(server, "vllm:prefix_cache_hits_total")
    client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert metric(server, "vllm:prefix_cache_hits_total") > h1
    assert requests.post(server.url + "/reset_prefix_cache").status_code == 200
    h2 = metric(server, "vllm:prefix_cache_hits_total")
    client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert metric(server, "vllm:prefix_cache_hits_total") == h2

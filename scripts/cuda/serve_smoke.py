"""Serving on the GPU end to end: `ferrite serve --device cuda` answers chat completions
(whole and streamed), rejects a bad request with OpenAI-shaped JSON, and serves 32 concurrent
requests. Standard library only (the GPU host has no network for pip).
Usage: python3 serve_smoke.py BASE_URL"""
import json
import sys
import threading
import time
import urllib.error
import urllib.request

base = sys.argv[1]


def post(route, body, stream=False):
    req = urllib.request.Request(base + route, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            data = r.read().decode()
            return r.status, data if stream else json.loads(data)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


with urllib.request.urlopen(base + "/v1/models") as r:
    model = json.loads(r.read())["data"][0]["id"]
msgs = [{"role": "user", "content": "What is the capital of France?"}]
status, whole = post("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 24,
                                              "temperature": 0})
assert status == 200, whole
text = whole["choices"][0]["message"]["content"]
print(f"whole: {status} {text!r} usage={whole['usage']}")
status, sse = post("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 24,
                                            "temperature": 0, "stream": True}, stream=True)
chunks = [json.loads(l[6:]) for l in sse.splitlines() if l.startswith("data: {")]
streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
assert status == 200 and sse.rstrip().endswith("data: [DONE]"), sse[-200:]
assert streamed == text, (streamed, text)
print(f"streamed: {len(chunks)} chunks, same text as whole")
status, err = post("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": -3})
assert status == 400 and "error" in err, (status, err)
print(f"bad request: {status} {err['error']['message']!r}")

seeded = [post("/v1/completions", {"model": model, "prompt": "The sea was", "max_tokens": 32,
                                   "temperature": 1.0, "seed": 42})[1]["choices"][0]["text"]
          for _ in range(2)]
assert seeded[0] == seeded[1], seeded
print(f"seeded sampling (temperature 1, seed 42) twice: same {len(seeded[0])} characters")

results = []


def one(i):
    t0 = time.time()
    s, r = post("/v1/completions", {"model": model, "prompt": f"Story number {i}: once upon a time",
                                    "max_tokens": 64, "temperature": 0.8, "top_p": 0.9,
                                    "top_k": 40, "seed": i})
    results.append((s, r["usage"]["completion_tokens"] if s == 200 else 0, time.time() - t0))


t0 = time.time()
threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
[t.start() for t in threads]
[t.join() for t in threads]
wall = time.time() - t0
assert all(s == 200 for s, _, _ in results), results
tokens = sum(n for _, n, _ in results)
print(f"32 concurrent completions: all 200, {tokens} tokens in {wall:.2f} s ({tokens / wall:.0f} tok/s)")

# Structured output drawn on the GPU: 16 concurrent sampled requests under a JSON schema (the
# decode graphs replay with masks) and a choice; every output parses and keeps to the schema.
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}
outs = []


def constrained(i):
    s, r = post("/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": f"Item {i} as JSON"}], "max_tokens": 80,
        "temperature": 1.0, "seed": i,
        "response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": schema}}})
    outs.append((s, r))


threads = [threading.Thread(target=constrained, args=(i,)) for i in range(16)]
[t.start() for t in threads]
[t.join() for t in threads]
for s, r in outs:
    assert s == 200, r
    c = r["choices"][0]
    v = json.loads(c["message"]["content"])
    assert c["finish_reason"] == "stop" and set(v) == {"name", "n", "ok"}, c
    assert len(v["name"]) <= 10 and 0 <= v["n"] <= 99 and isinstance(v["ok"], bool), v
s, r = post("/v1/completions", {"model": model, "prompt": "Weather:", "max_tokens": 8, "n": 4,
                                "temperature": 1.0, "seed": 5, "guided_choice": ["sunny", "rainy"]})
assert s == 200 and all(c["text"] in ("sunny", "rainy") for c in r["choices"]), r
print(f"structured output on the device: 16 schema-constrained replies valid, e.g. {outs[0][1]['choices'][0]['message']['content']}; choice {[c['text'] for c in r['choices']]}")

"""Reliability of `ferrite serve` under hostile and careless clients, on the real model: a burst
on a small pool, waves of clients that leave before their first token, a seeded fuzzer driven by
the server's own OpenAPI document over every route, a full queue, idle and half-sent connections."""
import concurrent.futures
import json
import random
import socket
import threading
import time

import requests

from conftest import Server

MODEL = "smol"


def metrics(server):
    out = {}
    for line in requests.get(server.url + "/metrics").text.splitlines():
        if line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        key = name.split("{")[0]
        if 'finished_reason="' in name:
            key += ":" + name.split('finished_reason="')[1].split('"')[0]
        out[key] = float(value)
    return out


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024


def wait_idle(server, timeout=15):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = metrics(server)
        if m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"the engine is still busy: {metrics(server)}")


def greedy(server):
    r = requests.post(server.url + "/v1/completions",
                      json={"prompt": "The three primary colors are", "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_burst_on_a_small_pool_completes_and_memory_stays_put():
    # 20 MiB of KV: ~900 tokens, room for about 16 of these requests at once.
    s = Server(kv_bytes=20 << 20, max_model_len=256)
    try:
        peaks = []
        for burst in range(2):
            peak = [rss_mib(s.proc.pid)]
            done = threading.Event()

            def sample():
                while not done.is_set():
                    peak.append(rss_mib(s.proc.pid))
                    time.sleep(0.05)

            sampler = threading.Thread(target=sample)
            sampler.start()

            def one(i):
                body = {"prompt": f"Request {i} of burst {burst}: tell a short story about the number {i}.",
                        "max_tokens": 24, "temperature": 0.8, "seed": i}
                return requests.post(s.url + "/v1/completions", json=body, timeout=300)

            with concurrent.futures.ThreadPoolExecutor(64) as pool:
                replies = list(pool.map(one, range(256)))
            done.set()
            sampler.join()
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200][:3]
            assert all(r.json()["choices"][0]["finish_reason"] in ("length", "stop") for r in replies)
            m = wait_idle(s)
            time.sleep(1)
            after = rss_mib(s.proc.pid)
            peaks.append(max(peak))
            print(f"burst {burst}: 256 completed, RSS peak {max(peak):.1f} MiB, after {after:.1f} MiB, "
                  f"preemptions {m['vllm:num_preemptions_total']:.0f}")
            assert after <= max(peak) * 1.05
            assert after >= max(peak) * 0.95, "RSS fell far below its peak: memory is not reserved up front"
        # A second burst takes no more memory than the first.
        assert peaks[1] <= peaks[0] * 1.05, peaks
    finally:
        s.stop()


def test_clients_that_leave_while_queued_cost_no_prompt_work():
    s = Server()
    try:
        before = metrics(s)
        rng = random.Random(7)
        after_leaving = 0

        def send(stream):
            # ~1,400 tokens of words no other request shares (no prefix-cache hits).
            text = " ".join(f"w{rng.randrange(10 ** 6)}" for _ in range(200))
            body = json.dumps({"prompt": text, "max_tokens": 64, "stream": stream}).encode()
            c = socket.create_connection(("127.0.0.1", s.port))
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            return c

        for wave in range(3):
            # 20 clients, half of them streaming, leave once their requests are in the engine.
            conns = [send(i % 2 == 0) for i in range(20)]
            deadline = time.time() + 20
            while time.time() < deadline:
                m = metrics(s)
                if m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == 20:
                    break
                time.sleep(0.01)
            assert m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == 20, m
            at_close = m["ferrite:prompt_tokens_computed_total"]
            for c in conns:
                c.close()
            m = wait_idle(s, timeout=10)
            # What was computed once they had left: at most the step running at that moment.
            after_leaving += m["ferrite:prompt_tokens_computed_total"] - at_close
            print(f"wave {wave}: running {m['vllm:num_requests_running']:.0f}, waiting "
                  f"{m['vllm:num_requests_waiting']:.0f}, KV {m['vllm:kv_cache_usage_perc']:.3f}")
        m = metrics(s)
        sent = m["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
        computed = m["ferrite:prompt_tokens_computed_total"] - before["ferrite:prompt_tokens_computed_total"]
        aborted = m["vllm:request_success_total:abort"] - before["vllm:request_success_total:abort"]
        print(f"prompt tokens of the 60 requests: {sent:.0f} sent, {computed:.0f} computed while their clients "
              f"waited, {after_leaving:.0f} after they had left ({after_leaving / sent:.1%}); {aborted:.0f} aborts counted")
        assert sent > 60 * 1000
        assert after_leaving < 0.05 * sent
        assert aborted == 60
        assert greedy(s)
    finally:
        s.stop()


def fuzz_value(rng, schema, depth=0):
    """A value for `schema`, right or (often) wrong."""
    wrong = [None, -1, 0, 1e308, -1e308, 2 ** 63, "", "x" * rng.choice([1, 100, 50_000]), [], {}, [1, "a"],
             {"a": {"b": [None]}}, True, "\u0000\ud7ff\U0001f600", 3.5, "12"]
    if rng.random() < 0.2 or depth > 4:
        return rng.choice(wrong)
    if "oneOf" in schema:
        return fuzz_value(rng, rng.choice(schema["oneOf"]), depth + 1)
    if "enum" in schema:
        return rng.choice(schema["enum"] + ["nonsense"])
    t = schema.get("type")
    if t == "object":
        props = schema.get("properties", {})
        out = {}
        for k, sub in props.items():
            if k in schema.get("required", []) and rng.random() < 0.9 or rng.random() < 0.25:
                out[k] = fuzz_value(rng, sub, depth + 1)
        if rng.random() < 0.1:
            out["unknown_field"] = rng.choice(wrong)
        return out
    if t == "array":
        return [fuzz_value(rng, schema.get("items", {}), depth + 1) for _ in range(rng.choice([0, 1, 2, 3, 30]))]
    if t == "integer":
        lo = schema.get("minimum", -5)
        hi = schema.get("maximum", 64)
        return rng.choice([rng.randint(int(lo), int(min(hi, lo + 8))), lo - 1, hi + 1, 10 ** 12])
    if t == "number":
        return rng.choice([rng.uniform(-3, 3), 0.0, 1.0, 1e-40, 1e40, -0.0])
    if t == "boolean":
        return rng.random() < 0.5
    if t == "string":
        return rng.choice(["hello", "Say something.", "{", "<|im_end|>", "\\u0000", "é" * 20, "a" * 3000])
    return rng.choice(wrong + ["hello", 3])


def bounded(body):
    """Generation requests of the fuzzer ask for a few tokens (the point is the input, not long
    outputs): every output-length field that is a valid small number stays so."""
    if isinstance(body, dict):
        for k in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            v = body.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 2 ** 31 and v > 8:
                body[k] = 8
        if not any(k in body for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")):
            body["max_tokens" if "input" not in body else "max_output_tokens"] = 4
        body.pop("ignore_eos", None)
        body.pop("min_tokens", None)
    return body


def is_error_json(path, r):
    try:
        j = r.json()
    except ValueError:
        return False
    if path == "/v1/messages":
        return j.get("type") == "error" and isinstance(j.get("error", {}).get("message"), str)
    return isinstance(j.get("error"), dict) and isinstance(j["error"].get("message"), str)


def test_seeded_fuzzer_over_every_route_of_the_openapi_document(server):
    doc = requests.get(server.url + "/openapi.json").json()
    ops = [(p, m, op) for p, item in doc["paths"].items() for m, op in item.items()]
    # Every documented route answers (neither 404 nor 405).
    for path, method, _ in ops:
        r = requests.request(method.upper(), server.url + path, json={})
        assert r.status_code not in (404, 405), (path, method, r.status_code)
    expected = greedy(server)
    rng = random.Random(20261201)
    cases = []
    for i in range(2400):
        path, method, op = rng.choice(ops)
        schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
        kind = rng.random()
        headers = {"content-type": "application/json"}
        if kind < 0.05:
            data = bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 40, 2000])))
        elif kind < 0.1:
            data = rng.choice([b"{", b"[]", b"null", b"NaN", b'{"prompt": "a" "b"}', b'{"messages": [' * 200])
        elif kind < 0.13:
            method = rng.choice(["put", "delete", "patch", "get" if method == "post" else "post"])
            data = b"{}"
        else:
            data = json.dumps(bounded(fuzz_value(rng, schema)), allow_nan=True).encode()
            if kind < 0.16:
                headers = {"content-type": rng.choice(["text/plain", "application/x-www-form-urlencoded"])}
        cases.append((path, method, data, headers))

    def send(case):
        path, method, data, headers = case
        r = requests.request(method.upper(), server.url + path, data=data, headers=headers, timeout=120)
        _ = r.content  # streams are read to their end
        return path, method, r

    statuses = {}
    bad = []
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for path, method, r in pool.map(send, cases):
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code >= 500 or (r.status_code >= 400 and not is_error_json(path, r)):
                bad.append((path, method, r.status_code, r.text[:200]))
    print(f"fuzzer: {len(cases)} requests, statuses {dict(sorted(statuses.items()))}")
    assert not bad, bad[:5]
    assert statuses.get(200, 0) > 100 and statuses.get(400, 0) > 500
    assert requests.get(server.url + "/health").status_code == 200
    assert greedy(server) == expected
    wait_idle(server)


def test_a_full_queue_answers_503_with_retry_after():
    s = Server("--max-queued-requests", "4")
    try:
        r = requests.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 5})
        assert r.status_code == 503 and "max-queued-requests" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        r = requests.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 4})
        assert r.status_code == 200
    finally:
        s.stop()


def test_idle_and_half_sent_connections_are_closed_busy_ones_kept():
    s = Server("--timeout-keep-alive", "1", "--header-read-timeout", "3")

    def closed_after(sock):
        t = time.time()
        sock.settimeout(20)
        while sock.recv(4096):
            pass
        return time.time() - t

    try:
        half = socket.create_connection(("127.0.0.1", s.port))
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert closed_after(half) < 3.5
        idle = socket.create_connection(("127.0.0.1", s.port))
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert 0.5 < closed_after(idle) < 3
        # A stream longer than the idle timeout is not cut (1,000 tokens: seconds on any CPU).
        r = requests.post(s.url + "/v1/completions", stream=True,
                          json={"prompt": "Once", "max_tokens": 1000, "ignore_eos": True, "stream": True})
        t = time.time()
        chunks = [line for line in r.iter_lines() if line]
        assert time.time() - t > 1.5 and chunks[-1] == b"data: [DONE]"
    finally:
        s.stop()


def test_health_calls_a_step_that_runs_too_long_wedged():
    # A 1,500-token prefill in one step takes longer than 50 ms on any CPU.
    s = Server("--health-step-timeout", "0.05", "--max-num-batched-tokens", "2048")
    try:
        seen = []
        done = threading.Event()

        def poll():
            while not done.is_set():
                r = requests.get(s.url + "/health")
                seen.append((r.status_code, r.text))
                time.sleep(0.01)

        t = threading.Thread(target=poll)
        t.start()
        text = " ".join(f"w{i}" for i in range(500))
        r = requests.post(s.url + "/v1/completions", json={"prompt": text, "max_tokens": 1})
        done.set()
        t.join()
        assert r.status_code == 200
        wedged = [body for code, body in seen if code == 503]
        assert wedged and "wedged" in wedged[0], seen[:5]
        assert requests.get(s.url + "/health").status_code == 200
    finally:
        s.stop()

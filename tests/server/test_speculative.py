"""Speculative decoding through the real server: `--speculative-config` as vLLM takes it (n-gram,
and a draft model: the test model drafting for itself), the same greedy answers as the shared
server without it (streamed and not), vLLM's spec_decode metrics, and a clear start-up error
for a config it cannot serve."""
import json
import os
import subprocess

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from conftest import BINARY, MODEL, ROOT, Server

COPY = ("Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, "
        "honeydew, kiwi, lemon, mango. Again: apple, banana, cherry,")


@pytest.fixture(scope="module")
def spec_server():
    s = Server("--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}')
    yield s
    s.stop()


@pytest.fixture(scope="module")
def draft_server():
    s = Server("--speculative-config",
               json.dumps({"method": "draft_model", "model": MODEL, "num_speculative_tokens": 3}))
    yield s
    s.stop()


def completion(url, prompt, stream, **kw):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    if not stream:
        r = c.completions.create(model="smol", prompt=prompt, max_tokens=48, temperature=0, **kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    text, reason = "", None
    for chunk in c.completions.create(model="smol", prompt=prompt, max_tokens=48, temperature=0,
                                      stream=True, **kw):
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason, None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_answers_are_the_same_with_speculation(request, server, method, stream):
    spec_server = request.getfixturevalue({"ngram": "spec_server", "draft_model": "draft_server"}[method])
    for prompt, kw in [(COPY, {}), (COPY, {"stop": [" kiwi"]}), ("The three primary colors are", {})]:
        plain = completion(server.url, prompt, stream, **kw)
        spec = completion(spec_server.url, prompt, stream, **kw)
        assert spec == plain, (prompt, kw)
        if kw:
            assert spec[1] == "stop" and "kiwi" not in spec[0]


def test_the_plan_line_states_the_draft_models_share(draft_server):
    log = open(draft_server.log.name).read()
    assert "of these, the draft model's: weights" in log, log
    assert "draft model:" in log  # the backend line names the draft's backend too


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_spec_decode_metrics(request, method):
    spec_server = request.getfixturevalue({"ngram": "spec_server", "draft_model": "draft_server"}[method])
    completion(spec_server.url, COPY, False)
    text = requests.get(spec_server.url + "/metrics", timeout=10).text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    drafts = samples["vllm:spec_decode_num_drafts_total"]
    drafted = samples["vllm:spec_decode_num_draft_tokens_total"]
    accepted = samples["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and drafted >= drafts and 0 < accepted <= drafted
    per_pos = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert sorted(int(s.labels["position"]) for s in per_pos) == list(range(len(per_pos)))
    assert sum(s.value for s in per_pos) == accepted


@pytest.mark.parametrize("config,message", [
    ('{"method": "eagle", "num_speculative_tokens": 1}', "not served by ferrite yet"),
    ('{"method": "mtp", "num_speculative_tokens": 1}', "this family has no multi-token-prediction head"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be 1 to"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', "unknown field `lookahead`"),
    ("ngram", "not a speculative config"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "needs a `model`"),
    ('{"method": "draft_model", "model": "/nonexistent.gguf", "num_speculative_tokens": 3}', "/nonexistent.gguf"),
])
def test_a_config_it_cannot_serve_is_refused_at_start(config, message):
    r = subprocess.run([BINARY, "serve", MODEL, "--speculative-config", config],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_a_draft_model_with_another_tokenizer_is_refused():
    gemma = subprocess.check_output([os.path.join(ROOT, "scripts", "fetch-model.sh"), "gemma3"], text=True).strip()
    config = json.dumps({"method": "draft_model", "model": gemma, "num_speculative_tokens": 3})
    r = subprocess.run([BINARY, "serve", MODEL, "--speculative-config", config, "--kv-cache-memory", "100000000"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "tokenizer is not the target's" in r.stderr, r.stderr

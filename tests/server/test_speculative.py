"""Speculative decoding through the real server: `--speculative-config` as vLLM takes it, the
same greedy answers as the shared server without it (streamed and not), vLLM's spec_decode
metrics, and a clear start-up error for a config it cannot serve."""
import subprocess

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from conftest import BINARY, MODEL, Server

COPY = ("Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, "
        "honeydew, kiwi, lemon, mango. Again: apple, banana, cherry,")


@pytest.fixture(scope="module")
def spec_server():
    s = Server("--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}')
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
def test_greedy_answers_are_the_same_with_speculation(server, spec_server, stream):
    for prompt, kw in [(COPY, {}), (COPY, {"stop": [" kiwi"]}), ("The three primary colors are", {})]:
        plain = completion(server.url, prompt, stream, **kw)
        spec = completion(spec_server.url, prompt, stream, **kw)
        assert spec == plain, (prompt, kw)
        if kw:
            assert spec[1] == "stop" and "kiwi" not in spec[0]


def test_spec_decode_metrics(spec_server):
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
    ('{"method": "mtp", "num_speculative_tokens": 1}', "not served by ferrite yet"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be 1 to"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', "unknown field `lookahead`"),
    ("ngram", "not a speculative config"),
])
def test_a_config_it_cannot_serve_is_refused_at_start(config, message):
    r = subprocess.run([BINARY, "serve", MODEL, "--speculative-config", config],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and message in r.stderr, r.stderr

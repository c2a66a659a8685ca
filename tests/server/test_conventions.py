"""vLLM's conventions on the real server: `--model`, `--root-path`, CORS flags, request logs,
`--dtype`, and a Prometheus scrape read by the official `prometheus_client` parser with every
vLLM metric name a dashboard reads."""
import subprocess

import requests
from prometheus_client.parser import text_string_to_metric_families

from conftest import BINARY, MODEL, Server

VLLM_NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:request_success",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:iteration_tokens_total", "vllm:time_per_output_token_seconds", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:cache_config_info",
]


def test_prometheus_scrape_has_every_vllm_name(server, client):
    client.completions.create(model="smol", prompt="Hello there", max_tokens=4)
    families = {f.name: f for f in text_string_to_metric_families(requests.get(server.url + "/metrics").text)}
    missing = [n for n in VLLM_NAMES if n not in families]
    assert not missing, (missing, sorted(families))
    samples = {s.name: s for f in families.values() for s in f.samples}
    assert samples["vllm:request_prompt_tokens_count"].value >= 1
    assert samples["vllm:iteration_tokens_total_count"].value >= 1
    cache = families["vllm:cache_config_info"].samples[0]
    assert cache.labels["block_size"] == "16" and int(cache.labels["num_gpu_blocks"]) > 0


def test_model_flag_root_path_cors_flags_and_request_logs():
    s = Server("--root-path", "/api", "--enable-log-requests", "--allow-credentials",
               "--allowed-methods", "GET,POST", model=None)
    try:
        assert requests.get(s.url + "/api/v1/models").json()["data"][0]["id"] == "smol"
        r = requests.post(s.url + "/api/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200
        pre = requests.options(s.url + "/v1/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        assert pre.headers["access-control-allow-credentials"] == "true"
        assert "POST" in pre.headers["access-control-allow-methods"]
        log = open(s.log.name).read()
        assert "received: 1 prompt tokens" in log and "finished (length)" in log
    finally:
        s.stop()


def test_dtype_is_honoured_or_refused():
    run = lambda *a: subprocess.run([BINARY, "generate", MODEL, "--prompt", "Hi", "--max-tokens", "2",
                                     "--kv-cache-memory", str(50 << 20), "--max-model-len", "256", *a],
                                    capture_output=True, text=True)
    for half in ["float16", "half"]:
        r = run("--dtype", half)
        assert r.returncode != 0 and f"invalid value '{half}' for '--dtype" in r.stderr, r.stderr
        assert "computes in no float16 type" in r.stderr, r.stderr
    r = run("--dtype", "bfloat16")
    assert r.returncode != 0 and "--dtype bfloat16 is not a type the CPU backend computes in" in r.stderr
    r = run("--dtype", "float32", "--log-level", "info")
    assert r.returncode == 0 and "weights F32" in r.stderr


def test_the_grafana_dashboard_reads_only_metrics_the_server_has(server):
    import json
    import os
    import re
    from conftest import ROOT
    dash = json.load(open(os.path.join(ROOT, "docs", "grafana", "ferrite-vllm.json")))
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"vllm:[a-z0-9_]+", e)}
    scraped = {s.name for f in text_string_to_metric_families(requests.get(server.url + "/metrics").text)
               for s in f.samples}
    assert names and not names - scraped, names - scraped

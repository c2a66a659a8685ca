"""Embedding models through the real server and the official `openai` client:
all-MiniLM-L6-v2 (scripts/fetch-model.sh minilm) against sentence-transformers' own vectors,
and a tiny random Qwen3 with last-token pooling (Qwen3-Embedding's shape) against
transformers (both written by tests/oracle/make_embedding_fixture.py); `/v1/score` and
`/v1/rerank` by cosine; the errors a client can cause."""
import base64
import concurrent.futures
import json
import math
import os
import struct
import subprocess

import openai
import pytest
import requests

from conftest import ROOT, Server

FIXTURE = json.load(open(os.path.join(ROOT, "tests", "oracle", "embedding_fixture.json")))
MINILM = FIXTURE["minilm"]


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


@pytest.fixture(scope="module")
def minilm():
    path = subprocess.check_output([os.path.join(ROOT, "scripts", "fetch-model.sh"), "minilm"], text=True).strip()
    s = Server(model=path, name="minilm", max_model_len=256)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(minilm):
    return openai.OpenAI(base_url=minilm.url + "/v1", api_key="unused")


def test_embeddings_match_sentence_transformers(client):
    # The client asks for base64 unless told otherwise: both encodings are checked.
    r = client.embeddings.create(model="minilm", input=MINILM["texts"])
    assert [d.index for d in r.data] == list(range(len(MINILM["texts"])))
    for d, want in zip(r.data, MINILM["embeddings"]):
        assert len(d.embedding) == 384
        assert cosine(d.embedding, want) >= 0.9999, (d.index, cosine(d.embedding, want))
    assert r.usage.prompt_tokens == sum(len(i) for i in MINILM["token_ids"])
    floats = client.embeddings.create(model="minilm", input=MINILM["texts"], encoding_format="float")
    for a, b in zip(r.data, floats.data):
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding)) < 1e-6


def test_base64_is_little_endian_f32(minilm):
    body = {"input": "hello world", "encoding_format": "base64"}
    raw = requests.post(minilm.url + "/v1/embeddings", json=body).json()["data"][0]["embedding"]
    vec = struct.unpack("<384f", base64.b64decode(raw))
    floats = requests.post(minilm.url + "/v1/embeddings", json={"input": "hello world"}).json()
    assert list(vec) == pytest.approx(floats["data"][0]["embedding"], abs=1e-7)
    assert floats["object"] == "list" and floats["model"] == "minilm"


def test_token_ids_and_batches_give_the_same_vectors(client):
    one = client.embeddings.create(model="minilm", input=MINILM["texts"][2]).data[0].embedding
    ids = client.embeddings.create(model="minilm", input=MINILM["token_ids"][2]).data[0].embedding
    assert cosine(one, ids) > 0.999999
    # Many at once share steps; each vector is its own text's.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda t: client.embeddings.create(model="minilm", input=t).data[0].embedding,
                             MINILM["texts"] * 4))
    for v, want in zip(outs, MINILM["embeddings"] * 4):
        assert cosine(v, want) >= 0.9999


def test_dimensions_cut_and_renormalize(client):
    full = client.embeddings.create(model="minilm", input="hello world").data[0].embedding
    cut = client.embeddings.create(model="minilm", input="hello world", dimensions=128).data[0].embedding
    assert len(cut) == 128
    assert math.isclose(math.sqrt(sum(x * x for x in cut)), 1.0, rel_tol=1e-5)
    assert cosine(cut, full[:128]) > 0.99999


def test_score_and_rerank_are_cosines(minilm):
    texts, vecs = MINILM["texts"], MINILM["embeddings"]
    r = requests.post(minilm.url + "/v1/score", json={"model": "minilm", "text_1": texts[1], "text_2": texts[2:5]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
    for d, j in zip(body["data"], [2, 3, 4]):
        assert d["object"] == "score"
        assert d["score"] == pytest.approx(cosine(vecs[1], vecs[j]), abs=1e-4)
    pairwise = requests.post(minilm.url + "/score", json={"text_1": texts[:2], "text_2": texts[2:4]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        [cosine(vecs[0], vecs[2]), cosine(vecs[1], vecs[3])], abs=1e-4)
    query, docs = "Which city is the capital of France?", [texts[1], texts[4], texts[2]]
    for route in ["/v1/rerank", "/rerank", "/v2/rerank"]:
        rr = requests.post(minilm.url + route, json={"model": "minilm", "query": query, "documents": docs, "top_n": 2})
        assert rr.status_code == 200, rr.text
        res = rr.json()["results"]
        assert len(res) == 2 and res[0]["index"] == 1, res  # the Paris text
        assert res[0]["relevance_score"] >= res[1]["relevance_score"]
        assert res[0]["document"] == {"text": docs[1]}
    cohere = requests.post(minilm.url + "/v2/rerank", json={"query": query, "documents": [{"text": d} for d in docs],
                                                             "return_documents": False}).json()
    assert [r["index"] for r in cohere["results"]][0] == 1 and "document" not in cohere["results"][0]
    assert cohere["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("body,param,status", [
    ({"input": "hi", "dimensions": 0}, "dimensions", 400),
    ({"input": "hi", "dimensions": 385}, "dimensions", 400),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format", 400),
    ({"input": []}, "input", 400),
    ({"input": "hi", "model": "other"}, "model", 404),
])
def test_bad_embedding_requests_say_what_is_wrong(minilm, body, param, status):
    r = requests.post(minilm.url + "/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_inputs_past_the_context_are_refused_and_no_kv_is_kept(minilm):
    r = requests.post(minilm.url + "/v1/embeddings", json={"input": "word " * 400})
    assert r.status_code == 400 and "maximum input length is 256 tokens" in r.json()["error"]["message"], r.text
    bad = requests.post(minilm.url + "/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert bad.status_code == 400 and "text_1" in bad.json()["error"]["message"]
    gen = requests.post(minilm.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert gen.status_code == 400 and "embedding model" in gen.json()["error"]["message"]
    metrics = requests.get(minilm.url + "/metrics").text
    usage = [l for l in metrics.splitlines() if l.startswith("vllm:kv_cache_usage_perc")]
    assert usage and float(usage[0].split()[-1]) == 0.0, usage


def test_a_decoder_embedding_model_pools_its_last_token():
    tiny = FIXTURE["qwen3_embedding"]
    s = Server(model=os.path.join(ROOT, "tests", "oracle", "tiny", "qwen3_embedding"), name="tiny", max_model_len=256)
    try:
        for ids, want in zip(tiny["token_ids"], tiny["embeddings"]):
            r = requests.post(s.url + "/v1/embeddings", json={"input": ids}).json()
            got = r["data"][0]["embedding"]
            assert len(got) == 64 and cosine(got, want) >= 0.9999, cosine(got, want)
    finally:
        s.stop()


def test_a_generating_model_refuses_embeddings(server):
    r = requests.post(server.url + "/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and "does not serve embeddings" in r.json()["error"]["message"]


def test_a_cross_encoder_scores_pairs_as_transformers():
    cross = FIXTURE["bert_cross_encoder"]
    s = Server(model=os.path.join(ROOT, "tests", "oracle", "tiny", "bert_cross_encoder"), name="cross",
               max_model_len=64)
    try:
        a, b = [p[0] for p in cross["pairs"]], [p[1] for p in cross["pairs"]]
        r = requests.post(s.url + "/v1/score", json={"text_1": a, "text_2": b})
        assert r.status_code == 200, r.text
        got = [d["score"] for d in r.json()["data"]]
        assert got == pytest.approx(cross["scores"], abs=1e-4)
        # One query against each document: sorted by the pair's score.
        rr = requests.post(s.url + "/v1/rerank", json={"query": a[0], "documents": b}).json()
        pair_scores = requests.post(s.url + "/score", json={"text_1": a[0], "text_2": b}).json()["data"]
        want = sorted(range(len(b)), key=lambda j: -pair_scores[j]["score"])
        assert [x["index"] for x in rr["results"]] == want
        emb = requests.post(s.url + "/v1/embeddings", json={"input": "dog"})
        assert emb.status_code == 400 and "cross-encoder" in emb.json()["error"]["message"]
    finally:
        s.stop()

"""Gemma 3 270M (scripts/fetch-model.sh gemma3) served with the defaults: its GGUF carries no
chat template, so ferrite renders Gemma's turn format; the prompt must tokenize exactly as the
oracle rendered it and the greedy reply must be transformers' own (fixture written by
tests/oracle/make_fixture.py)."""
import json
import os
import subprocess

import openai
import pytest
import requests

from conftest import ROOT, Server

FIXTURE = json.load(open(os.path.join(ROOT, "tests", "oracle", "gemma3_fixture.json")))


@pytest.fixture(scope="module")
def gemma():
    path = subprocess.check_output([os.path.join(ROOT, "scripts", "fetch-model.sh"), "gemma3"], text=True).strip()
    s = Server(model=path, name="gemma")
    yield s
    s.stop()


def test_gemma_chat_uses_its_turn_format_and_answers_as_transformers(gemma):
    chat = FIXTURE["chat"]
    tokens = requests.post(gemma.url + "/tokenize", json={"messages": chat["messages"]}).json()["tokens"]
    assert tokens == chat["prompt_ids"]
    client = openai.OpenAI(base_url=gemma.url + "/v1", api_key="unused")
    n = len(chat["greedy_ids"])
    r = client.chat.completions.create(model="gemma", messages=chat["messages"], max_tokens=n, temperature=0)
    assert r.usage.prompt_tokens == len(chat["prompt_ids"])
    assert r.choices[0].message.content == chat["greedy_text"]

"""Starts the real `ferrite serve` binary on the real test model for the API tests."""
import os
import socket
import subprocess
import time

import pytest
import requests

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BINARY = os.path.join(ROOT, "target", "release", "ferrite")
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, url, log):
    """Until `url` answers /health (at most 2 minutes), failing with the log if `proc` ends."""
    deadline = time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, open(log).read()
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.3)
    raise RuntimeError("server did not become healthy: " + open(log).read())


class Server:
    def __init__(self, *extra, model=MODEL, name="smol", kv_bytes=200 << 20, max_model_len=2048,
                 launcher=(), address=None):
        """`launcher`: a command that starts the binary (mpirun); `address`: where the
        server is reached when not on this host's loopback (it then listens everywhere)."""
        self.port = free_port()
        self.url = f"http://{address or '127.0.0.1'}:{self.port}"
        self.log = open(os.path.join(ROOT, "target", f"serve-{self.port}.log"), "w")
        # model=None: the model given as vLLM's `--model` flag instead of the positional.
        where = ["--model", MODEL] if model is None else [model]
        listen = ["--host", "0.0.0.0"] if address else []
        self.proc = subprocess.Popen(
            [*launcher, BINARY, "serve", *where, *listen, "--port", str(self.port), "--served-model-name", name,
             "--max-model-len", str(max_model_len), "--kv-cache-memory", str(kv_bytes), "--seed", "0", *extra],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_healthy(self.proc, self.url, self.log.name)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="session")
def server():
    s = Server("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")

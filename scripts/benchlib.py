"""What the Python benchmarks share: the machine's CPU name, and a `ferrite serve` started on a
free port and waited for."""
import os
import platform
import socket
import subprocess
import tempfile
import time

import requests


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def start_server(binary, model, args, log_name, timeout=180):
    """`ferrite serve model --port P --served-model-name m *args`; (process, base URL) once healthy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(os.path.join(tempfile.gettempdir(), log_name), "w")
    proc = subprocess.Popen([binary, "serve", model, "--port", str(port), "--served-model-name", "m", *args],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: see {log.name}")
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not start")

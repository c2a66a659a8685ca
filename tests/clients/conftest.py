"""The real server for the third-party client tests (their own virtualenv: these clients pin
an `openai` newer than the API tests use)."""
import importlib.util
import os

import pytest

_spec = importlib.util.spec_from_file_location(
    "server_conftest", os.path.join(os.path.dirname(__file__), "..", "server", "conftest.py"))
_server = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_server)
Server = _server.Server


@pytest.fixture(scope="session")
def server():
    s = Server("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--chat-template", os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tool_chat_template_smollm2.jinja"))
    yield s
    s.stop()

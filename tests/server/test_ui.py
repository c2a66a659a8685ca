"""The chat page at `/`, end to end in headless Chromium (Debian's `chromium`, driven by
Playwright): it names the model, streams a reply from the real server, shows the live engine
state from /metrics, stops a reply mid-stream, and reports an API error in the page. A
screenshot of the page after a reply is written to target/ui.png (docs/ui.png is one)."""
import os
import shutil

import pytest
import requests

from conftest import ROOT, Server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    assert CHROMIUM, "needs Debian's chromium (scripts/test.sh installs it)"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def keyed():
    s = Server("--api-key", "sesame", "--root-path", "/api")
    yield s
    s.stop()


def test_the_page_is_served_as_html(server):
    r = requests.get(server.url + "/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<title>ferrite</title>" in r.text


def test_chat_streams_a_reply_with_live_state(server, browser):
    page = browser.new_page(viewport={"width": 1100, "height": 720})
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model').textContent.includes('smol')")
    assert page.locator("#version").inner_text().startswith("ferrite ")
    page.fill("#system", "You are terse.")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "24")
    page.fill("#input", "Name a prime number larger than 100.")
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.user")
    # The reply streams in, then the send button comes back.
    page.wait_for_function("document.querySelector('.msg.assistant').textContent.length > 0")
    page.wait_for_function("!document.getElementById('send').disabled", timeout=60000)
    reply = page.locator(".msg.assistant").inner_text()
    assert len(reply.strip()) > 0, reply
    # The same answer the API gives (greedy, same messages).
    api = requests.post(server.url + "/v1/chat/completions", json={
        "model": "smol", "temperature": 0, "top_p": 1, "max_tokens": 24,
        "messages": [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Name a prime number larger than 100."}]}, timeout=60).json()
    assert reply == api["choices"][0]["message"]["content"]
    # Live state: the generated-token counter counts what the page and the API asked for.
    page.wait_for_function("Number(document.getElementById('generated').textContent) > 0")
    assert page.locator("#kv").inner_text().endswith("%")
    assert page.locator("#running").inner_text() in {"0", "1"}
    page.screenshot(path=os.path.join(ROOT, "target", "ui.png"))
    # A second turn carries the first (the history is sent back).
    page.fill("#input", "And one larger than 200?")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelectorAll('.msg.assistant').length == 2")
    page.wait_for_function("!document.getElementById('send').disabled", timeout=60000)
    page.close()


def test_stop_ends_the_reply_and_the_server_aborts_it(server, browser):
    page = browser.new_page()
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model').textContent.includes('smol')")
    page.fill("#max_tokens", "1500")
    page.fill("#input", "Write a very long story about the sea.")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('.msg.assistant').textContent.length > 20")
    page.click("#stop")
    page.wait_for_function("document.querySelector('.msg.assistant').textContent.endsWith('[stopped]')")
    # The client went away: the engine stops generating for it.
    page.wait_for_function("document.getElementById('running').textContent === '0'", timeout=10000)
    page.close()


def test_api_key_and_root_path(keyed, browser):
    assert requests.get(keyed.url + "/api", timeout=10).status_code == 200
    page = browser.new_page()
    page.goto(keyed.url + "/api/")
    # Without the key the page says the model is unavailable and why.
    page.wait_for_function("document.getElementById('model').textContent.includes('unavailable')")
    page.fill("#input", "hello")
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.error")
    assert "API key" in page.locator(".msg.error").inner_text() or "401" in page.locator(".msg.error").inner_text()
    page.fill("#api_key", "sesame")
    page.dispatch_event("#api_key", "change")
    page.wait_for_function("document.getElementById('model').textContent.includes('smol')")
    page.fill("#max_tokens", "8")
    page.fill("#input", "hello")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelectorAll('.msg.assistant').length == 1")
    page.wait_for_function("!document.getElementById('send').disabled", timeout=60000)
    assert page.locator(".msg.assistant").inner_text().strip()
    page.close()

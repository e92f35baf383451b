"""The chat page at `/`: served as HTML with and without --api-key, same-origin only, and driven in
a real headless browser (Debian's chromium and chromium-driver through selenium; `make test`
installs them where apt-get exists, and the browser test skips, saying why, where they are not).
"""

from __future__ import annotations

import importlib.resources
import re
import shutil
import tempfile

import httpx
import pytest

from strata.server.testing import ServerProcess

KEY = "sk-strata-page"
MODEL = "tiny"
pytestmark = pytest.mark.slow


def _page_text() -> str:
    return (importlib.resources.files("strata.server") / "static" / "chat.html").read_text()


@pytest.fixture(scope="module")
def open_server(synth, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "open.log"
    with ServerProcess(synth("qwen3moe", "Q4_K_M"), ["--model-name", MODEL], log_path=log) as s:
        yield s


@pytest.fixture(scope="module")
def keyed_server(synth, tmp_path_factory):
    """With --api-key; its first engine crashes at its first decode step (then it restarts)."""
    tmp = tmp_path_factory.mktemp("serve")
    args = ["--model-name", MODEL, "--api-key", KEY, "--watchdog", "60",
            "--report-dir", str(tmp)]
    with ServerProcess(synth("qwen3moe", "Q4_K_M"), args, env={"STRATA_FAULT": "crash@decode:1"},
                       log_path=tmp / "keyed.log") as s:
        yield s


def _get_page(server: ServerProcess) -> httpx.Response:
    r = httpx.get(server.url + "/", timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    assert r.text == _page_text()
    assert "<title>Strata chat</title>" in r.text
    return r


def test_page_without_key(open_server):
    _get_page(open_server)
    assert f"strata: chat page: {open_server.url}/\n" in open_server.log()  # said at start
    assert httpx.head(open_server.url + "/", timeout=30).status_code == 200


def test_page_needs_no_key_but_the_api_does(keyed_server):
    _get_page(keyed_server)
    r = httpx.get(keyed_server.url + "/v1/models", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"


def test_page_is_same_origin_only():
    text = _page_text()
    assert re.findall(r"https?://", text) == []  # no other host, nor this one by name
    assert re.findall(r"(?:src|href)\s*=", text) == []  # no script, style or image from a file
    assert "@import" not in text and "url(" not in text
    fetched = re.findall(r"fetch\(\s*\"([^\"]*)\"", text)
    assert sorted(set(fetched)) == ["/health", "/v1/chat/completions"]


# --- the page in a real browser -------------------------------------------------------------------
def _driver():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                    "(pip install -e '.[test]')")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (make browser)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    profile = tempfile.mkdtemp(prefix="strata-chromium-")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    d = webdriver.Chrome(options=opts, service=Service(driver))
    d.set_page_load_timeout(30)
    return d, profile


@pytest.fixture()
def browser():
    d, profile = _driver()
    try:
        yield d
    finally:
        d.quit()
        shutil.rmtree(profile, ignore_errors=True)


def test_chat_in_a_browser(keyed_server, browser):
    """A wrong key, then the engine crashing mid-answer: each error shows in the conversation;
    New chat clears it; after the restart, an answer streams in with its tok/s line; the
    conversation survives a reload."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    d, s = browser, keyed_server
    wait = WebDriverWait(d, 60, poll_frequency=0.1)
    s.wait_health(lambda h: h["status"] == "ok", what="a loaded engine")
    d.get(s.url + "/")

    def health_ok(_):
        el = d.find_element(By.ID, "health")
        return el.get_attribute("data-status") == "ok" and MODEL in el.text

    def say(text: str, key: str) -> None:
        field = d.find_element(By.ID, "key")
        field.clear()
        field.send_keys(key)
        d.find_element(By.ID, "input").send_keys(text, Keys.ENTER)

    def errors() -> list[str]:
        return [e.text for e in d.find_elements(By.CSS_SELECTOR, ".msg.error")]

    wait.until(health_ok)
    d.find_element(By.ID, "max-tokens").send_keys("12")

    say("Hello", "sk-wrong")
    wait.until(lambda _: len(errors()) == 1)
    assert errors() == ["invalid API key"]

    say("Hello again", KEY)  # the first engine crashes at its first decode step
    wait.until(lambda _: len(errors()) == 2)
    assert "crash" in errors()[1], errors()
    s.wait_health(lambda h: h["status"] == "ok" and h["restarts"] == 1, what="a restart")
    wait.until(health_ok)

    assert errors() == ["invalid API key", errors()[1]]
    d.find_element(By.ID, "new").click()
    assert d.find_elements(By.CSS_SELECTOR, ".msg") == []
    d.execute_script(_IGNORE_EOS)  # random weights may end at once: have it run to max tokens
    say("Tell me a story", KEY)
    wait.until(lambda _: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]"))
    answer = d.find_element(By.CSS_SELECTOR, ".msg.assistant")
    assert answer.text.strip(), "no text streamed"
    assert int(answer.get_attribute("data-chunks")) > 1  # it came in pieces
    stats = d.find_element(By.CSS_SELECTOR, ".stats").text
    rate = r"12 tokens · \d+\.\d tok/s · first token after \d+\.\d\d s · cut at max tokens"
    assert re.fullmatch(rate, stats), stats

    stored = _stored_answer(d)
    assert stored == answer.get_attribute("textContent")

    d.refresh()  # kept in localStorage: the conversation and the key
    wait.until(health_ok)
    assert len(d.find_elements(By.CSS_SELECTOR, ".msg.user")) == 1
    assert d.find_element(By.CSS_SELECTOR, ".msg.assistant").get_attribute("textContent") == stored
    assert d.find_element(By.ID, "key").get_attribute("value") == KEY

    d.execute_script(_IGNORE_EOS)  # a long answer, stopped after a few pieces
    limit = d.find_element(By.ID, "max-tokens")
    limit.clear()
    limit.send_keys("3000")
    d.find_element(By.ID, "input").send_keys("Go on", Keys.ENTER)

    def second(attr: str) -> str | None:
        answers = d.find_elements(By.CSS_SELECTOR, ".msg.assistant")
        return answers[1].get_attribute(attr) if len(answers) > 1 else None

    wait.until(lambda _: int(second("data-chunks") or 0) >= 3)
    d.find_element(By.ID, "stop").click()
    wait.until(lambda _: second("data-done"))
    assert d.find_elements(By.CSS_SELECTOR, ".stats")[1].text.endswith(" · stopped")
    s.wait_health(lambda h: h["running"] == 0, timeout=30, what="the stopped answer cancelled")


# the test's own addition to the page's requests (the page sends no ignore_eos)
_IGNORE_EOS = """
const plain = window.fetch;
window.fetch = (url, init) => {
  if (url === "/v1/chat/completions")
    init = {...init, body: JSON.stringify({...JSON.parse(init.body), ignore_eos: true, seed: 1})};
  return plain(url, init);
};
"""


def _stored_answer(d) -> str:
    return d.execute_script(
        "return JSON.parse(localStorage.getItem('strata.chat.messages'))"
        ".find(m => m.role === 'assistant').content")


def test_reasoning_is_shown_folded_and_kept_out_of_the_history(open_server, browser):
    """A model's reasoning (delta.reasoning_content: gpt-oss's analysis channel) streams into a
    folded block above its answer, is kept with the conversation, and is not sent back as part
    of the history. The server's stream is stood in for by the page's own fetch, replaced."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    d, wait = browser, WebDriverWait(browser, 30, poll_frequency=0.1)
    d.get(open_server.url + "/")
    d.execute_script(_FAKE_STREAM)
    d.find_element(By.ID, "input").send_keys("Hi", Keys.ENTER)
    wait.until(lambda _: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]"))

    def shown() -> tuple[str, str, bool]:
        block = d.find_element(By.CSS_SELECTOR, "details.reasoning")
        return (block.find_element(By.TAG_NAME, "div").get_attribute("textContent"),
                d.find_element(By.CSS_SELECTOR, ".msg.assistant").text, block.is_displayed())

    assert shown() == ("The user greets. Answer kindly.", "Hello!", True)
    stats = d.find_element(By.CSS_SELECTOR, ".stats").text
    assert re.fullmatch(r"3 tokens · \d+\.\d tok/s · first token after \d+\.\d\d s", stats), stats
    d.refresh()
    wait.until(lambda _: d.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    assert shown() == ("The user greets. Answer kindly.", "Hello!", True)
    d.execute_script(_FAKE_STREAM)
    d.find_element(By.ID, "input").send_keys("Again", Keys.ENTER)
    wait.until(lambda _: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]"))  # (new)
    sent = d.execute_script("return window.sentBodies")[0]["messages"]
    assert sent == [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "Again"}]
    d.find_element(By.ID, "new").click()
    assert d.find_elements(By.CSS_SELECTOR, "details.reasoning") == []


# the server's answer as gpt-oss streams one: reasoning deltas, then content, then usage
_FAKE_STREAM = """
window.sentBodies = [];
const events = [
  {choices: [{index: 0, delta: {role: "assistant", content: ""}, finish_reason: null}]},
  {choices: [{index: 0, delta: {reasoning_content: "The user greets."}, finish_reason: null}]},
  {choices: [{index: 0, delta: {reasoning_content: " Answer kindly."}, finish_reason: null}]},
  {choices: [{index: 0, delta: {content: "Hello"}, finish_reason: null}]},
  {choices: [{index: 0, delta: {content: "!"}, finish_reason: null}]},
  {choices: [{index: 0, delta: {}, finish_reason: "stop"}]},
  {choices: [], usage: {prompt_tokens: 5, completion_tokens: 3, total_tokens: 8}}];
const plain = window.fetch;
window.fetch = (url, init) => {
  if (url !== "/v1/chat/completions") return plain(url, init);
  window.sentBodies.push(JSON.parse(init.body));
  const text = events.map((e) => "data: " + JSON.stringify(e) + "\\n\\n").join("") +
    "data: [DONE]\\n\\n";
  return Promise.resolve(new Response(text, {status: 200,
                                             headers: {"Content-Type": "text/event-stream"}}));
};
"""

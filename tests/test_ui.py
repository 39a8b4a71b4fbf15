"""The playground page (app/api/playground.html), in process and in a real headless browser.

In process: the page is served at GET / and /ui without the key (POST / still needs it), with a
Content-Security-Policy that allows nothing but this origin, and its source never writes model text as markup nor
stores the key. In Debian's chromium (driven through its chromedriver by selenium), against a real `specserve
serve` on the default models with an API key: the page asks for the key, streams a chat answer whose tokens are
coloured as the stream's provenance says, races the default draft against `none` with identical greedy texts, fits
a phone's width, and every request it makes goes to the server's own origin. The screenshots land in the test's
temporary folder (printed with -s), and the README's picture in $SPECSERVE_SCREENSHOTS too when set:
`SPECSERVE_SCREENSHOTS=docs .venv/bin/python -m pytest tests/test_ui.py` renews docs/playground.png.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _provenance import check_provenance
from _server import running_server

from app.api import ui

KEY = "playground-test-key"
PAGE = ui.page()[0]
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
MAX_TOKENS = 24


# --- in process --------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_page_is_served_without_the_key_and_post_root_still_needs_it(api_client) -> None:
    async with api_client(api_key=KEY) as client:
        root, alias = await client.get("/"), await client.get("/ui")
        post = await client.post("/", json={"inputs": "Hi", "parameters": {"max_new_tokens": 1}})
        keyed = await client.post(
            "/", json={"inputs": "Hi", "parameters": {"max_new_tokens": 1}}, headers={"Authorization": f"Bearer {KEY}"}
        )
        info = await client.get("/info")
        schema = (await client.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"})).json()
    assert root.status_code == alias.status_code == 200
    assert root.headers["content-type"].startswith("text/html") and root.text == alias.text == PAGE
    assert post.status_code == 401 and info.status_code == 401
    assert keyed.status_code == 200 and isinstance(keyed.json(), list)
    assert "get" not in schema["paths"]["/"] and "/ui" not in schema["paths"]  # a page, not an API route
    policy = root.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "unsafe-inline" not in policy and "script-src 'sha256-" in policy


def test_page_fetches_nothing_elsewhere_and_keeps_the_key_in_memory() -> None:
    code = re.sub(r"<!--.*?-->", "", PAGE, flags=re.DOTALL)
    assert not re.search(r"(?i)(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", code), "an address outside this server"
    assert not re.search(r"\b(src|href)\s*=", code), "a resource to fetch"
    # Model text only ever goes in as text; the key nowhere but a variable.
    for risky in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "localStorage",
                  "sessionStorage", "document.cookie", "indexedDB"):  # fmt: skip
        assert risky not in code, risky


# --- in a browser ------------------------------------------------------------------------------------------


def _need_chromium() -> None:
    if CHROMIUM is None or CHROMEDRIVER is None:
        if os.environ.get("CI"):
            pytest.fail("chromium and chromedriver are missing in CI (Debian packages chromium, chromium-driver)")
        pytest.skip("chromium and chromedriver not installed (apt-get install chromium chromium-driver)")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, target_path: Path) -> Iterator[str]:
    """`specserve serve` as `make serve` runs it (the default target and draft), with an API key."""
    _need_chromium()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server(log, "--log-level", "warning", env={**os.environ, "SPECSERVE_API_KEY": KEY}) as url:
        yield url


@pytest.fixture(scope="module")
def browser(server: str) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000",
                "--disable-background-networking", "--disable-component-update", "--no-first-run"):  # fmt: skip
        options.add_argument(arg)
    # Chrome's own log of every request the page makes (Network.requestWillBeSent).
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`shot(driver, name, readme=False)`: a screenshot in the test's folder; the README's also in
    $SPECSERVE_SCREENSHOTS when set."""
    folder = tmp_path_factory.mktemp("screenshots")
    extra = os.environ.get("SPECSERVE_SCREENSHOTS")

    def shot(driver: Any, name: str, readme: bool = False) -> Path:
        path = folder / f"{name}.png"
        driver.save_screenshot(str(path))
        print(f"screenshot: {path}")
        if extra and readme:
            shutil.copy(path, Path(extra) / f"{name}.png")
        return path

    return shot


def _wait(driver: Any, condition: str, timeout: float = 60) -> Any:
    """Wait until the JavaScript expression `condition` is truthy; its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script(f"return {condition};")
        if value:
            return value
        if time.monotonic() > deadline:
            errors = driver.execute_script("return document.getElementById('error').textContent;")
            raise AssertionError(f"timed out waiting for {condition} (page error: {errors!r})")
        time.sleep(0.1)


def _fill(driver: Any, element_id: str, value: str) -> None:
    element = driver.find_element("id", element_id)
    element.clear()
    element.send_keys(value)


def _open_with_key(driver: Any, server: str) -> None:
    driver.get(server + "/")
    _wait(driver, "document.getElementById('key-dialog').open")  # /info needs the key: the page asks for it
    _fill(driver, "api-key", KEY)
    driver.find_element("id", "key-save").click()
    _wait(driver, "document.getElementById('draft').options.length > 2")  # the loaded drafts, from /info


def _spans(driver: Any, container: str) -> list[dict[str, str]]:
    return driver.execute_script(
        """return [...document.querySelectorAll(arguments[0] + ' .tok')].map((s) => ({
            text: s.textContent, source: s.dataset.source, pass: s.dataset.pass, id: s.dataset.id,
            cls: s.className, title: s.title, background: getComputedStyle(s).backgroundColor}));""",
        container,
    )


def _legend(driver: Any) -> dict[str, str]:
    return driver.execute_script(
        """const out = {}; for (const s of document.querySelectorAll('#legend span'))
            out[s.className.replace('src-', '')] = getComputedStyle(s).backgroundColor; return out;"""
    )


def _check_colours(driver: Any, container: str, run: dict[str, Any]) -> None:
    """The page's spans are the run's tokens with text, each in its source's legend colour and titled with its
    id, log-probability and pass."""
    legend = _legend(driver)
    assert len(set(legend.values())) == len(legend) == 6  # a colour of its own for each source
    shown = [t for t in run["tokens"] if t["text"]]
    spans = _spans(driver, container)
    assert [s["text"] for s in spans] == [t["text"] for t in shown]
    for span, token in zip(spans, shown, strict=True):
        assert span["source"] == token["source"] and span["background"] == legend[token["source"]]
        assert f"id {token['id']}" in span["title"] and f"target pass {token['pass']}" in span["title"]
        assert f"logprob {token['logprob']:.3f}" in span["title"]


def _page_requests(driver: Any) -> list[str]:
    """Every URL the browser requested since the last call (Chrome's performance log)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def test_chat_streams_coloured_tokens_and_races_with_the_key(
    browser: Any, server: str, shots: Callable[..., Path]
) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    driver = browser
    _open_with_key(driver, server)
    drafts = driver.execute_script("return [...document.getElementById('draft').options].map((o) => o.value);")
    info = httpx.get(f"{server}/info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert drafts == info["available_drafts"]

    prompt = "Explain speculative decoding in two sentences."
    _fill(driver, "prompt", prompt)
    _fill(driver, "max-tokens", str(MAX_TOKENS))
    # A fixed draft length: the adaptive schedule may stop drafting on a busy machine, where drafts do not pay.
    _fill(driver, "k", "4")
    driver.execute_script("document.getElementById('schedule').value = 'fixed';")
    started = time.monotonic()
    driver.find_element("id", "generate").click()
    _wait(driver, "document.getElementById('answer').dataset.state === 'running'", 10)
    first = _wait(driver, "document.querySelectorAll('#answer .tok').length > 0 && performance.now()", 30)
    _wait(driver, "document.getElementById('answer').dataset.state !== 'running'", 60)
    state = driver.execute_script("return document.getElementById('answer').dataset.state;")
    assert state == "done", driver.execute_script("return document.getElementById('error').textContent;")
    seconds = time.monotonic() - started
    run = driver.execute_script("return window.playground.runs[window.playground.runs.length - 1];")
    assert first and run["url"] == "/v1/chat/completions" and run["draft"] == "default"
    assert 1 <= len(run["tokens"]) <= MAX_TOKENS and run["text"].strip()
    check_provenance(run["tokens"], run["passes"], run["speculative"])
    assert {t["source"] for t in run["tokens"]} & {"draft", "lookup"}, "the default draft should have helped"
    _check_colours(driver, "#transcript .turn:last-child", run)  # a finished chat turn joins the transcript
    figures = driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#figures .figure')].map("
        "(f) => [f.dataset.figure, f.querySelector('b').textContent]));"
    )
    assert int(figures["tokens"]) == len(run["tokens"]) and int(figures["passes"]) == len(run["passes"])
    assert float(figures["tps"]) > 0 and figures["acceptance"].endswith("%")
    # The same conversation, asked directly: greedy, so the very text the page showed.
    direct = httpx.post(
        f"{server}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS, "temperature": 0},
        timeout=60,
    ).json()
    assert direct["choices"][0]["message"]["content"] == run["text"]
    # Hovering a token shows what it is in the line below the answer.
    drafted = driver.find_elements("css selector", "#transcript .tok.src-draft, #transcript .tok.src-lookup")
    ActionChains(driver).move_to_element(drafted[-1]).perform()
    inspected = driver.find_element("id", "inspect").text
    assert "accepted" in inspected and "logprob" in inspected and "target pass" in inspected
    shots(driver, "playground", readme=True)

    # The race: the default draft and none, at once, on the same (greedy) conversation.
    driver.find_element("id", "new-chat").click()
    _fill(driver, "prompt", prompt)
    driver.find_element("id", "race").click()
    identical = _wait(driver, "document.getElementById('race-verdict').dataset.identical", 90)
    verdict = driver.find_element("id", "race-verdict").text
    assert identical == "true", verdict
    assert "identical" in verdict and "× the tokens/s" in verdict
    race = driver.execute_script("return window.playground.runs.slice(-2);")
    assert [r["draft"] for r in race] == ["default", "none"]
    assert race[0]["text"] == race[1]["text"] == run["text"]
    assert {t["source"] for t in race[1]["tokens"]} == {"target"}
    assert len(race[0]["passes"]) <= len(race[1]["passes"])
    _check_colours(driver, "#race-draft", race[0])
    _check_colours(driver, "#race-none", race[1])
    shots(driver, "playground-race")

    # A phone's width: one column, nothing wider than the screen.
    driver.set_window_size(390, 844)
    time.sleep(0.3)
    assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth;")
    driver.execute_script("document.getElementById('race-view').scrollIntoView();")
    shots(driver, "playground-phone")
    driver.set_window_size(1280, 1000)

    # The key stayed in memory: no storage, no cookie, not in the address.
    assert driver.execute_script("return localStorage.length + sessionStorage.length;") == 0
    assert driver.execute_script("return document.cookie;") == "" and KEY not in driver.current_url
    # Every request the page made went to the server's own origin.
    urls = _page_requests(driver)
    assert any(u.endswith("/v1/chat/completions") for u in urls) and any(u.endswith("/info") for u in urls)
    assert all(u.startswith(server + "/") for u in urls), [u for u in urls if not u.startswith(server + "/")]
    resources = driver.execute_script("return performance.getEntriesByType('resource').map((e) => e.name);")
    assert all(u.startswith(server + "/") for u in resources), resources
    print(f"first answer in {seconds:.1f} s ({len(run['tokens'])} tokens); race: {verdict}")


def test_completion_mode_streams_through_the_native_route(browser: Any, server: str) -> None:
    """Completion mode sends the prompt as is to /generate_stream; prompt lookup colours a repetitive text; a
    sampled race gives identical texts too."""
    driver = browser
    if not driver.execute_script("return !!(window.playground && document.getElementById('draft').options.length > 2)"):
        _open_with_key(driver, server)
    driver.find_element("xpath", "//label[input[@id='mode-completion']]").click()  # the radio itself is hidden
    _fill(driver, "prompt", "a b c d a b c d a b c d a b")
    _fill(driver, "max-tokens", "16")
    driver.execute_script("document.getElementById('draft').value = 'ngram';")
    driver.find_element("id", "generate").click()
    _wait(driver, "document.getElementById('answer').dataset.state === 'done'", 60)
    run = driver.execute_script("return window.playground.runs[window.playground.runs.length - 1];")
    assert run["url"] == "/generate_stream" and run["draft"] == "ngram" and len(run["tokens"]) == 16
    check_provenance(run["tokens"], run["passes"], run["speculative"])
    assert "lookup" in {t["source"] for t in run["tokens"]}
    _check_colours(driver, "#answer", run)
    # Sampled, the race sends one seed to both: the default sampler then draws target-only's tokens with a draft too.
    _fill(driver, "temperature", "0.8")
    driver.find_element("id", "race").click()
    identical = _wait(driver, "document.getElementById('race-verdict').dataset.identical", 60)
    verdict = driver.find_element("id", "race-verdict").text
    assert identical == "true" and "sampling, seed" in verdict, verdict
    race = driver.execute_script("return window.playground.runs.slice(-2);")
    assert [r["draft"] for r in race] == ["ngram", "none"]
    # The page draws the seed: a sample may end (EOS) before 16 tokens, at the same token in both runs.
    lengths = {len(r["tokens"]) for r in race}
    assert len(lengths) == 1 and 0 < lengths.pop() <= 16, race
    urls = _page_requests(driver)
    assert urls and all(u.startswith(server + "/") for u in urls), urls

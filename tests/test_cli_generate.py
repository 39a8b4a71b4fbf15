"""`specserve generate`, run as a subprocess on the real default target.

Every run that gets past argument checking loads the model (several seconds), so the runs are few and
each checks as much as it can.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import main
from app.engine.generation import Generation, GenerationParams

ROOT = Path(__file__).resolve().parent.parent
STATS_KEYS = {"drafted", "accepted", "target_passes", "acceptance_rate", "tokens_per_target_pass", "tokens_per_second"}


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "generate", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _json_lines(proc: subprocess.CompletedProcess) -> list[dict]:
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def _target_only(loaded, prompt_ids, n) -> list[int]:
    gen = Generation(loaded.model, loaded.tokenizer, prompt_ids, GenerationParams(max_new_tokens=n), None)
    while not gen.finished:
        gen.step()
    return gen.generated_ids


def test_generate_json_with_compare(target_f32):
    prompt = "Name three colours of the rainbow."
    proc = _cli(prompt, "--json", "-n", "8", "--draft", "ngram", "--compare", "--dtype", "float32", "--device", "cpu")
    [out] = _json_lines(proc)
    assert {"text", "prompt_token_ids", "token_ids", "finish_reason", "stats"} <= set(out)
    tok = target_f32.tokenizer
    assert out["prompt_token_ids"] == tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
    assert 1 <= len(out["token_ids"]) <= 8
    assert out["finish_reason"] in ("length", "eos")
    assert out["text"] == tok.decode(out["token_ids"])
    stats = out["stats"]
    assert set(stats) >= STATS_KEYS
    assert stats["generated_tokens"] == len(out["token_ids"])
    assert 0 <= stats["accepted"] <= stats["drafted"]
    assert stats["tokens_per_second"] > 0 and stats["target_passes"] >= 1
    assert stats["tokens_per_target_pass"] == pytest.approx(len(out["token_ids"]) / stats["target_passes"], abs=1e-3)
    # --compare: the target-only run gives the same tokens, which are the target's own greedy tokens.
    assert out["identical_to_target_only"] is True
    assert out["baseline"]["token_ids"] == out["token_ids"]
    assert out["baseline"]["stats"]["drafted"] == 0
    assert out["token_ids"] == _target_only(target_f32, out["prompt_token_ids"], 8)


def test_generate_input_file_limit_and_no_draft(tmp_path):
    bench = tmp_path / "bench.jsonl"
    rows = [
        {"question_id": 1, "category": "qa", "turns": ["What is the boiling point of water?"]},
        {"question_id": 2, "category": "writing", "turns": ["Write a haiku about snow.", "Now another one."]},
        {"question_id": 3, "category": "math", "turns": ["What is 7 times 8?"]},
    ]
    bench.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    proc = _cli("--input", str(bench), "--limit", "2", "--json", "-n", "4", "--draft", "none", "--dtype", "float32")
    outs = _json_lines(proc)
    assert len(outs) == 2
    for out in outs:
        stats = out["stats"]
        assert set(stats) >= STATS_KEYS
        assert stats["drafted"] == stats["accepted"] == 0 and stats["acceptance_rate"] == 0
        # Target only: one token per target pass.
        assert stats["target_passes"] == stats["generated_tokens"] == len(out["token_ids"])
        assert "identical_to_target_only" not in out
    assert outs[0]["prompt_token_ids"] != outs[1]["prompt_token_ids"]


def test_unknown_draft_is_one_error_line():
    proc = _cli("hi", "-n", "2", "--draft", "no-such-draft", "--dtype", "float32")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "no-such-draft" in lines[0]
    assert proc.stdout == ""


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        ('{"question_id": 1, "turns": ["ok"]}\nnot json\n', ":2: not a Spec-Bench line"),
        ('{"question_id": 1, "prompt": "no turns"}\n', ":1: not a Spec-Bench line"),
    ],
    ids=["missing-file", "not-json", "no-turns"],
)
def test_bad_input_is_one_error_line(tmp_path, capsys, content, message):
    """Refused before any model is loaded, so run in-process through the same entry point."""
    path = tmp_path / "input.jsonl"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    assert main(["generate", "--input", str(path), "--json", "-n", "2"]) == 1
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], captured.err
    assert captured.out == ""


def test_no_prompt_is_one_error_line(capsys):
    assert main(["generate", "-n", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1

"""`specserve generate`, run as a subprocess on the real default target.

Every run that gets past argument checking loads the model (several seconds), so the runs are few and
each checks as much as it can.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import main
from app.engine.generation import Generation
from app.engine.step import GenerationParams

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
    gen = Generation(
        loaded.model, loaded.tokenizer, prompt_ids, GenerationParams(max_new_tokens=n, num_draft_tokens=4), None
    )
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


def test_a_base_model_needs_no_chat_and_says_so(tmp_path, capsys):
    """A target without a chat template (a base model) is not sent a chat turn it cannot render: one error line
    naming --no-chat, which then continues the prompt as is."""
    from app.bench import synthetic

    path = synthetic.write_tiny_gguf(tmp_path / "base.gguf", "qwen3", chat_template=False)
    args = ["generate", "Hello", "--target", str(path), "--draft", "none", "--max-new-tokens", "3"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err == f"error: {path} has no chat template (a base model): pass --no-chat to send the prompt as is\n"
    assert main([*args, "--no-chat", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    from app.engine.model.loading import load_model

    assert out["prompt_token_ids"] == load_model(path, "float32").tokenizer.encode("Hello")  # as is
    assert 1 <= len(out["token_ids"]) <= 3


def test_no_prompt_is_one_error_line(capsys):
    assert main(["generate", "-n", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1


def test_generate_sampling_json_reproduces_its_seed(target_f32):
    from app.engine.drafting.ngram import NgramDrafter

    prompt = "Write a short poem about the sea."
    proc = _cli(
        prompt, "--json", "-n", "8", "--draft", "ngram", "--compare", "--dtype", "float32", "--device", "cpu",
        "--temperature", "0.9", "--top-k", "40", "--top-p", "0.95", "--seed", "7",
    )  # fmt: skip
    [out] = _json_lines(proc)
    assert out["seed"] == 7
    # The gumbel sampler (the default) gives target-only's tokens for the same seed.
    assert out["identical_to_target_only"] is True
    assert out["baseline"]["token_ids"] == out["token_ids"]
    assert out["stats"]["generated_tokens"] == len(out["token_ids"]) >= 1
    # The same seed and parameters in this process give the same tokens: the seed is the whole randomness.
    params = GenerationParams(max_new_tokens=8, num_draft_tokens=4, temperature=0.9, top_k=40, top_p=0.95, seed=7)
    gen = Generation(target_f32.model, target_f32.tokenizer, out["prompt_token_ids"], params, NgramDrafter())
    while not gen.finished:
        gen.step()
    assert gen.generated_ids == out["token_ids"]


def test_generate_sampling_prints_the_seed_drawn():
    proc = _cli("Say hello.", "-n", "4", "--draft", "none", "--dtype", "float32", "--temperature", "0.7")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"temperature 0\.7, top-k 0, top-p 1, seed \d+\] finish:", proc.stdout), proc.stdout
    greedy = _cli("Say hello.", "-n", "2", "--draft", "none", "--dtype", "float32", "--json")
    assert _json_lines(greedy)[0]["seed"] is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--temperature", "1e-9"], "--temperature must be 0 (greedy) or at least 1e-06"),
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "1", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["--temperature", "1", "--top-k", "-2"], "top_k must be >= 0"),
        (["--temperature", "1", "--seed", "-1"], "--seed must lie in [0, "),
    ],
    ids=["negative-temperature", "tiny-temperature", "nan-temperature", "top-p-0", "negative-top-k", "negative-seed"],
)
def test_bad_sampling_flags_are_one_error_line(capsys, flags, message):
    """Refused before any model is loaded (generate and bench alike)."""
    for command in (["generate", "hi", "-n", "2"], ["bench", "--input", __file__]):
        assert main([*command, *flags]) == 1
        captured = capsys.readouterr()
        lines = [line for line in captured.err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], captured.err


def test_bench_summary_reports_equality_only_where_promised():
    from app.bench.specbench import Run, markdown, summarize

    stats = {
        "drafted": 4,
        "accepted": 2,
        "target_passes": 3,
        "verify_passes": 2,
        "accepted_per_position": [1, 1],
        "draft_seconds": 0.02,
        "verify_seconds": 0.2,
    }
    runs = [
        Run(
            "none",
            1,
            "qa",
            4,
            1.0,
            [1, 2, 3, 4],
            {**stats, "drafted": 0, "accepted": 0, "accepted_per_position": []},
        ),
        Run("ngram", 1, "qa", 4, 0.5, [1, 2, 3, 4], stats),
        Run("ngram/fixed/rejection", 1, "qa", 4, 0.5, [1, 2, 3, 5], stats),
    ]
    greedy = summarize(runs, 2)
    assert greedy["overall"]["ngram"]["identical_to_target_only"] == 1
    assert "| 1/1 |" in markdown(greedy)
    sampled = summarize(runs, 2, sampled=True)
    # The gumbel sampler promises target-only's tokens for a seed: checked; the rejection sampler does not.
    assert sampled["overall"]["ngram"]["identical_to_target_only"] == 1
    assert sampled["overall"]["ngram/fixed/rejection"]["identical_to_target_only"] is None
    assert sampled["overall"]["ngram"]["acceptance_rate"] == 0.5
    assert markdown(sampled).splitlines()[-1].endswith("| - |")
    # Theoretical: a = 0.5 and k = 2 give 1.75 tokens per pass; a target-only step costs 0.1 s (0.2 s over the
    # 2 passes after the prefill), a draft token 0.005 s and a verification 0.1 s: 1.75 * 0.1 / (2 * 0.005 + 0.1).
    entry = greedy["overall"]["ngram"]
    assert entry["mean_draft_length"] == 2.0
    assert abs(entry["theoretical_speedup"] - 1.75 * 0.1 / 0.11) < 1e-9
    assert abs(entry["realised_of_theoretical"] - 2.0 / entry["theoretical_speedup"]) < 1e-9


@pytest.mark.parametrize("limit", ["0", "-1", "x"])
def test_a_limit_below_one_is_refused_before_anything_loads(limit, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--input", "prompts.jsonl", "--limit", limit])
    assert exc.value.code == 2
    assert "--limit" in capsys.readouterr().err


def test_bench_default_prompts_ship_with_the_package():
    """`specserve bench` with no --input reads the package's own prompts, so it runs from any checkout or
    install: the file exists, is listed as package data, parses, has one prompt per Spec-Bench category, and
    none of its prompts is a Spec-Bench one (those come in with --input)."""
    import tomllib

    from app.bench.specbench import MT_BENCH, read_prompts
    from app.cli import build_parser
    from app.cli.common import BENCH_PROMPTS
    from tests.conftest import SPECBENCH

    args = build_parser().parse_args(["bench"])
    assert Path(args.input) == BENCH_PROMPTS and BENCH_PROMPTS.is_file()
    assert BENCH_PROMPTS.parent == ROOT / "app" / "bench"
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert BENCH_PROMPTS.name in package_data["app.bench"]
    prompts = read_prompts(BENCH_PROMPTS)
    categories = [p.category for p in prompts]
    assert sorted(categories) == sorted(MT_BENCH | {"translation", "summarization", "qa", "math_reasoning", "rag"})
    assert len(read_prompts(BENCH_PROMPTS, per_category=1)) == len(prompts) == 13
    assert all(p.text.strip() for p in prompts) and len({p.question_id for p in prompts}) == len(prompts)
    if SPECBENCH.is_file():
        rows = [json.loads(line) for line in SPECBENCH.read_text(encoding="utf-8").splitlines() if line.strip()]
        theirs = {turn.strip() for row in rows for turn in row["turns"]}
        assert not theirs & {p.text.strip() for p in prompts}

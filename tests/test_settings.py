"""Settings of the service: every one is a `specserve serve` flag and a SPECSERVE_* variable, flags first."""

from __future__ import annotations

import pytest

from app import cli
from app.settings import Settings


def test_every_setting_has_a_flag() -> None:
    flags = {field: flag for flag, field, _, _ in cli._SERVE_FLAGS}
    assert set(flags) == set(Settings.model_fields)
    for field, flag in flags.items():
        assert flag == "--" + field.replace("_", "-")


def test_environment_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_MAX_QUEUE_SIZE", "3")
    monkeypatch.setenv("SPECSERVE_PORT", "9001")
    assert Settings().max_queue_size == 3
    assert Settings(port=9002).port == 9002
    assert Settings().served_model_names == ["smollm2-135m-instruct"]
    assert Settings(model_name="smol").served_model_names == ["smol"]
    monkeypatch.setenv("SPECSERVE_SERVED_MODEL_NAME", "a, b,,smol")
    assert Settings(model_name="smol").served_model_names == ["smol", "a", "b"]


def test_served_model_name_takes_several_names_as_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--served-model-name a b` (vLLM's form) or comma-separated: aliases beside the name answers report."""
    import app.logs
    import app.server

    seen: list[Settings] = []
    monkeypatch.setattr(app.server, "serve", lambda settings: seen.append(settings) or True)
    monkeypatch.setattr(app.logs, "configure_logging", lambda *args: None)
    assert cli.main(["serve", "--served-model-name", "a", "b,c", "--port", "9"]) == 0
    assert seen[0].served_model_names == ["smollm2-135m-instruct", "a", "b", "c"]


def test_invalid_settings_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--max-concurrent-requests", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: invalid settings: max_concurrent_requests")
    assert cli.main(["serve", "--default-max-new-tokens", "50", "--max-new-tokens", "10"]) == 1
    assert "default_max_new_tokens (50) exceeds max_new_tokens (10)" in capsys.readouterr().err
    assert cli.main(["serve", "--target", "no-such-model"]) == 1
    assert "known models" in capsys.readouterr().err


def test_server_cli_and_build_engine_share_the_draft_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """One home for k, the schedule and p_min (app.engine.defaults): the server, `specserve generate` and
    `bench` and an engine built by `build_engine` decode alike unless told otherwise."""
    import inspect

    from app.engine import defaults
    from app.engine.factory import build_engine

    for name in ("NUM_DRAFT_TOKENS", "DRAFT_SCHEDULE", "DRAFT_P_MIN"):
        monkeypatch.delenv(f"SPECSERVE_{name}", raising=False)
    expected = {
        "num_draft_tokens": defaults.DEFAULT_NUM_DRAFT_TOKENS,
        "draft_schedule": defaults.DEFAULT_DRAFT_SCHEDULE,
        "draft_p_min": defaults.DEFAULT_DRAFT_P_MIN,
    }
    assert expected == {"num_draft_tokens": 6, "draft_schedule": "adaptive", "draft_p_min": 0.05}
    settings = Settings()
    assert {field: getattr(settings, field) for field in expected} == expected
    signature = inspect.signature(build_engine).parameters
    assert {field: signature[field].default for field in expected} == expected
    parser = cli._build_parser()
    generate = parser.parse_args(["generate", "hi"])
    assert (generate.num_draft_tokens, generate.schedule, generate.p_min) == tuple(expected.values())
    # bench leaves p_min and the schedule to the engine (None), which build_engine gives the shared defaults.
    bench = parser.parse_args(["bench"])
    assert (bench.num_draft_tokens, bench.schedule, bench.p_min) == (defaults.DEFAULT_NUM_DRAFT_TOKENS, None, None)

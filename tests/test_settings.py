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
    assert Settings().served_model_name == "smollm2-135m-instruct"
    assert Settings(model_name="smol").served_model_name == "smol"


def test_invalid_settings_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--max-concurrent-requests", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: invalid settings: max_concurrent_requests")
    assert cli.main(["serve", "--default-max-new-tokens", "50", "--max-new-tokens", "10"]) == 1
    assert "default_max_new_tokens (50) exceeds max_new_tokens (10)" in capsys.readouterr().err
    assert cli.main(["serve", "--target", "no-such-model"]) == 1
    assert "known models" in capsys.readouterr().err

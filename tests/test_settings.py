"""Settings of the service: every one is a `specserve serve` flag and a SPECSERVE_* variable, flags first."""

from __future__ import annotations

import pytest

from app import cli
from app.cli import common
from app.service.settings import Settings

# Every serve flag there has been: generated from the settings now, they must keep their names.
SERVE_FLAGS = [
    "--target",
    "--draft",
    "--num-draft-tokens",
    "--draft-schedule",
    "--draft-p-min",
    "--dtype",
    "--device",
    "--host",
    "--port",
    "--model-name",
    "--served-model-name",
    "--max-concurrent-requests",
    "--kv-cache-memory",
    "--max-queue-size",
    "--prefill-chunk-tokens",
    "--prefill-step-seconds",
    "--request-timeout",
    "--max-input-tokens",
    "--max-new-tokens",
    "--default-max-new-tokens",
    "--max-stop-sequences",
    "--max-body-bytes",
    "--body-read-timeout",
    "--shutdown-grace-period",
    "--log-format",
    "--log-level",
    "--api-key",
    "--api-keys",
    "--api-key-file",
    "--isolation",
    "--allow-unauthenticated",
    "--metrics-public",
    "--cors-allow-origins",
]


def _serve_parser(parser):
    (subparsers,) = (a for a in parser._actions if a.dest == "command")
    return subparsers.choices["serve"]


def test_every_setting_has_a_flag() -> None:
    flags = {field: flag for flag, field, _ in common.serve_flags()}
    assert set(flags) == set(Settings.model_fields)
    for field, flag in flags.items():
        assert flag == "--" + field.replace("_", "-")
    options = {o for a in _serve_parser(cli.build_parser())._actions for o in a.option_strings}
    assert set(SERVE_FLAGS) | {"--no-metrics-public", "--no-allow-unauthenticated"} <= options


def _parsed_settings(monkeypatch: pytest.MonkeyPatch, *argv: str) -> Settings:
    import app.api.server
    import app.service.logs

    seen: list[Settings] = []
    monkeypatch.setattr(app.api.server, "serve", lambda settings: seen.append(settings) or True)
    monkeypatch.setattr(app.service.logs, "configure_logging", lambda *args: None)
    assert cli.main(["serve", *argv]) == 0
    return seen[0]


def test_flags_take_their_types_from_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bool is --x / --no-x, numbers are parsed as their annotation, a Literal shows its choices and is checked
    by the settings (one-line error); the help is the field's description and its default."""
    monkeypatch.delenv("SPECSERVE_METRICS_PUBLIC", raising=False)
    settings = _parsed_settings(monkeypatch, "--metrics-public", "--port", "9", "--request-timeout", "1.5")
    assert (settings.metrics_public, settings.port, settings.request_timeout) == (True, 9, 1.5)
    monkeypatch.setenv("SPECSERVE_METRICS_PUBLIC", "true")
    assert _parsed_settings(monkeypatch).metrics_public is True  # no flag: the variable applies
    assert _parsed_settings(monkeypatch, "--no-metrics-public").metrics_public is False  # the flag wins
    assert _parsed_settings(monkeypatch, "--dtype", "float32", "--api-key", "k").api_key.get_secret_value() == "k"

    help_ = _serve_parser(cli.build_parser()).format_help()
    assert "--dtype {auto,float32,bfloat16,float16}" in help_
    assert "--metrics-public, --no-metrics-public" in help_
    assert "--served-model-name NAME [NAME ...]" in help_
    flags = {flag: kwargs for flag, _, kwargs in common.serve_flags()}
    assert flags["--port"]["help"] == "TCP port to listen on (default: 8000)"
    assert flags["--request-timeout"]["help"].endswith("(default: 300)")
    assert flags["--metrics-public"]["help"].endswith("(default: no)")
    assert flags["--model-name"]["help"] == Settings.model_fields["model_name"].description  # None: not shown
    assert [flags[f]["type"] for f in ("--port", "--draft-p-min", "--max-input-tokens")] == [int, float, int]


KEY_VARIABLES = ("SPECSERVE_API_KEY", "SPECSERVE_API_KEYS", "SPECSERVE_API_KEY_FILE", "SPECSERVE_ALLOW_UNAUTHENTICATED")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.9", "localhost", "::1", "[::1]"])
def test_a_loopback_server_needs_no_key(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in KEY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert Settings(host=host).host == host


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "myhost.example"])
def test_a_server_others_reach_refuses_to_start_without_a_key_unless_told(
    host: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in KEY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["serve", "--host", host]) == 1
    err = capsys.readouterr().err
    assert f"host {host} is reachable from other machines and no API key is set" in err
    assert "--allow-unauthenticated" in err
    assert _parsed_settings(monkeypatch, "--host", host, "--allow-unauthenticated").allow_unauthenticated
    assert _parsed_settings(monkeypatch, "--host", host, "--api-keys", "a:key-0123456789").host == host
    monkeypatch.setenv("SPECSERVE_API_KEY", "key-0123456789")
    assert _parsed_settings(monkeypatch, "--host", host).host == host


def test_a_literal_out_of_its_choices_is_a_settings_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--dtype", "float8"]) == 1
    assert capsys.readouterr().err.startswith("error: invalid settings: dtype: Input should be 'auto'")


def test_a_new_setting_becomes_a_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing but the field: its flag, type, help and default come from it."""
    from pydantic import Field

    import app.service.settings

    class More(Settings):
        spare_knob: float = Field(2.5, ge=0, description="a knob")

    monkeypatch.setattr(app.service.settings, "Settings", More)
    flags = {flag: (field, kwargs) for flag, field, kwargs in common.serve_flags()}
    assert flags["--spare-knob"] == (
        "spare_knob",
        {"dest": "spare_knob", "default": None, "help": "a knob (default: 2.5)", "type": float},
    )
    assert _parsed_settings(monkeypatch, "--spare-knob", "4").spare_knob == 4.0


def test_only_serve_loads_the_settings() -> None:
    """The flags come from app.service.settings (pydantic-settings, slow to import): other commands do not load it."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom app import cli\n"
        "try:\n    cli.main(['--version'])\nexcept SystemExit:\n    pass\n"
        "print('app.service.settings' in sys.modules)\n"
        "cli.build_parser(serve_flags=True)\nprint('app.service.settings' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-2:] == ["False", "True"]  # after `specserve VERSION`


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
    settings = _parsed_settings(monkeypatch, "--served-model-name", "a", "b,c", "--port", "9")
    assert settings.served_model_names == ["smollm2-135m-instruct", "a", "b", "c"]


def test_invalid_settings_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--max-concurrent-requests", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: invalid settings: max_concurrent_requests")
    assert cli.main(["serve", "--default-max-new-tokens", "50", "--max-new-tokens", "10"]) == 1
    assert "default_max_new_tokens (50) exceeds max_new_tokens (10)" in capsys.readouterr().err
    assert cli.main(["serve", "--target", "no-such-model"]) == 1
    assert "known models" in capsys.readouterr().err


def test_kv_cache_memory_is_auto_or_a_size(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The KV-cache budget: `auto` (measured at start-up) by default, else bytes, plainly or with a unit, from
    the variable or the flag; anything else is a one-line settings error."""
    monkeypatch.delenv("SPECSERVE_KV_CACHE_MEMORY", raising=False)
    assert (Settings().kv_cache_memory, Settings().kv_cache_memory_bytes) == ("auto", None)
    sizes = {
        "4294967296": 4 * 2**30,
        "512MiB": 512 * 2**20,
        "8 GiB": 8 * 2**30,
        "1.5gib": 3 * 2**29,
        "2GB": 2 * 10**9,
        "64k": 64_000,
        " AUTO ": None,
    }
    assert {value: Settings(kv_cache_memory=value).kv_cache_memory_bytes for value in sizes} == sizes
    monkeypatch.setenv("SPECSERVE_KV_CACHE_MEMORY", "1GiB")
    assert Settings().kv_cache_memory_bytes == 2**30
    assert _parsed_settings(monkeypatch, "--kv-cache-memory", "256MiB").kv_cache_memory_bytes == 256 * 2**20
    for bad in ("lots", "0", "-5MiB", "5 parsecs", "0.1"):
        assert cli.main(["serve", f"--kv-cache-memory={bad}"]) == 1, bad
        err = capsys.readouterr().err
        assert err.startswith("error: invalid settings: kv_cache_memory") and err.count("\n") == 1, err


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
    # The longest draft: the settings' and the API's limit, and what the engine's spare cache slots hold.
    assert Settings(num_draft_tokens=defaults.MAX_DRAFT_TOKENS).num_draft_tokens == 16
    with pytest.raises(ValueError, match="less than or equal to 16"):
        Settings(num_draft_tokens=defaults.MAX_DRAFT_TOKENS + 1)
    from app.api.schemas import SpeculativeParameters

    with pytest.raises(ValueError, match="less than or equal to 16"):
        SpeculativeParameters.model_validate({"num_draft_tokens": defaults.MAX_DRAFT_TOKENS + 1})
    signature = inspect.signature(build_engine).parameters
    assert {field: signature[field].default for field in expected} == expected
    parser = cli.build_parser()
    generate = parser.parse_args(["generate", "hi"])
    assert (generate.num_draft_tokens, generate.draft_schedule, generate.draft_p_min) == tuple(expected.values())
    # bench leaves p_min and the schedule to the engine (None), which build_engine gives the shared defaults.
    bench = parser.parse_args(["bench"])
    assert (bench.num_draft_tokens, bench.schedule, bench.p_min) == (defaults.DEFAULT_NUM_DRAFT_TOKENS, None, None)

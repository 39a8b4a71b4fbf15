"""Models named by their Hugging Face Hub id (app/hub.py, through app.store.resolve), fetched from a local mirror
of the Hub (tests/_hub_mirror.py: HF_ENDPOINT points at it) into a Hugging Face cache under tmp_path; no test
reaches the real Hub.

- The quant picks the file (whole words, any case; Q4_K_M then Q8_0 by default; projectors and split files
  aside), and `specserve generate --model owner/repo:QUANT` generates from the fetched tiny GGUF.
- With the mirror stopped, or HF_HUB_OFFLINE set (then without a single request), the cached files resolve.
- A transfer cut off half-way resumes where it stopped (a Range request).
- A safetensors repo becomes an HF directory of only the files the loader reads, and loads.
- Every refusal (no such repo, no such quant, gated, offline and not cached) is one line naming what is missing.
- `specserve serve MODEL` and `--model` set the target as `--target` does; SPECSERVE_TARGET still applies.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _hub_mirror import HubMirror

from app import cli, hub, store
from app.bench.synthetic import write_tiny_gguf

GGUF_REPO = "tester/tiny-GGUF"
HF_REPO = "tester/tiny-hf"


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", "qwen3").read_bytes()


def _gguf_repo(data: bytes) -> dict[str, bytes]:
    # The same tiny model under every quant's name (what is tested is which name is fetched), a projector, a
    # quant split in two, and a file that is no model.
    return {
        "README.md": b"# tiny\n",
        "tiny-Q8_0.gguf": data,
        "tiny-Q4_K_M.gguf": data + b"\0",
        "tiny-BF16.gguf": data + b"\0\0",
        "mmproj-tiny-F16.gguf": b"not a model",
        "tiny-Q6_K-00001-of-00002.gguf": b"part 1",
        "tiny-Q6_K-00002-of-00002.gguf": b"part 2",
    }


@pytest.fixture
def mirror(gguf_bytes: bytes, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubMirror]:
    """A running mirror with a GGUF repo, a gated copy of it and a repo without models; the Hub's variables
    point at the mirror and a cache of this test's own."""
    from huggingface_hub import constants

    repos = {GGUF_REPO: _gguf_repo(gguf_bytes), "tester/gated-GGUF": _gguf_repo(gguf_bytes)}
    repos["tester/empty"] = {"README.md": b"nothing here\n"}
    with HubMirror(repos, gated=frozenset({"tester/gated-GGUF"})) as server:
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE", "HUGGING_FACE_HUB_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        # huggingface_hub read its variables when first imported (conftest.py had set HF_HUB_OFFLINE): what it
        # reads from its constants besides what app.hub passes (its own requests' endpoint, the token file,
        # offline mode) is pointed here too, so that nothing reaches huggingface.co.
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "hf" / "agents.json"))
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
        # And should anything still aim elsewhere, its name does not resolve: only the mirror can be reached.
        real_getaddrinfo = socket.getaddrinfo

        def local_only(host: object, *args: object, **kwargs: object) -> object:
            if host not in ("127.0.0.1", "localhost", None):
                raise OSError(f"test_hub: no network beyond the mirror (asked for {host!r})")
            return real_getaddrinfo(host, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(socket, "getaddrinfo", local_only)
        yield server


def _error(name: str) -> str:
    with pytest.raises(store.ModelStoreError) as exc:
        store.resolve(name)
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def test_hub_ids_are_told_from_paths_and_catalog_names() -> None:
    assert hub.parse("Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M") == hub.HubId("Qwen/Qwen2.5-0.5B-Instruct-GGUF", "Q4_K_M")
    assert hub.parse("HuggingFaceTB/SmolLM2-135M-Instruct") == hub.HubId("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert hub.parse("o/r/sub/m-Q8_0.gguf") == hub.HubId("o/r", file="sub/m-Q8_0.gguf")
    assert hub.parse("unsloth/gemma-3-270m-it-GGUF:UD-Q4_K_XL").quant == "UD-Q4_K_XL"  # type: ignore[union-attr]
    for not_hub in ("smollm2-135m-instruct", "./a/b", "/abs/path", "~/m/x", "models/x.gguf", "a/b/c", "a/../b", "a"):
        assert hub.parse(not_hub) is None, not_hub


def test_the_quant_picks_the_file() -> None:
    files = list(_gguf_repo(b""))
    assert hub.pick_gguf("o/r", files, "Q8_0") == "tiny-Q8_0.gguf"
    assert hub.pick_gguf("o/r", files, "q4_k_m") == "tiny-Q4_K_M.gguf"  # any case, as llama.cpp's tags
    assert hub.pick_gguf("o/r", files, None) == "tiny-Q4_K_M.gguf"  # llama.cpp's default
    assert hub.pick_gguf("o/r", [f for f in files if "Q4_K_M" not in f], None) == "tiny-Q8_0.gguf"
    assert hub.pick_gguf("o/r", ["README.md", "mmproj-x-F16.gguf", "x-F16.gguf"], None) == "x-F16.gguf"
    assert hub.pick_gguf("o/r", ["a-F16.gguf", "a-BF16.gguf"], "f16") == "a-F16.gguf"  # a whole word: not BF16
    with pytest.raises(hub.HubError, match=r"no GGUF file for quant Q4_K; quants there: Q8_0, Q4_K_M, BF16, Q6_K$"):
        hub.pick_gguf("o/r", files, "Q4_K")  # nor Q4_K_M's prefix
    with pytest.raises(hub.HubError, match=r"quant Q6_K only split into 2 files .*one file: Q8_0, Q4_K_M, BF16\)"):
        hub.pick_gguf("o/r", files, "Q6_K")
    with pytest.raises(hub.HubError, match=r"none is Q4_K_M or Q8_0; name one as o/r:QUANT \(quants there: BF16, F16"):
        hub.pick_gguf("o/r", ["a-BF16.gguf", "a-F16.gguf"], None)
    with pytest.raises(hub.HubError, match=r"2 GGUF files for quant Q8_0 \(a/m-Q8_0.gguf, b/m-Q8_0.gguf\); name one"):
        hub.pick_gguf("o/r", ["a/m-Q8_0.gguf", "b/m-Q8_0.gguf"], "Q8_0")


def _generate(capsys: pytest.CaptureFixture[str], model: str) -> dict:
    argv = ["generate", "Hello world", "--model", model, "-n", "2", "--json", "--draft", "none"]
    assert cli.main([*argv, "--dtype", "float32", "--device", "cpu"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_hub_id_is_fetched_once_then_served_from_the_cache(
    mirror: HubMirror, gguf_bytes: bytes, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = _generate(capsys, f"{GGUF_REPO}:Q8_0")
    assert len(out["token_ids"]) == 2
    path = store.resolve(f"{GGUF_REPO}:Q8_0")
    assert path.name == "tiny-Q8_0.gguf" and path.read_bytes() == gguf_bytes
    cache = tmp_path / "hf" / "hub"  # HF_HOME's, in the Hub's own layout
    assert path.is_relative_to(cache / "models--tester--tiny-GGUF" / "snapshots")
    assert (cache / "models--tester--tiny-GGUF" / "refs" / "main").is_file()
    fetched = [p for m, p, _ in mirror.requests if m == "GET" and "/resolve/" in p]
    assert [p.rsplit("/", 1)[1] for p in fetched] == ["tiny-Q8_0.gguf"]  # fetched once, that file alone
    assert store.resolve(GGUF_REPO).name == "tiny-Q4_K_M.gguf"  # no quant: llama.cpp's default
    assert cli.main(["models", "fetch", f"{GGUF_REPO}:BF16"]) == 0  # fetched ahead, the path printed last
    assert capsys.readouterr().out.splitlines()[-1].endswith("/tiny-BF16.gguf")

    mirror.stop()  # the network is off from here
    assert store.resolve(f"{GGUF_REPO}:Q8_0") == path
    assert store.resolve(f"{GGUF_REPO}:q8_0") == path
    assert _generate(capsys, f"{GGUF_REPO}:Q8_0")["token_ids"] == out["token_ids"]
    assert store.resolve(f"{GGUF_REPO}:BF16").name == "tiny-BF16.gguf"
    message = _error(f"{GGUF_REPO}/mmproj-tiny-F16.gguf")  # listed by the Hub, never fetched
    assert "is not in" in message and "the Hub cannot be reached" in message
    assert "fetch it once with the network on" in message
    assert _error(f"{GGUF_REPO}:Q3_K").endswith("no GGUF file for quant Q3_K; quants there: Q8_0, Q4_K_M, BF16, Q6_K")
    assert "'tester/other' is not in" in _error("tester/other:Q8_0")


def test_hf_hub_offline_reads_the_cache_without_a_request(mirror: HubMirror, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    path = store.resolve(f"{GGUF_REPO}:Q8_0")
    asked = len(mirror.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert store.resolve(f"{GGUF_REPO}:Q8_0") == path
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as when set before huggingface_hub is imported
    assert store.resolve(f"{GGUF_REPO}:Q8_0") == path
    assert len(mirror.requests) == asked  # the mirror is up, and was not asked
    message = _error(f"{GGUF_REPO}:BF16")
    assert "tiny-BF16.gguf" in message and "HF_HUB_OFFLINE is set" in message
    assert "HF_HUB_OFFLINE is set" in _error("tester/never-fetched")


def test_a_dropped_transfer_resumes_where_it_stopped(
    mirror: HubMirror, gguf_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    # huggingface_hub keeps what it wrote, whole chunks of this size (10 MB, more than the tiny model)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    mirror.drop_first.add("tiny-Q8_0.gguf")
    assert store.resolve(f"{GGUF_REPO}:Q8_0").read_bytes() == gguf_bytes
    first, again = (r for m, p, r in mirror.requests if m == "GET" and p.endswith("/tiny-Q8_0.gguf"))
    assert first is None
    kept = len(gguf_bytes) // 2 // (1 << 16) * (1 << 16)  # the chunks written before the connection dropped
    assert kept > 0 and again == f"bytes={kept}-"


def test_refusals_name_what_is_missing_in_one_line(mirror: HubMirror, monkeypatch: pytest.MonkeyPatch) -> None:
    message = _error("tester/no-such-repo:Q8_0")
    assert message.startswith("'tester/no-such-repo' is not a model repo on the Hub") and mirror.url in message
    assert _error(f"{GGUF_REPO}:Q5_K_M") == (
        f"Hub repo '{GGUF_REPO}' has no GGUF file for quant Q5_K_M; quants there: Q8_0, Q4_K_M, BF16, Q6_K"
    )
    assert _error(f"{GGUF_REPO}/tiny-Q2_K.gguf").startswith(f"Hub repo '{GGUF_REPO}' has no file tiny-Q2_K.gguf")
    assert _error("tester/empty") == "Hub repo 'tester/empty' has no GGUF file"
    assert _error(f"{GGUF_REPO}/tiny-Q6_K-00001-of-00002.gguf").endswith("specserve loads a single-file GGUF")
    assert "is gated: accept its terms on its page, then set HF_TOKEN" in _error("tester/gated-GGUF:Q8_0")
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    assert store.resolve("tester/gated-GGUF:Q8_0").name == "tiny-Q8_0.gguf"
    assert store.resolve(f"{GGUF_REPO}/tiny-BF16.gguf").name == "tiny-BF16.gguf"  # one file by its name
    assert "nor a Hugging Face Hub id" in _error("no-such-model")  # not a Hub id: the catalog's refusal


@pytest.fixture(scope="module")
def hf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """An HF directory (config.json, safetensors, tokenizer files) of a tiny random model, as transformers
    writes it from the tiny GGUF (as tests/test_architectures.py does), plus files the loader does not read."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("tiny-hf")
    gguf = write_tiny_gguf(root / "tiny.gguf", "qwen3")
    # transformers does not read a qwen3 GGUF's head size (tests/test_architectures.py: HF_OVERRIDES)
    model = AutoModelForCausalLM.from_pretrained(str(root), gguf_file=gguf.name, dtype=torch.float32, head_dim=32)
    config = model.config.__class__.from_dict(
        {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    )
    plain = type(model)(config)  # the same weights without the GGUF quantizer, which cannot be saved
    plain.load_state_dict(model.state_dict())
    out = root / "hf"
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(root), gguf_file=gguf.name).save_pretrained(out)
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    files.update({"README.md": b"# tiny\n", "pytorch_model.bin": b"a pickle", "tiny-Q8_0.gguf": gguf.read_bytes()})
    files["onnx/model.safetensors"] = b"another format"
    return files


def test_a_safetensors_repo_becomes_an_hf_directory(
    mirror: HubMirror, hf_files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.engine.model.loading import load_model

    mirror.repos[HF_REPO] = hf_files
    path = store.resolve(HF_REPO)  # no quant: the repo's own weights, as vLLM's --model
    assert path.is_dir() and (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert not {"README.md", "pytorch_model.bin", "tiny-Q8_0.gguf", "onnx"} & {p.name for p in path.iterdir()}
    ours = load_model(path, "float32")
    theirs = load_model(store.resolve(f"{HF_REPO}:Q8_0"), "float32")  # a quant: the GGUF beside
    ids = torch.tensor([[5, 9, 30, 7]])
    with torch.inference_mode():
        assert torch.allclose(ours.model(ids), theirs.model(ids), atol=1e-4)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert store.resolve(HF_REPO) == path
    mirror.repos["tester/no-tokenizer"] = {k: v for k, v in hf_files.items() if k != "tokenizer.json"}
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert _error("tester/no-tokenizer") == (
        "Hub repo 'tester/no-tokenizer' has no tokenizer.json (specserve reads the fast tokenizer's file)"
    )


def _served_target(monkeypatch: pytest.MonkeyPatch, *argv: str) -> str:
    """The target `specserve serve ARGV` would load (the server and the model's check stubbed out)."""
    import app.api.server
    import app.service.logs

    seen: list = []
    monkeypatch.setattr(app.api.server, "serve", lambda settings: seen.append(settings) or True)
    monkeypatch.setattr(app.service.logs, "configure_logging", lambda *args: None)
    monkeypatch.setattr(store, "resolve", lambda name: Path(name))
    assert cli.main(["serve", *argv]) == 0
    return seen[0].target


def test_serve_takes_the_model_as_vllm_and_llama_cpp_users_type_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("SPECSERVE_TARGET", raising=False)
    assert _served_target(monkeypatch, "Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M", "--port", "9") == (
        "Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M"
    )
    assert _served_target(monkeypatch, "--model", "o/r:Q8_0") == "o/r:Q8_0"
    assert _served_target(monkeypatch, "o/r", "--target", "o/r") == "o/r"  # the same twice is no conflict
    monkeypatch.setenv("SPECSERVE_TARGET", "o/from-env")
    assert _served_target(monkeypatch) == "o/from-env"
    assert _served_target(monkeypatch, "o/r") == "o/r"  # the command line wins
    assert cli.main(["serve", "o/a", "--model", "o/b"]) == 1
    assert capsys.readouterr().err == "error: two targets given: MODEL 'o/a' and --target/--model 'o/b'\n"
    generate = cli.build_parser().parse_args(["generate", "hi", "--model", "o/r:Q8_0"])
    assert generate.target == "o/r:Q8_0"

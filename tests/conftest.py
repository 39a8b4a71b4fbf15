"""Shared session-scoped fixtures.

Engine fixtures (below): the real default target loaded once per session in float32 (and a bfloat16
copy), transformers' own model and tokenizer for the same GGUF (the oracle; a test-only dependency),
the first Spec-Bench prompts, and factories for tiny random decoders and toy tokenizers. Factories are
session-scoped fixtures returning plain functions, so hypothesis tests can use them too.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from app import store
from app.engine import kernels
from app.engine.kernels import build as kernel_build
from app.engine.model.config import ModelConfig
from app.engine.model.loading import LoadedModel, load_model
from app.engine.model.tokenizer import Tokenizer
from app.engine.model.transformer import Transformer

# transformers must never reach for a hub: everything it loads here is a local file.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under pytest-xdist (`make test` runs two workers) each worker gets its share of the cores, and so do the servers
# its tests start (they inherit OMP_NUM_THREADS): OpenMP threads that outnumber the cores spin against each other
# and run many times slower. Tests of thread-count independence set their own counts.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET_NAME = "smollm2-135m-instruct"
SPECBENCH = REPO_ROOT.parent / "shared" / "bench" / "specbench-dev.jsonl"  # read only where present
BENCH_PROMPTS = REPO_ROOT / "app" / "bench" / "prompts.jsonl"
# What engine tests pin where they count steps or forwards: a fixed draft length without a confidence cut-off,
# prompts prefilled whole (the library's defaults are the server's, app.engine.defaults).
# The Host names the in-process apps answer to: the default's loopback names and httpx's test host.
TEST_HOSTS = "localhost,127.0.0.1,[::1],testserver"
FIXED_DRAFT = {"draft_schedule": "fixed", "draft_p_min": 0.0, "prefill_chunk": 0, "prefill_step_seconds": 0.0}


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """asyncio only, the loop uvicorn serves on: anyio's plugin would also run every async test on trio, which
    the browser tests' selenium installs, and the app's thread pools need a running asyncio loop."""
    return "asyncio"


# --- the real target ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def target_path() -> Path:
    """The default target's GGUF (`make test` fetches it before pytest runs)."""
    return store.resolve(TARGET_NAME)


@pytest.fixture(scope="session")
def target_f32(target_path: Path) -> LoadedModel:
    return load_model(target_path, "float32", "cpu")


# --- CPU kernels -------------------------------------------------------------------------------------------

# A kernel a test builds without naming a directory (kernels.load(name), a model packed inside a test) goes into the
# model store's kernel cache, the one the engine's own builds use, instead of each process's private temporary one:
# both xdist workers and the next run then find it built. A library's file name is a digest of its sources, flags,
# compiler and CPU (build.library), so what is found there is this very build; without this every worker compiled
# every kernel again at -O3. (The cache's trust checks still run on it.)
_KERNEL_CACHE = store.cache_dir() / "kernels"
_KERNEL_CACHE.mkdir(mode=0o755, parents=True, exist_ok=True)
kernel_build.private_dir = lambda: _KERNEL_CACHE

# Every kernel this CPU runs, best first, then torch's oneDNN/SDPA path: the exactness promises are tested on
# each (an AMX machine runs them all; elsewhere the ones below its best).
KERNELS = [*kernels.available(), "torch"]
# The best kernel and generic, for end-to-end checks of properties a kernel holds by giving each row its own bits:
# every portable kernel between them computes generic's bits op by op (test_kernels checks each), so the
# engine-level checks there would repeat generic's; the promises each kernel must keep on its own (batched ==
# alone, a seed's tokens, speculative == target-only) still run on every kernel.
KERNEL_ENDS = list(dict.fromkeys([kernels.available()[0], "generic"]))


def assert_same_on_thread_counts(
    compute: Callable[[], torch.Tensor], expected: torch.Tensor, counts: tuple[int, ...] = (1, 2)
) -> None:
    """`compute()` gives `expected`'s very bits on each of `counts` threads (the thread count is restored)."""
    threads = torch.get_num_threads()
    try:
        for n in counts:
            torch.set_num_threads(n)
            assert torch.equal(compute(), expected), n
    finally:
        torch.set_num_threads(threads)


def use_kernel(name: str) -> AbstractContextManager[None]:
    """Models packed (and engines built) inside run on kernel `name`, as with SPECSERVE_KERNEL=name."""
    return kernels.selected(name)


@pytest.fixture(scope="session")
def packed_target(target_f32: LoadedModel, target_bf16: LoadedModel) -> Callable[[str], LoadedModel]:
    """The target in bfloat16 packed for a given kernel, as the server runs it there (one copy per kernel)."""
    made: dict[str, LoadedModel] = {}

    def get(name: str) -> LoadedModel:
        if name not in made:
            model = copy.deepcopy(target_bf16.model)
            with use_kernel(name):
                model.pack(kernels.kernel())
            made[name] = LoadedModel(model, target_f32.tokenizer, f"bf16 on {name}", 0.0)
        return made[name]

    return get


@pytest.fixture(scope="session")
def target_bf16(target_f32: LoadedModel) -> LoadedModel:
    """The target's own weights in bfloat16: a cheap "quantized" draft that mostly agrees with it.

    Cast from the float32 copy (what `load_model(path, "bfloat16")` does to the same dequantized state
    dict) instead of reading the file a second time.
    """
    model = copy.deepcopy(target_f32.model).to(torch.bfloat16)
    return LoadedModel(model, target_f32.tokenizer, target_f32.source + " (bfloat16)", 0.0)


_READERS: dict[tuple[str, int, int], object] = {}


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """transformers' GGUF loads inside parse each file's header once per worker, not once per use.

    Its `from_pretrained` runs the `gguf` package's pure-Python GGUFReader over the whole header for the config,
    again for the weights, and again for a tokenizer: seconds each for a vocabulary of 49 k tokens, most of an
    oracle load. The reader only reads, so one per file (keyed by its path, size and modification time) serves
    them all; the oracle stays the `gguf` package's own reading."""
    import gguf

    real = gguf.GGUFReader

    def reader(path: str | os.PathLike[str], mode: str = "r") -> object:
        if mode != "r":
            return real(path, mode)
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        if key not in _READERS:
            _READERS[key] = real(path, mode)
        return _READERS[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


@pytest.fixture(scope="session")
def hf_target(target_path: Path):
    """transformers' LlamaForCausalLM for the same GGUF, dequantized to float32."""
    from transformers import AutoModelForCausalLM

    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(
            str(target_path.parent), gguf_file=target_path.name, dtype=torch.float32
        )
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def hf_tokenizer(target_path: Path):
    from transformers import AutoTokenizer

    with gguf_parsed_once():
        return AutoTokenizer.from_pretrained(str(target_path.parent), gguf_file=target_path.name)


@pytest.fixture(scope="session")
def first_turns() -> list[str]:
    """The first turns of the first three of `specserve bench`'s own prompts (app/bench/prompts.jsonl: writing,
    role-play, reasoning), shipped with the package: the tests read nothing outside the repository."""
    rows = [json.loads(line) for line in BENCH_PROMPTS.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [row["turns"][0] for row in rows[:3]]


# --- tiny models and toy tokenizers ------------------------------------------------------------------------


def _tiny_config(
    vocab_size: int = 64,
    dim: int = 32,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    intermediate_size: int = 48,
    rope_theta: float = 10000.0,
    tie_embeddings: bool = True,
    qkv_bias: bool = False,
    max_seq_len: int = 256,
    embed_scale: float = 1.0,
) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        intermediate_size=intermediate_size,
        rope_theta=rope_theta,
        tie_embeddings=tie_embeddings,
        qkv_bias=qkv_bias,
        max_seq_len=max_seq_len,
        embed_scale=embed_scale,
    )


def _make_tiny_model(seed: int = 0, **config) -> Transformer:
    """A random float32 decoder; norms get random gains too, so that no weight is trivially 1."""
    torch.manual_seed(seed)
    model = Transformer(_tiny_config(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval().requires_grad_(False)


def _truncate_layers(model: Transformer, n_layers: int) -> Transformer:
    """A decoder made of `model`'s first `n_layers` blocks, its final norm and its head (an early-exit draft)."""
    cfg = ModelConfig.from_dict({**model.config.to_dict(), "n_layers": n_layers})
    small = Transformer(cfg).to(model.dtype)
    state = {
        k: v for k, v in model.state_dict().items() if not k.startswith("layers.") or int(k.split(".")[1]) < n_layers
    }
    small.load_state_dict(state, strict=True)
    return small.eval().requires_grad_(False)


def _word_tokenizer(vocab_size: int, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
    """Token i is the word `t<i>`; decoding joins words with spaces. No special tokens, no template."""
    backend = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, [], None, None, eos_token_ids)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _byte_tokenizer(specials: Sequence[str] = ("<|im_end|>",)) -> Tokenizer:
    """Byte-level BPE without merges: token id b is the single byte b; specials follow at 256, 257, ..."""
    table = _bytes_to_unicode()
    backend = HFTokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return Tokenizer(backend, list(specials), None, None, ())


@pytest.fixture(scope="session")
def make_tiny_model() -> Callable[..., Transformer]:
    """`make_tiny_model(seed, vocab_size=..., n_layers=..., ...)`: a random tiny float32 Transformer."""
    return _make_tiny_model


@pytest.fixture(scope="session")
def truncate_layers() -> Callable[[Transformer, int], Transformer]:
    return _truncate_layers


@pytest.fixture(scope="session")
def word_tokenizer() -> Callable[..., Tokenizer]:
    """`word_tokenizer(vocab_size, eos_token_ids=())`: words t0, t1, ... as token ids 0, 1, ..."""
    return _word_tokenizer


@pytest.fixture(scope="session")
def byte_tokenizer() -> Callable[..., Tokenizer]:
    """`byte_tokenizer(specials=("<|im_end|>",))`: one token per byte (id == byte value)."""
    return _byte_tokenizer


# --- the HTTP service --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def api_engine(target_f32: LoadedModel):
    """An Engine over the session's float32 target with the n-gram draft (default, k=4), as the server builds."""
    from app.engine.drafting.ngram import NgramDrafter
    from app.engine.engine import Engine

    return Engine(target_f32.model, target_f32.tokenizer, {"ngram": NgramDrafter()}, "ngram", 4, **FIXED_DRAFT)


@pytest.fixture(scope="session")
def api_client(api_engine):
    """`async with api_client(engine=None, **settings) as client`: an httpx client of an app served in process.

    The app runs its lifespan (so its worker thread) around the block; `engine` defaults to `api_engine`.
    """
    import contextlib

    import httpx

    from app.api.server import create_app
    from app.service.settings import Settings

    @contextlib.asynccontextmanager
    async def client(engine=None, **settings):
        # httpx's and the openai SDK's test URLs say http://testserver: a name the Host check of a keyless
        # loopback server refuses by default, so the tests' apps list it beside the default's.
        settings.setdefault("allowed_hosts", TEST_HOSTS)
        app = create_app(Settings(**settings), engine if engine is not None else api_engine)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=120) as c:
                c.app = app  # type: ignore[attr-defined]
                yield c

    return client


@pytest.fixture(scope="session")
def real_server(tmp_path_factory: pytest.TempPathFactory, target_path: Path) -> Iterator[str]:
    """The base URL of one real `specserve serve` process (`_server.shared_server_args`), shared by the modules
    that need only a server (one per test worker). Its tests leave it idle and read its counters as deltas."""
    from _server import running_server, shared_server_args

    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server(log, *shared_server_args()) as url:
        yield url


def _sse_data(body: str) -> list[str]:
    """The `data:` payloads of a server-sent-event stream, in order (multi-line data joined by newlines)."""
    events, data = [], []
    for line in body.splitlines():
        if not line:
            if data:
                events.append("\n".join(data))
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        events.append("\n".join(data))
    return events


@pytest.fixture(scope="session")
def sse_data() -> Callable[[str], list[str]]:
    """`sse_data(body)`: the `data:` payloads of a server-sent-event stream."""
    return _sse_data


# --- the fast loop -------------------------------------------------------------------------------------------

# Modules that run the real target without the fixtures below (a server process, the CLI, `build_engine`).
_REAL_TARGET_MODULES = {
    "test_bench",
    "test_cli_generate",
    "test_clients",
    "test_distill",
    "test_hostile",
    "test_prometheus",
    "test_server_lifecycle",
    "test_server_process",
    "test_ui",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that load the real pretrained target are `slow` (every fixture built on `target_path`, and the
    modules above), as are those marked by hand (the real target through `build_engine`, the statistical sampling
    checks): `make test-fast` (`-m "not slow"`) runs the rest, on tiny models and toy tokenizers."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        if "target_path" in getattr(item, "fixturenames", ()) or module in _REAL_TARGET_MODULES:
            item.add_marker(pytest.mark.slow)

"""Turning a checkpoint path into a ready decoder and tokenizer, in the dtype and on the device asked."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from app.engine import kernels
from app.engine.defaults import WEIGHTS
from app.engine.kernels.quantized import QuantizedWeight
from app.engine.model.config import ModelConfig
from app.engine.model.packing import PackedLinear, can_pack
from app.engine.model.tokenizer import Tokenizer
from app.engine.model.transformer import Transformer
from app.engine.model.weights import WeightsError, check_shapes, read_checkpoint, read_tokenizer_meta

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def auto_native(kernel: str) -> bool:
    """Whether `weights=auto` keeps a GGUF's quantized matrices as the file's blocks on kernel `kernel`, computed
    on by it with bfloat16 activations (`torch`: none): as the kernel's record says (`KernelSpec.auto_native`);
    elsewhere they are dequantized at load to the dtype."""
    spec = kernels.SPECS.get(kernel)
    return spec is not None and spec.auto_native


@dataclass
class LoadedModel:
    """A decoder ready to run, its tokenizer, and where it came from."""

    model: Transformer
    tokenizer: Tokenizer
    source: str
    load_seconds: float

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def weights(self) -> str:
        """What the weights run as: `bfloat16`, `float32`, or the GGUF formats computed on (`Q4_1+Q8_0`)."""
        return self.model.weights()[0]

    @property
    def weight_bytes(self) -> int:
        """Bytes the decoder's weights hold in memory, as laid out for what runs them."""
        return self.model.weights()[1]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of the GGUF file at `path` alone (its weights are not read): to count or encode text."""
    return Tokenizer.from_metadata(read_tokenizer_meta(Path(path)))


def resolve_device(device: str) -> torch.device:
    """`auto` is CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@functools.cache
def _bf16_is_faster_on_cpu() -> bool:
    # On a CPU kernel bf16 products read half the bytes of float32 and decoding is memory-bound; a timing
    # probe on a busy machine (another process, a profiler pausing this one) could say otherwise.
    if kernels.kernel() is not None:
        log.info("dtype: bfloat16 on the %s kernel", kernels.name())
        return True
    # Else time what decoding runs: the default target's MLP weight (576x1536) times 1 row (a plain step) and
    # 8 rows (a verification), in float32 and in bfloat16 as the decoder would run it (packed where oneDNN
    # allows); the best of five rounds, so that a moment of noise does not decide. Where bf16 is emulated
    # instead of done by AVX512-BF16, float32 wins.
    weight = torch.randn(1536, 576)
    cases = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = weight.to(dtype)
        product = (
            PackedLinear(w, None, None)
            if can_pack(dtype, torch.device("cpu"), None)
            else functools.partial(torch.nn.functional.linear, weight=w)
        )
        xs = [torch.randn(rows, 576, dtype=dtype) for rows in (1, 8)]
        for x in xs:
            product(x)
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(10):
                for x in xs:
                    product(x)
            rounds.append(time.perf_counter() - t0)
        cases[dtype] = min(rounds)
    log.info("dtype probe: float32 %.2f ms, bfloat16 %.2f ms", cases[torch.float32] * 1e3, cases[torch.bfloat16] * 1e3)
    return cases[torch.bfloat16] < cases[torch.float32]


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA with bf16 support, and on a CPU where measured bf16 products are faster."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _bf16_is_faster_on_cpu() else torch.float32


def _weights_plan(
    weights: str, dtype: str | torch.dtype, dev: torch.device, cache_dir: Path | None
) -> tuple[bool, str | torch.dtype]:
    """(keep a GGUF's quantized matrices quantized, the dtype to load in) for the `weights` setting."""
    if weights not in WEIGHTS:
        raise WeightsError(f"unknown weights {weights!r}; choose {', '.join(WEIGHTS)}")
    bf16 = dtype in ("auto", "bfloat16", torch.bfloat16)
    if weights in ("bf16", "float32"):
        want = torch.bfloat16 if weights == "bf16" else torch.float32
        if dtype not in ("auto", want, str(want).removeprefix("torch.")):
            raise WeightsError(f"weights {weights} run in {want}, which dtype {dtype} contradicts")
        return False, want
    if weights == "auto" and not (dev.type == "cpu" and bf16):
        return False, dtype
    if dev.type != "cpu" or not bf16:
        raise WeightsError(f"native weights run on the CPU kernels with bfloat16 activations, not {dtype} on {dev}")
    chosen = kernels.kernel(None if cache_dir is None else Path(cache_dir) / "kernels")
    if chosen is None and weights == "native":
        raise WeightsError("native weights need a CPU kernel (SPECSERVE_KERNEL is torch, or none could be built)")
    if weights == "auto" and not auto_native("torch" if chosen is None else chosen.name):
        return False, dtype
    return True, torch.bfloat16


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    max_seq_len: int | None = None,
    cache_dir: Path | None = None,
    weights: str = "auto",
) -> LoadedModel:
    """Load a GGUF file or HF directory at `path` as a Transformer plus its Tokenizer.

    `cache_dir`: the engine's cache directory; the CPU kernels are built into its `kernels/` (None: into a
    private temporary directory, compiled again by every process). `build_engine` passes the model store's.
    `weights` (see WEIGHTS): `native` keeps a GGUF's quantized matrices as their blocks, computed on by the
    CPU kernel (dtype auto or bfloat16, on the CPU; a WeightsError otherwise); `bf16`/`float32` dequantize them
    to that dtype.
    """
    t0 = time.perf_counter()
    dev = resolve_device(device) if isinstance(device, str) else device
    native, dtype = _weights_plan(weights, dtype, dev, cache_dir)
    kernel = None
    if dev.type == "cpu" and (dtype == "auto" or dtype in ("bfloat16", torch.bfloat16)):
        # The first selection builds the kernel (bfloat16 runs on it, `auto` asks whether one runs): here. The
        # model is then packed for this kernel, passed on as a value.
        kernel = kernels.kernel(None if cache_dir is None else Path(cache_dir) / "kernels")
    dt = resolve_dtype(dtype, dev) if isinstance(dtype, str) else dtype
    ckpt = read_checkpoint(Path(path), max_seq_len, quantized=native)
    with torch.device("meta"):
        model = Transformer(ckpt.config)
    # Every tensor against the parameter it becomes, before anything runs on it: the kernels read a quantized
    # matrix by the sizes it carries, and torch's own refusal of a plain one would be a traceback.
    check_shapes(ckpt, {name: tuple(t.shape) for name, t in model.state_dict().items()})
    state = {k: v.to(dt) for k, v in ckpt.state_dict.items() if isinstance(v, torch.Tensor)}
    quantized = {k: v for k, v in ckpt.state_dict.items() if isinstance(v, QuantizedWeight)}
    model.load_state_dict(state, assign=True, strict=False)  # the names and shapes are checked: `quantized` stay
    model.load_quantized(quantized, kernel)
    model = model.to(dev).eval().requires_grad_(False)
    model.pack(kernel)
    tokenizer = Tokenizer.from_metadata(ckpt.tokenizer_meta, ckpt.config.eos_token_ids)
    elapsed = time.perf_counter() - t0
    kind, size = model.weights()
    log.info("loaded %s (weights %s, %.0f MB; %s, %s) in %.1f s", path, kind, size / 1e6, dt, dev, elapsed)
    return LoadedModel(model, tokenizer, ckpt.source, elapsed)

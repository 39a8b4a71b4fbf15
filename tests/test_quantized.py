"""GGUF quantized weights computed on as the file stores them (app/engine/kernels/quantized.py, kernels/quant.h).

Every format's product against float64 products of its exact dequantized values (`gguf.quants.dequantize`)
and the exact values of the quantized activations (every format takes integer products, quant.h): the oracle,
within a stated bound; each dequantized value decoded, the portable kernels' bits equal to the generic
kernel's, rows independent of the batch; small GGUFs in every format loaded with `weights="native"`; and the
default target (Q4_1 layers, a Q8_0 embedding and head) decoding natively: greedy speculative == target-only,
batched == alone.

Test weights: Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 are quantized by gguf.quants from random floats; gguf cannot
quantize the K-quants, so Q4_K, Q5_K and Q6_K are random blocks (random quants and packed scales, float16
super-block scales in a range that keeps the values O(1)).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from app.engine import kernels
from app.engine.kernels import detect
from app.engine.kernels.quantized import FORMATS, QuantizedWeight
from app.engine.kernels.table import REFERENCE
from app.engine.model.loading import load_model
from app.engine.model.weights import held_weights
from tests.conftest import TARGET_NAME, assert_same_on_thread_counts, use_kernel
from tests.test_kernels import assert_layer_stack_gives_layer_by_layer_bits
from tests.test_weights import IDS, _gguf_source_model, _our_logits, _write_gguf

HERE = kernels.available()
PORTABLE = [name for name in HERE if kernels.SPECS[name].exact and name != REFERENCE]


def random_weight(qtype: str, n: int, k: int, seed: int) -> QuantizedWeight:
    """A random [n, k] weight in `qtype` (see the module's docstring for how)."""
    rng = np.random.default_rng(seed)
    _, qk, size = FORMATS[qtype]
    if qk == 32:
        w = (rng.standard_normal((n, k)) / 4).astype(np.float32)
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    else:
        raw = rng.integers(0, 256, (n, k // qk, size), dtype=np.uint8)
        at = 208 if qtype == "Q6_K" else 0  # Q6_K: d last; Q4_K/Q5_K: d and dmin first
        scales = rng.uniform(1e-4, 6e-4, (n, k // qk, 1 if qtype == "Q6_K" else 2)).astype("<f2")
        raw[:, :, at : at + scales.shape[-1] * 2] = scales.view(np.uint8)
        raw = raw.reshape(n, -1)
    return QuantizedWeight([(qtype, torch.from_numpy(np.ascontiguousarray(raw)))], k)


def quantized_activations(x: torch.Tensor, qtype: str = "Q4_1") -> torch.Tensor:
    """The exact values an integer product on `qtype` multiplies for bf16 rows x [..., K] (quant.h): per block of
    32 inputs (the K-quants: 256), dx = max |x| / 127; per 32 inputs e, the largest of 0-3 with 2^e times their max
    |x| at most the block's; x * (1 / dx * 2^e) rounded to the nearest integer (ties to even), times dx / 2^e;
    float64 [..., K]."""
    qa = 256 if FORMATS[qtype][1] == 256 else 32
    blocks = x.float().reshape(*x.shape[:-1], -1, qa // 32, 32)
    amax = blocks.abs().amax((-2, -1), keepdim=True)
    dx = amax / 127
    inverse = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    e = torch.zeros_like(blocks[..., :1])
    chunk = blocks.abs().amax(-1, keepdim=True)
    for step in (1, 2, 3):
        e = torch.where(chunk * 2.0**step <= amax, float(step), e)
    steps = torch.round(blocks * (inverse * 2**e)).double()
    return (steps * dx.double() / 2 ** e.double()).reshape(x.shape)


def varied_rows(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random bf16 rows [rows, k] whose 32-input chunks differ in size by up to 32x (activations do: a K-quant
    product's chunks then take each of their steps)."""
    sizes = 2.0 ** -torch.randint(0, 6, (rows, k // 32, 1), generator=g).float()
    return (torch.randn(rows, k // 32, 32, generator=g) * sizes).reshape(rows, k).bfloat16()


@pytest.fixture(params=HERE)
def kern(request) -> kernels.Kernel:
    return kernels.load(request.param)


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_each_format_against_its_exact_dequantized_values(kern, qtype: str) -> None:
    n, k = 96, 512
    weight = random_weight(qtype, n, k, seed=k + n + FORMATS[qtype][0])
    exact = weight.dequantize().double()
    assert exact.abs().max() < 100 and exact.std() > 0.01  # values of a sensible size, not all alike

    # Each dequantized value: an input that is one at position j gives column j's weights, rounded to bf16 (times
    # 127 * (1 / 127) for an integer product, and the offset's own product: a few float32 roundings more).
    cols = torch.arange(0, k, 7)
    lin = kern.qlinear(weight, None)
    got = lin(torch.eye(k)[cols].bfloat16())
    assert ((got.double() - exact[:, cols].T).abs() <= 2**-8 * exact[:, cols].T.abs() + 2**-20).all()

    # Products: k / 32 steps of exact integer sums, scales rounded once, and the offsets' chain (the K-quants: a
    # step per 256 inputs and the minimums'; float32 roundings), then one bf16 rounding (2^-8 relative); against
    # the exact values multiplied.
    g = torch.Generator().manual_seed(FORMATS[qtype][0])
    x = varied_rows(50, k, g)  # 48 rows and more: a prefill's path (amxint8's tiles)
    bias = torch.randn(n, generator=g).bfloat16()
    y = kern.qlinear(weight, bias)(x).double()
    xs = quantized_activations(x, qtype)
    ref = xs @ exact.T + bias.double()
    magnitude = xs.abs() @ exact.abs().T + bias.double().abs()
    bound = 2**-8 * ref.abs() + 2 * (k / 16 + 5) * 2**-24 * magnitude
    assert ((y - ref).abs() <= bound).all(), ((y - ref).abs() / bound).max()

    # A row's bits depend on nothing but itself: rows alone, a few at a time, any thread count.
    lin = kern.qlinear(weight, bias)
    whole = lin(x)
    assert all(torch.equal(lin(x[i : i + 1]), whole[i : i + 1]) for i in range(50))
    assert torch.equal(torch.cat([lin(x[:5]), lin(x[5:7]), lin(x[7:])]), whole)
    assert_same_on_thread_counts(lambda: lin(x), whole)


def test_fused_norm_swiglu_residual_and_mixed_formats(kern) -> None:
    """What DecoderBlock fuses into the product calls, on quantized weights, against the torch ops; and a
    weight of two formats (a fused q/k/v of a Q4_K_M file) gives each part's own bits."""
    g = torch.Generator().manual_seed(5)
    k, n = 256, 64
    weight = random_weight("Q4_1", n, k, seed=1)
    w = weight.dequantize()
    lin = kern.qlinear(weight, None)
    x = torch.randn(1, 5, k, generator=g).bfloat16()
    norm_w = (1 + torch.randn(k, generator=g) / 4).bfloat16()
    residual = torch.randn(1, 5, n, generator=g).bfloat16()
    # Q4_1 multiplies the fused op's bf16 result quantized (quantized_activations).
    normed = quantized_activations(F.rms_norm(x.float(), (k,), norm_w.float(), 1e-5).bfloat16()).float()
    torch.testing.assert_close(lin(x, norm=norm_w, eps=1e-5).float(), F.linear(normed, w), rtol=2e-2, atol=2e-2)
    gate_up = torch.randn(1, 5, 2 * k, generator=g).bfloat16()
    gate, up = gate_up.float().chunk(2, dim=-1)
    swiglu = quantized_activations((F.silu(gate) * up).bfloat16()).float()
    torch.testing.assert_close(lin(gate_up, swiglu=True).float(), F.linear(swiglu, w), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(
        lin(x, residual=residual).float(), lin(x).float() + residual.float(), rtol=1e-2, atol=1e-2
    )
    assert torch.equal(lin(x[:, 3:4], norm=norm_w, eps=1e-5), lin(x, norm=norm_w, eps=1e-5)[:, 3:4])

    parts = [
        random_weight("Q4_K", 32, k, seed=2),
        random_weight("Q6_K", 48, k, seed=3),
        random_weight("Q4_K", 16, k, 4),
    ]
    mixed = QuantizedWeight.cat(parts)
    assert [q for q, _ in mixed.segments] == ["Q4_K", "Q6_K", "Q4_K"] and mixed.shape == (96, k)
    bias = torch.randn(96, generator=g).bfloat16()
    together = kern.qlinear(mixed, bias)(x, norm=norm_w, eps=1e-5)
    alone = [kern.qlinear(p, b)(x, norm=norm_w, eps=1e-5) for p, b in zip(parts, bias.split([32, 48, 16]), strict=True)]
    assert torch.equal(together, torch.cat(alone, dim=-1))


def _everything(kern: kernels.Kernel) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(12)
    x = torch.randn(59, 512, generator=g).bfloat16()
    norm_w = (1 + torch.randn(512, generator=g) / 4).bfloat16()
    gate_up = torch.randn(49, 1024, generator=g).bfloat16()
    residual = torch.randn(49, 43, generator=g).bfloat16()
    out = []
    for i, qtype in enumerate(FORMATS):
        weight = random_weight(qtype, 43, 512, seed=20 + i)  # 5 groups of 8 columns and 3 (quant.h's x8 layout)
        bias = torch.randn(43, generator=g).bfloat16()
        out += [kern.qlinear(weight, bias)(x), kern.qlinear(weight, None)(x[:51], norm=norm_w, eps=1e-5)]
        out.append(kern.qlinear(weight, None)(gate_up, swiglu=True, residual=residual))
        # Every tile shape of a step and a verification: 1 to 8 rows (a tile takes 8 on AVX-512, 4 on AVX2: 5-7
        # are 4 and a rest there), and with x's 59, 51 and 49 rows (amxint8's tiles from 48) full tiles and a rest.
        out += [kern.qlinear(weight, bias)(x[:rows]) for rows in range(1, 9)]
    return out


@pytest.mark.parametrize("name", PORTABLE)
def test_portable_kernels_give_the_generic_kernels_bits(name: str) -> None:
    """Every format, plain and fused, few rows and many: the SIMD kernels compute quant.h's arithmetic exactly."""
    for got, want in zip(_everything(kernels.load(name)), _everything(kernels.load("generic")), strict=True):
        assert torch.equal(got, want)


def test_the_vnni_kernels_code_gives_the_generic_kernels_bits_through_its_stand_in() -> None:
    """The VNNI kernels' integer tiles, run on any AVX2 CPU: the avx2 source built with dot4.h's plain-integer
    twin of VPDPBUSD (exact for any bytes) in place of the instruction gives the generic kernel's bits. Where the
    CPU has VNNI, the kernels themselves run in the test above (and their instruction below)."""
    if not kernels.runs_here("vnni-twin"):
        assert "avx2" not in HERE
        return  # no AVX2: the stand-in cannot run (its source still compiles: test_kernels)
    twin = kernels.load("vnni-twin")
    assert twin.dot == "twin" and kernels.load("avx2").dot == "avx2"
    for got, want in zip(_everything(twin), _everything(kernels.load("generic")), strict=True):
        assert torch.equal(got, want)


def test_the_amx_tiles_code_gives_the_generic_kernels_bits_through_its_stand_in() -> None:
    """amxint8's products of many rows (quant_amx.h: weights unpacked for the tiles, a tile product per chunk,
    the chain run on its sums), run on any AVX-512 VNNI CPU: the same source built with plain C in place of the
    AMX-INT8 tile instructions gives the generic kernel's bits (59, 51 and 49 rows take the tiles, full tiles
    and a partial one, with bias, norm, SwiGLU and residual; fewer rows the VNNI tiles). Where the CPU has AMX,
    amxint8 itself runs in the test above."""
    if not kernels.runs_here("amx-twin"):
        assert "avx512vnni" not in HERE
        return  # no AVX-512 VNNI: the stand-in cannot run (its source still compiles: test_kernels)
    for got, want in zip(_everything(kernels.load("amx-twin")), _everything(kernels.load("generic")), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_the_kernels_layout_gives_back_the_files_blocks(kern, qtype: str) -> None:
    """Every format is packed 8 rows at a time for the kernels (quant.h's x8 layout, zero-padded past the last
    row); the rows read back (a tied embedding's lookup, a head's rows for a draft) are the file's
    bytes, so their values are the file's."""
    weight = random_weight(qtype, 43, 256, seed=70 + FORMATS[qtype][0])
    lin = kern.qlinear(weight, None)
    _, packed, count = lin.segments[0]
    assert count == 43 and packed.shape == (48, weight.segments[0][1].shape[1])
    assert torch.equal(lin.blocks().segments[0][1], weight.segments[0][1])
    ids = torch.tensor([42, 0, 7, 8, 9, 7])
    assert torch.equal(lin.select(ids).segments[0][1], weight.select(ids).segments[0][1])
    assert torch.equal(lin.rows(ids.reshape(2, 3)), weight.rows(ids.reshape(2, 3)))
    with pytest.raises(IndexError):
        lin.select(torch.tensor([43]))


def test_torch_dequantization_gives_ggufs_values_bit_for_bit() -> None:
    """Q8_0 and Q4_1 (the default target's embedding and layers) are dequantized by torch's ops, not gguf's numpy
    code (whose overhead was a twentieth of a decoding step): the very float32 values, for quantized floats and
    for random blocks (any quants, any finite float16 scales, subnormal and negative zero included)."""
    from app.engine.kernels.quantized import _dequantize

    rng = np.random.default_rng(5)
    for qtype, size in (("Q8_0", 34), ("Q4_1", 20)):
        raw = rng.integers(0, 256, (40, 18, size), dtype=np.uint8)
        halves = rng.integers(0, 1 << 16, (40, 18, 2), dtype=np.uint16)
        halves[halves & 0x7C00 == 0x7C00] &= 0x83FF  # no infinities or NaNs
        raw[:, :, :4] = halves.view(np.uint8).reshape(40, 18, 4) if qtype == "Q4_1" else raw[:, :, :4]
        if qtype == "Q8_0":
            raw[:, :, :2] = halves[:, :, :1].view(np.uint8).reshape(40, 18, 2)
        blocks = torch.from_numpy(raw.reshape(40, -1))
        for data in (blocks, random_weight(qtype, 40, 576, seed=9).segments[0][1], blocks[[7, 3]]):
            want = gguf.quants.dequantize(np.ascontiguousarray(data.numpy()), gguf.GGMLQuantizationType[qtype])
            got = _dequantize(qtype, data)
            assert got.dtype == torch.float32 and torch.equal(
                got.view(torch.int32), torch.from_numpy(want).view(torch.int32)
            )


# The flags that select each of dot4.h's ways, and the CPU flag it needs to run.
_DOT_WAYS = {
    "avx2": (["-mavx2"], "avx2"),
    "twin": (["-mavx2", "-DSK_DOT_TWIN"], "avx2"),
    "avxvnni": (["-mavx2", "-mavxvnni"], "avx_vnni"),
    "avx512vnni": (["-mavx512f", "-mavx512vl", "-mavx512vnni", "-mavx2"], "avx512_vnni"),
}

_DOT_PROGRAM = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "dot4.h"
int main(int argc, char **argv) {
    int limited = atoi(argv[1]), bad = 0;
    srand(7);
    for (int t = 0; t < 20000; t++) {
        uint8_t a[32]; int8_t b[32]; int32_t acc[8], got[8];
        for (int i = 0; i < 32; i++) {
            /* limited: the operands of quant.h's formats (|w| <= 128 unsigned, |x| <= 127), where the AVX2 way is
               exact; else any bytes, extremes included. */
            a[i] = limited ? (uint8_t)(rand() % 129) : (uint8_t)(t % 7 == 0 ? 255 : rand());
            b[i] = limited ? (int8_t)(rand() % 255 - 127) : (int8_t)(t % 5 == 0 ? -128 : rand());
        }
        for (int j = 0; j < 8; j++) acc[j] = rand() - RAND_MAX / 2;
        __m256i r = q_dot4(_mm256_loadu_si256((const __m256i *)acc), _mm256_loadu_si256((const __m256i *)a),
                           _mm256_loadu_si256((const __m256i *)b));
        _mm256_storeu_si256((__m256i *)got, r);
        for (int j = 0; j < 8; j++) {
            int32_t want = acc[j];
            for (int i = 4 * j; i < 4 * j + 4; i++) want += (int32_t)a[i] * (int32_t)b[i];
            bad += got[j] != want;
        }
    }
    printf("%s %d\n", sk_dot_kind(), bad);
    return 0;
}
"""


@pytest.mark.parametrize("way", list(_DOT_WAYS))
def test_each_way_to_the_dot_products_is_exact(way: str, tmp_path: Path) -> None:
    """dot4.h's q_dot4 against plain integers: VPDPBUSD (AVX512-VNNI, AVX-VNNI) and its stand-in for any bytes, the
    AVX2 pair of instructions for the operands the formats give. Built on every CPU; run where it has the
    instruction."""
    flags, needs = _DOT_WAYS[way]
    gcc = shutil.which("gcc")
    assert gcc is not None
    source = tmp_path / "dot.c"
    source.write_text(_DOT_PROGRAM)
    here = Path(kernels.__file__).parent
    exe = tmp_path / "dot"
    built = subprocess.run(
        [gcc, "-O2", *flags, f"-I{here}", str(source), "-o", str(exe)], capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr
    if needs not in detect.cpu()[1]:
        return  # compiled; this CPU cannot run the instruction
    for limited in ("1", "0") if way != "avx2" else ("1",):
        ran = subprocess.run([str(exe), limited], capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.split() == [way, "0"]


# One tiny model per format (tied and untied heads alternating), the oracle running its exact values in float32.
@pytest.mark.parametrize("qtype", list(FORMATS))
def test_native_weights_on_small_ggufs(tmp_path, qtype: str) -> None:
    tied = list(FORMATS).index(qtype) % 2 == 0
    seed = 50 + list(FORMATS).index(qtype)
    path = tmp_path / f"tiny-{qtype}.gguf"
    _write_gguf(
        path,
        "llama",
        _gguf_source_model("llama", tied, seed).state_dict(),
        gguf.GGMLQuantizationType[qtype],
        tied,
        seed,
    )
    oracle = load_model(path, "float32")
    native = load_model(path, "auto", weights="native")
    dequantized = load_model(path, "auto", weights="bf16")
    assert native.weights == qtype and dequantized.weights == "bfloat16" and oracle.weights == "float32"
    _, qk, size = FORMATS[qtype]
    # Every matrix as its blocks: bytes per weight of the format, plus the float norms.
    params = sum(p.numel() for p in oracle.model.parameters())
    assert native.weight_bytes <= params * size / qk + 20_000 and dequantized.weight_bytes >= 2 * params
    # What `specserve models list` says a model will hold, from the file's header, is what loading holds.
    assert held_weights(path, native=True) == (native.weights, native.weight_bytes)
    assert held_weights(path, native=False) == (dequantized.weights, dequantized.weight_bytes)
    assert native.model.rows_independent()
    want = _our_logits(oracle.model, IDS)
    got = _our_logits(native.model, IDS).float()
    bf16 = _our_logits(dequantized.model, IDS).float()
    # Activations quantized to 8 bits per 32 inputs round about 8 times coarser than bf16: no farther from the
    # oracle than 3 times the distance of the weights dequantized to bf16 (which round every weight as well). The
    # K-quants' one scale per 256 inputs: a random model's chunks are alike in size, so its steps are the block's,
    # up to twice as coarse as a chunk's own (a real model's chunks differ and take their finer powers of two).
    scale = want.abs().max().item()
    distance = (got - want).abs().max().item()
    factor = 3
    within = 0.06 if qk == 256 else 0.04
    assert distance <= within * scale and distance <= factor * (bf16 - want).abs().max().item() + 1e-3 * scale


def test_weights_settings_refuse_what_cannot_run(tmp_path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", _gguf_source_model("llama", True, 70).state_dict(), gguf.GGMLQuantizationType.Q8_0, True)
    with pytest.raises(ValueError, match="bfloat16 activations"):
        load_model(path, "float32", weights="native")
    with pytest.raises(ValueError, match="contradicts"):
        load_model(path, "float32", weights="bf16")
    with pytest.raises(ValueError, match="unknown weights"):
        load_model(path, "auto", weights="q4")
    with use_kernel("torch"), pytest.raises(ValueError, match="need a CPU kernel"):
        load_model(path, "auto", weights="native")
    assert load_model(path, "auto", weights="float32").weights == "float32"


def test_the_default_target_decodes_natively_with_its_promises(target_path) -> None:
    """The default target's own GGUF computed as Q4_1 and Q8_0 blocks, with the shipped feature draft (its
    head rows quantized too): greedy speculative == target-only, and batched == alone, token for token."""
    from app.engine.factory import build_engine
    from app.engine.step import GenerationParams

    engine, loaded = build_engine(TARGET_NAME, num_draft_tokens=6, dtype="auto", device="cpu", weights="native")
    assert loaded.weights == "Q8_0+Q4_1" and engine.batching and loaded.model.rows_independent()
    assert loaded.weight_bytes <= 1.2 * target_path.stat().st_size
    assert_layer_stack_gives_layer_by_layer_bits(loaded.model)
    tok = engine.tokenizer
    turns = ["Write a haiku about rain.", "List three uses of copper.", "Repeat after me: the cat sat on the mat."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in turns]
    # A fixed draft length: the adaptive one may rightly draft nothing where rows cost, and this test is about
    # drafted tokens kept natively.
    params = GenerationParams(max_new_tokens=20, draft_schedule="fixed", num_draft_tokens=4)

    def alone(prompt: list[int], draft: str) -> list[int]:
        gen = engine.start(prompt, params, draft)
        while not gen.finished:
            gen.step()
        return gen.generated_ids

    base = [alone(p, "none") for p in prompts]
    for draft in ("default", "ngram"):
        assert [alone(p, draft) for p in prompts] == base, draft
    jobs = list(zip(prompts, ["default", "none", "ngram"], strict=True))
    gens = [engine.start(p, params, d) for p, d in jobs]
    while any(not g.finished for g in gens):
        outs = engine.step_batch([g for g in gens if not g.finished])
        assert not [o for o in outs if isinstance(o, Exception)]
    assert [g.generated_ids for g in gens] == base
    assert sum(g.stats.accepted for g in gens) > 0


def test_embedding_rows_kept_between_lookups_are_the_tables() -> None:
    """A quantized embedding keeps the rows of its few-token lookups (a decoding step's): each lookup, one token or a
    few, repeated or not, gives the rows a whole-table lookup gives, bit for bit; a caller writing into what it got
    changes no later lookup; at capacity the oldest rows go; an id out of range is refused."""
    from app.engine.model.packing import QuantizedEmbedding

    weight = random_weight("Q8_0", 40, 64, seed=3)
    embed = QuantizedEmbedding(weight, torch.bfloat16)
    embed._most = 5
    table = weight.dequantize().to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        ids = torch.randint(0, 40, (1, int(torch.randint(1, 4, (1,), generator=g))), generator=g)
        got = embed(ids)
        assert got.shape == (*ids.shape, 64) and torch.equal(got, table[ids])
        got.fill_(7)  # the caller's tensor, not a kept row
        assert len(embed._rows) <= 5
    assert torch.equal(embed(torch.arange(40)[None]), table[None])  # a long lookup: the table's rows directly
    with pytest.raises(IndexError):
        QuantizedEmbedding(weight, torch.bfloat16)(torch.tensor([[40]]))

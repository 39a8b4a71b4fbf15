"""The CPU kernels (app/engine/kernels): right values, each row independent of everything else in the call,
the portable kernels bit-identical to the generic one, and the selection, build cache and fallback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from app.engine import kernels
from app.engine.kernels import build, detect
from app.engine.kernels.quantized import FORMATS
from app.engine.model.packing import PackedLinear
from app.engine.model.transformer import Transformer
from tests.conftest import KERNEL_ENDS, assert_same_on_thread_counts, use_kernel

HERE = kernels.available()
# The kernels that give the generic kernel's bits, and those that only come near them (in their own order).
PORTABLE = [name for name in HERE if kernels.SPECS[name].exact]
INEXACT = [name for name in kernels.KERNELS if not kernels.SPECS[name].exact]


@pytest.fixture(params=HERE)
def kern(request) -> kernels.Kernel:
    # Every kernel this CPU runs must load: failing to build one here is a bug, not a skip.
    return kernels.load(request.param)


def test_this_cpu_runs_at_least_the_generic_kernel() -> None:
    assert "generic" in HERE and sorted(HERE, key=kernels.KERNELS.index) == HERE


@pytest.mark.parametrize(("n", "k", "bias"), [(3072, 576, False), (960, 576, True), (100, 64, True)])
def test_values_match_float32_product(kern, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    x = torch.randn(2, 5, k, generator=g).bfloat16()
    y = kern.linear(w, b)(x)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.shape == (2, 5, n) and y.dtype == torch.bfloat16
    # bf16 output rounding: relative 2^-8 of the magnitude, plus the f32 accumulation's own error.
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=0.06 * ref.abs().max().item() / 8)


def test_a_row_does_not_depend_on_the_row_count_or_threads(kern) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1536, 576, generator=g).bfloat16()
    lin = kern.linear(w, None)
    x = torch.randn(40, 576, generator=g).bfloat16()
    whole = lin(x)
    for rows in (1, 2, 3, 4, 5, 7, 16, 17, 33):
        assert torch.equal(lin(x[:rows]), whole[:rows]), rows
    assert torch.equal(lin(x[23:24]), whole[23:24])
    assert_same_on_thread_counts(lambda: lin(x), whole)
    assert torch.equal(lin(x), whole)  # and again: the same bits every run


def test_fused_norm_swiglu_and_residual_match_torch(kern) -> None:
    # What DecoderBlock runs inside the product calls on a kernel, against the torch ops it replaces.
    g = torch.Generator().manual_seed(3)
    k, n = 64, 128
    w = (torch.randn(n, k, generator=g) / 8).bfloat16()
    lin = kern.linear(w, None)
    x = torch.randn(1, 5, k, generator=g).bfloat16()
    norm_w = (1 + torch.randn(k, generator=g) / 4).bfloat16()
    residual = torch.randn(1, 5, n, generator=g).bfloat16()

    normed = F.rms_norm(x.float(), (k,), norm_w.float(), 1e-5)
    torch.testing.assert_close(lin(x, norm=norm_w, eps=1e-5).float(), F.linear(normed, w.float()), rtol=2e-2, atol=2e-2)

    gate_up = torch.randn(1, 5, 2 * k, generator=g).bfloat16()
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = F.linear(F.silu(gate) * up, w.float())
    torch.testing.assert_close(lin(gate_up, swiglu=True).float(), expected, rtol=2e-2, atol=2e-2)

    with_residual = lin(x, residual=residual).float()
    torch.testing.assert_close(with_residual, lin(x).float() + residual.float(), rtol=1e-2, atol=1e-2)
    # Each fused row is still independent of the others.
    assert torch.equal(lin(gate_up[:, 2:3], swiglu=True), lin(gate_up, swiglu=True)[:, 2:3])
    assert torch.equal(lin(x[:, :1], norm=norm_w, eps=1e-5), lin(x, norm=norm_w, eps=1e-5)[:, :1])


def _sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    # float32 causal attention of q [1, T, H, D] over k, v [KV, S, D] for positions start.., [1, T, H * D].
    _, t, h, d = q.shape
    group = h // k.shape[0]
    keys = start + t
    kk = k[:, :keys].float().repeat_interleave(group, 0)
    vv = v[:, :keys].float().repeat_interleave(group, 0)
    allowed = torch.arange(keys)[None, :] <= (start + torch.arange(t))[:, None]
    y = F.scaled_dot_product_attention(q[0].transpose(0, 1).float(), kk, vv, attn_mask=allowed)
    return y.transpose(0, 1).reshape(1, t, h * d)


def _attend(kern, q, k, v, start):
    # q [1, T, H, D] at positions start.. over caches k, v [KV, S, D] whose keys start.. are q's rows' own.
    t = q.shape[1]
    new_k, new_v = (c[:, start : start + t].transpose(0, 1)[None].contiguous() for c in (k, v))
    return kern.attention(q, new_k, new_v, [(0, t, k, v, start)])


@pytest.mark.parametrize(
    ("t", "start", "heads", "kv", "d"), [(1, 0, 9, 3, 64), (8, 40, 9, 3, 64), (17, 100, 4, 4, 96), (3, 15, 8, 1, 128)]
)
def test_attention_matches_float32_sdpa(kern, t: int, start: int, heads: int, kv: int, d: int) -> None:
    if not kernels.attention_fits(kern, d, torch.bfloat16, torch.device("cpu")):
        assert d % kern.spec.head_multiple, "every other head size this test takes must run"
        return  # a model of this head size keeps SDPA on this kernel (amx: see attention_fits)
    g = torch.Generator().manual_seed(t + start)
    capacity = start + t + 20
    k = torch.randn(kv, capacity, d, generator=g).bfloat16()
    v = torch.randn(kv, capacity, d, generator=g).bfloat16()
    q = torch.randn(1, t, heads, d, generator=g).bfloat16()
    got = _attend(kern, q, k.clone(), v.clone(), start)
    torch.testing.assert_close(got.float(), _sdpa_reference(q, k, v, start), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("kv", "heads", "start"), [(3, 9, 50), (4, 4, 50), (4, 4, 63)])
def test_attention_rows_depend_only_on_themselves(kern, kv: int, heads: int, start: int) -> None:
    # The property that lets decoding drop padding and a fixed key span: a row's bits are the same whatever
    # rows share the call (a prefill's rows go in runs that share their keys' loads; from 63 the first run's
    # shortest row ends on a whole block of 16 keys), however large the cache, whatever lies in its unwritten slots.
    g = torch.Generator().manual_seed(7)
    d, t = 64, 13
    k = torch.randn(kv, 200, d, generator=g).bfloat16()
    v = torch.randn(kv, 200, d, generator=g).bfloat16()
    q = torch.randn(1, t, heads, d, generator=g).bfloat16()
    whole = _attend(kern, q, k, v, start)
    for i in (0, 5, 11, 12):
        alone = _attend(kern, q[:, i : i + 1], k, v, start + i)
        assert torch.equal(alone, whole[:, i : i + 1]), i
    bigger_k = torch.cat([k, torch.randn(kv, 300, d, generator=g).bfloat16()], dim=1)
    bigger_v = torch.cat([v, torch.randn(kv, 300, d, generator=g).bfloat16()], dim=1)
    assert torch.equal(_attend(kern, q, bigger_k, bigger_v, start), whole)
    k[:, start + t :] = 7.0  # garbage past the last written key is never read
    v[:, start + t :] = float("nan")
    assert torch.equal(_attend(kern, q, k, v, start), whole)


@pytest.mark.parametrize(("kv", "heads", "d"), [(3, 9, 64), (1, 4, 256)])
def test_long_context_rows_get_the_same_bits_on_one_thread_and_two(kern, kv: int, heads: int, d: int) -> None:
    # At a long context a decoding row's few items (3 kv heads for 2 threads, or 1) are shared among the threads:
    # the scores and exponentials by ranges of keys, the weighted sums by ranges of dimensions; a small tree's rows
    # likewise. Their bits stay those of one thread, and a chain row's those it gets among many rows.
    if not kernels.attention_fits(kern, d, torch.bfloat16, torch.device("cpu")):
        assert d % kern.spec.head_multiple, "every other head size this test takes must run"
        return
    g = torch.Generator().manual_seed(12)
    start, t = 900, 5
    k = torch.randn(kv, start + t + 20, d, generator=g).bfloat16()
    v = torch.randn(kv, start + t + 20, d, generator=g).bfloat16()
    q = torch.randn(1, t, heads, d, generator=g).bfloat16()
    whole = _attend(kern, q, k, v, start)
    for i in (0, 4):  # 3 threads: ranges that divide neither the keys nor the items evenly
        row = whole[:, i : i + 1]
        assert_same_on_thread_counts(lambda i=i: _attend(kern, q[:, i : i + 1], k, v, start + i), row, (1, 2, 3))
    if kern.trees:
        parents = torch.tensor([-1, 0, 0], dtype=torch.int32)  # the root, its child, and that child's sibling
        new_k, new_v = (c[:, start : start + 3].transpose(0, 1)[None].contiguous() for c in (k, v))

        def tree() -> torch.Tensor:
            return kern.attention(q[:, :3], new_k, new_v, [(0, 3, k, v, start, parents)])

        rows = tree()
        assert torch.equal(rows[:, :2], whole[:, :2])  # the root and its child: the chain's first two rows
        assert_same_on_thread_counts(tree, rows)


def test_attention_of_several_sequences_in_one_call(kern) -> None:
    # A batch's call writes each sequence's new keys into its own cache and gives each the bits it gets alone.
    g = torch.Generator().manual_seed(8)
    kv, heads, d = 3, 9, 64
    shapes = [(1, 30), (5, 12), (17, 0), (3, 99)]  # (rows, start)
    caches = [
        (torch.randn(kv, 130, d, generator=g).bfloat16(), torch.randn(kv, 130, d, generator=g).bfloat16())
        for _ in shapes
    ]
    n = sum(t for t, _ in shapes)
    qkv = torch.randn(1, n, heads + 2 * kv, d, generator=g).bfloat16()  # as the decoder lays rows out
    q, k, v = qkv[:, :, :heads], qkv[:, :, heads : heads + kv], qkv[:, :, heads + kv :]
    alone, parts, offset = [], [], 0
    for (t, start), (kc, vc) in zip(shapes, caches, strict=True):
        rows = slice(offset, offset + t)
        kc1, vc1 = kc.clone(), vc.clone()
        alone.append(kern.attention(q[:, rows], k[:, rows], v[:, rows], [(0, t, kc1, vc1, start)]))
        assert torch.equal(kc1[:, start : start + t], k[0, rows].transpose(0, 1))  # written into the cache
        parts.append((offset, t, kc, vc, start))
        offset += t
    together = kern.attention(q, k, v, parts)
    assert torch.equal(together, torch.cat(alone, dim=1))


def _everything(kern: kernels.Kernel) -> list[torch.Tensor]:
    """One of each kernel call on fixed inputs: products (with bias, norm, SwiGLU, residual) and attention."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(1000, 576, generator=g).bfloat16()
    b = torch.randn(1000, generator=g).bfloat16()
    x = torch.randn(21, 576, generator=g).bfloat16()
    norm_w = (1 + torch.randn(576, generator=g) / 4).bfloat16()
    w2 = (torch.randn(576, 1536, generator=g) / 16).bfloat16()
    gate_up = torch.randn(9, 3072, generator=g).bfloat16()
    residual = torch.randn(9, 576, generator=g).bfloat16()
    q = torch.randn(1, 6, 9, 64, generator=g).bfloat16()
    kc = torch.randn(3, 300, 64, generator=g).bfloat16()
    vc = torch.randn(3, 300, 64, generator=g).bfloat16()
    # Eight heads on one kv head (the heads' values side by side in groups: 3 + 3 + 2 on avx2, 4 + 4 on avx512),
    # 128 dimensions, spans that end between whole blocks of keys.
    q8 = torch.randn(1, 5, 8, 128, generator=g).bfloat16()
    kc8 = torch.randn(1, 90, 128, generator=g).bfloat16()
    vc8 = torch.randn(1, 90, 128, generator=g).bfloat16()
    # Long contexts whose rows' few items the threads share (sk_attention_shared).
    kc_long = torch.randn(3, 900, 64, generator=g).bfloat16()
    vc_long = torch.randn(3, 900, 64, generator=g).bfloat16()
    kc8_long = torch.randn(1, 600, 128, generator=g).bfloat16()
    vc8_long = torch.randn(1, 600, 128, generator=g).bfloat16()
    return [
        kern.linear(w, b)(x),
        # One, two and three rows: the shapes a decoding step takes (generic's tiles of blocks, not of rows).
        *(kern.linear(w, b)(x[:m]) for m in (1, 2, 3)),
        kern.linear(w, None)(x, norm=norm_w, eps=1e-5),
        kern.linear(w2, None)(gate_up, swiglu=True, residual=residual),
        kern.linear(w2, None)(gate_up, geglu=True),
        kern.rms_norm(x, norm_w, 1e-6),
        kern.rms_norm(residual, norm_w, 1e-6, residual=x[:9]),
        _attend(kern, q, kc, vc, 250),
        _attend(kern, q[:, :1], kc, vc, 3),
        _attend(kern, q8, kc8, vc8, 41),
        _attend(kern, q[:, :1], kc_long, vc_long, 850),
        _attend(kern, q8[:, :1], kc8_long, vc8_long, 555),
    ]


@pytest.mark.parametrize("name", HERE)
def test_the_norms_and_geglu_outside_the_products_are_within_bf16_of_float64(name: str) -> None:
    """Kernel.rms_norm (the q/k and post norms of a block) and GeGLU (gelu's tanh form, op 3) against float64:
    within the bf16 rounding of their results."""
    kern = kernels.load(name)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 256, generator=g) * 3).bfloat16()
    w = (1 + torch.randn(256, generator=g) / 4).bfloat16()
    res = torch.randn(7, 256, generator=g).bfloat16()
    xd, wd = x.double(), w.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * wd
    torch.testing.assert_close(kern.rms_norm(x, w, 1e-6).double(), normed, rtol=8e-3, atol=1e-6)
    both = kern.rms_norm(x, w, 1e-6, residual=res).double()
    torch.testing.assert_close(both, normed.bfloat16().double() + res.double(), rtol=8e-3, atol=1e-2)
    eye = torch.eye(64).bfloat16()  # the product passes the activation through: y = gelu(gate) * up
    gate_up = (torch.randn(5, 128, generator=g) * 2).bfloat16()
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(kern.linear(eye, None)(gate_up, geglu=True).double(), want, rtol=8e-3, atol=1e-5)


def assert_layer_stack_gives_layer_by_layer_bits(model: Transformer) -> None:
    """`model` (packed on a kernel) runs its layers in one call (`kernels.LayerStack`) and gets the hidden states
    and cache contents of the layer-by-layer calls, bit for bit: a prompt of several rows, then a step."""
    assert model._stack is not None
    stack = model._stack
    ids = torch.tensor([[1, 504, 3, 2288, 9, 6056, 16, 1017, 30]])
    runs = []
    for fused in (stack, None):
        model._stack = fused
        cache = model.new_cache(32)
        try:
            runs.append([model.hidden(ids, 0, cache), model.hidden(ids[:, :1], 9, cache), cache.k, cache.v])
        finally:
            model._stack = stack
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_the_layer_stack_gives_the_layer_by_layer_bits(packed_target) -> None:
    for name in HERE:
        assert_layer_stack_gives_layer_by_layer_bits(packed_target(name).model)


def test_the_final_norm_is_the_kernels(packed_target) -> None:
    """On a kernel, the hidden states' final RMSNorm is the kernel's own (the bits of every CPU), not torch's, whose
    sum of squares runs in an order its build's vector width sets (its plain and AVX2 builds differ)."""
    for name in ("generic", HERE[-1]):
        model = packed_target(name).model
        ids = torch.tensor([[1, 504, 3, 2288, 9, 6056, 16, 1017, 30]])
        cos, sin = model._rope(0, ids.shape[1])
        cache = model.new_cache(32)
        layers = model._stack(model._embed(ids), cos, sin, cache.k, cache.v, 0)
        want = model.kernel.rms_norm(layers, model.norm.weight, model.norm.eps)
        assert torch.equal(model.hidden(ids, 0, model.new_cache(32)), want)
        # Many rows: where torch's order would round a value the other way (a few in a million values).
        rows = (torch.randn(4096, want.shape[-1], generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
        assert torch.equal(model._final_norm(rows), model.kernel.rms_norm(rows, model.norm.weight, model.norm.eps))


@pytest.mark.parametrize("name", PORTABLE)
def test_portable_kernels_give_the_generic_kernels_bits(name: str) -> None:
    """avx512 and avx2 compute common.h's arithmetic in wider registers: the same bits as plain C."""
    for got, want in zip(_everything(kernels.load(name)), _everything(kernels.load("generic")), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", INEXACT)
def test_inexact_kernels_stay_within_a_stated_bound_of_the_generic_kernel(name: str) -> None:
    """AMX tiles add in their own order: within bf16 rounding of the generic kernel, not the same bits."""
    if name not in HERE:
        assert not kernels.runs_here(name)
        return  # nothing of this kernel's to compare on this CPU (its source still compiles: see below)
    for got, want in zip(_everything(kernels.load(name)), _everything(kernels.load("generic")), strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=0.02 * want.abs().max().item())


def test_the_table_names_every_kernel_once() -> None:
    """One record per kernel (app/engine/kernels/table.py), each naming a C source beside it; the stand-ins are
    loadable but never a choice."""
    assert list(kernels.SPECS) == [*kernels.KERNELS, *kernels.STAND_INS]
    assert all(name == spec.name for name, spec in kernels.SPECS.items())
    assert kernels.KERNELS[-1] == "generic" and not kernels.SPECS["generic"].needs
    assert not set(kernels.STAND_INS) & set(kernels.CHOICES)
    for spec in kernels.SPECS.values():
        assert (build.HERE / f"{spec.source}.c").is_file(), spec.name
        assert spec.block in (16, 32) and spec.head_multiple % 32 == 0, spec.name
    # Every header is part of the build key: a library built before a header changed is never reused.
    assert sorted(build.HEADERS) == sorted(p.name for p in build.HERE.glob("*.h"))


@pytest.mark.parametrize("name", list(kernels.SPECS))
def test_every_kernel_source_compiles(name: str, tmp_path: Path) -> None:
    """Kernels this CPU cannot run are still compiled, so that a change that breaks one shows here too. At -Og, not
    the build's -O3: the same errors (types, intrinsics a kernel's flags do not allow, which gcc finds when it
    inlines them) and the flow-based warnings, in a fraction of the time; the kernels this CPU runs are also built
    at -O3 by the tests that load them."""
    gcc = shutil.which("gcc")
    assert gcc is not None, "the kernels need gcc (the Makefile and the Docker image install it)"
    spec = kernels.SPECS[name]
    common = ["-Og" if flag == "-O3" else flag for flag in build.COMMON]
    assert common != list(build.COMMON), "the build's optimisation level moved: compile at -Og here still"
    cmd = [gcc, *common, *spec.flags, f"-I{build.HERE}", str(build.HERE / f"{spec.source}.c")]
    done = subprocess.run([*cmd, "-o", str(tmp_path / "k.so"), "-Wall", "-Werror"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_roofline_tools_build_and_rate_a_kernels_products(tmp_path: Path) -> None:
    """tools/roofline.c, pipe_mix.c and tile_rate.c (what tools/measure_tiles.py runs) compile clean, every family
    included whatever this CPU has; tile_rate times each format's products through a kernel's library and refuses
    a size the formats cannot take."""
    gcc = shutil.which("gcc")
    assert gcc is not None
    tools = Path(__file__).parents[1] / "tools"
    for name, extra in (("roofline", ["-fopenmp"]), ("pipe_mix", []), ("tile_rate", ["-ldl"])):
        cmd = [gcc, "-O2", "-Wall", "-Wextra", "-Werror", str(tools / f"{name}.c"), "-o", str(tmp_path / name), *extra]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    lib = str(kernels.load(HERE[0]).path)
    done = subprocess.run([tmp_path / "tile_rate", lib, "8", "256"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    assert [(r[0], int(r[1])) for r in rows] == [(f, m) for f in FORMATS for m in (1, 2, 4, 8, 16, 64)]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
    bad = subprocess.run([tmp_path / "tile_rate", lib, "8", "100"], capture_output=True, text=True)
    assert bad.returncode == 2 and "K: of 32" in bad.stderr


def test_the_setting_selects_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    with use_kernel("auto"):
        assert kernels.name() == HERE[0]
    for name in HERE:
        with use_kernel(name):
            assert kernels.name() == name
            assert PackedLinear(torch.randn(128, 64).bfloat16(), None, kernels.kernel()).fused.kernel.name == name
    with use_kernel("torch"):
        assert kernels.kernel() is None and kernels.name() == "torch"
        w = torch.randn(128, 64).bfloat16()
        off = PackedLinear(w, None, kernels.kernel())
        assert off.fused is None
        x = torch.randn(3, 64).bfloat16()
        torch.testing.assert_close(off(x).float(), F.linear(x.float(), w.float()), rtol=1e-2, atol=0.1)
    wrong = "SPECSERVE_KERNEL='sse9': choose one of auto, amxint8, amx"
    with use_kernel("sse9"), pytest.raises(ValueError, match=wrong):
        kernels.kernel()


def test_a_kernel_this_cpu_cannot_run_is_refused_when_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(detect, "cpu", lambda: ("an old CPU", frozenset({"sse2"})))
    kernels.load.cache_clear()
    try:
        assert kernels.available() == ["generic"]
        with use_kernel("avx2"), pytest.raises(kernels.KernelUnavailable, match=r"avx2 kernel needs avx2 f16c fma"):
            kernels.kernel()
        with use_kernel("auto"):
            assert kernels.name() == "generic"
    finally:
        kernels.load.cache_clear()


def test_kernels_are_built_where_the_caller_says(tmp_path: Path) -> None:
    """The engine is given its cache directory (build_engine: the store's): the call that selects the kernel
    builds it there; later calls get the same kernel; none given, a private temporary directory."""
    with use_kernel("generic"):
        chosen = kernels.kernel(tmp_path / "a")
        assert chosen is not None and chosen.path.parent == tmp_path / "a" and chosen.path.exists()
        assert kernels.kernel(tmp_path / "b") is chosen and kernels.kernel() is chosen
    with use_kernel("generic"):
        private = kernels.kernel()
        assert private is not None and private.path.parent == build.private_dir() != tmp_path / "a"
    assert not (tmp_path / "b").exists()


def test_the_engine_does_not_know_the_model_store() -> None:
    """Only app.engine.factory (build_engine) reads the store; no other engine module imports it or reads
    SPECSERVE_CACHE, so the engine runs wherever its caller keeps things."""
    engine = Path(kernels.__file__).parent.parent
    modules = sorted(
        "app." + ".".join(p.relative_to(engine.parent).with_suffix("").parts).removesuffix(".__init__")
        for p in engine.rglob("*.py")
        if p.name != "factory.py"
    )
    assert "app.engine.generation" in modules and "app.engine.kernels" in modules
    code = f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
    code += "print('app.store' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False"]
    for path in engine.rglob("*.py"):
        if path.name != "factory.py":
            assert "SPECSERVE_CACHE" not in path.read_text(), path


def test_build_engine_gives_the_engine_the_stores_cache_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, target_path: Path
) -> None:
    """Callers of build_engine do not change: it resolves the cache directory from the store unless given one."""
    from app import store
    from app.engine import factory

    seen: list[Path | None] = []

    class Stop(Exception):
        pass

    def load_model(path, dtype, device, max_seq_len, cache_dir, weights="auto"):
        seen.append(cache_dir)
        raise Stop  # what was passed is the point

    monkeypatch.setattr(factory, "load_model", load_model)
    monkeypatch.setattr(store, "cache_dir", lambda: tmp_path / "store")
    for given in (None, tmp_path / "mine"):
        with pytest.raises(Stop):
            factory.build_engine(str(target_path), "none", cache_dir=given)
    assert seen == [tmp_path / "store", tmp_path / "mine"]


def test_another_process_finds_the_cached_library(tmp_path: Path) -> None:
    """A library built into a cache directory is the one a later process loads (the server's next start, the other
    test worker), whatever that process's string hashing: its name is a digest of what built it, nothing else."""
    kernels.load.cache_clear()
    try:
        built = kernels.load("generic", tmp_path).path
    finally:
        kernels.load.cache_clear()
    code = "import sys, pathlib; from app.engine import kernels\n"
    code += "print(kernels.load('generic', pathlib.Path(sys.argv[1])).path)"
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == str(built), seed
    assert len(list(tmp_path.glob("generic_*.so"))) == 1


def test_a_damaged_cached_library_is_rebuilt(tmp_path: Path) -> None:
    kernels.load.cache_clear()
    try:
        first = kernels.load("generic", tmp_path)
        stamp = Path(f"{first.path}.sha256")
        assert first.path.parent == tmp_path and stamp.read_text() == build.digest(first.path)
        # A library cut short (a crash mid-copy, a full disk) must never be loaded: dlopen of it could crash.
        # (Written beside it and moved over it: the loaded library's own pages stay mapped and whole.)
        cut = tmp_path / "cut"
        cut.write_bytes(first.path.read_bytes()[:1000])
        os.replace(cut, first.path)
        kernels.load.cache_clear()
        again = kernels.load("generic", tmp_path)
        assert again.path == first.path and stamp.read_text() == build.digest(again.path)
        assert os.path.getsize(again.path) > 1000
    finally:
        kernels.load.cache_clear()


def _swap_in(path: Path, data: bytes, mode: int) -> None:
    """Replace the file at `path` by one holding `data` with `mode` (moved over it: a loaded library's pages stay
    whole)."""
    other = path.with_name("swapped")
    other.write_bytes(data)
    os.chmod(other, mode)
    os.replace(other, path)


def test_a_cache_others_may_write_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A digest beside a library vouches for nothing against whoever wrote both: a library and a matching digest
    put in a cache directory its group may write, or one of another user's, are never loaded (the kernel is built
    into the process's private directory instead), nor one the group may write in a private directory (rebuilt)."""
    kernels.load.cache_clear()
    try:
        first = kernels.load("generic", tmp_path)
        assert first.path.parent == tmp_path and (tmp_path.stat().st_mode & 0o022) == 0
        assert (first.path.stat().st_mode & 0o022) == 0 and (Path(f"{first.path}.sha256").stat().st_mode & 0o022) == 0
        planted = b"not a library: dlopen of it would fail"

        def plant(mode: int) -> None:
            _swap_in(first.path, planted, mode)
            _swap_in(Path(f"{first.path}.sha256"), build.digest(first.path).encode(), 0o644)

        # A group-writable cache directory (a shared volume).
        plant(0o755)
        os.chmod(tmp_path, 0o775)
        kernels.load.cache_clear()
        shared = kernels.load("generic", tmp_path)
        assert shared.path.parent == build.private_dir() and first.path.read_bytes() == planted
        # Another user's directory and files (as this process sees them).
        os.chmod(tmp_path, 0o755)
        with monkeypatch.context() as m:
            m.setattr(os, "getuid", lambda: first.path.stat().st_uid + 1)
            kernels.load.cache_clear()
            foreign = kernels.load("generic", tmp_path)
        assert foreign.path.parent == build.private_dir() and first.path.read_bytes() == planted
        # This user's directory, the library writable by others: rebuilt in place, no longer writable by them.
        plant(0o777)
        kernels.load.cache_clear()
        rebuilt = kernels.load("generic", tmp_path)
        assert rebuilt.path == first.path and first.path.read_bytes() != planted
        assert (first.path.stat().st_mode & 0o022) == 0
    finally:
        kernels.load.cache_clear()


def test_bench_times_a_target_step_on_every_kernel(target_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`specserve bench --kernels`: one real target step per kernel and row count, and what bounds it (timed on
    the best kernel, generic and torch: each kernel's timing is the same code over another library; the kernel
    list it walks by default is checked apart)."""
    from app.bench import rows

    on = [*KERNEL_ENDS, "torch"]
    bandwidth, weight_bytes, table = rows.kernel_steps(target_path, rows=(1, 3), context=8, repeats=1, on=on)
    assert list(table) == on
    walked = []
    monkeypatch.setattr(rows, "_load_on", lambda name, *_: walked.append(name) or None)
    monkeypatch.setattr(rows, "step_bytes", lambda model: 0)
    monkeypatch.setattr(rows, "step_times", lambda model, *_: {})
    monkeypatch.setattr(rows, "read_bandwidth", lambda: 1.0)
    rows.kernel_steps(target_path)
    assert walked == [*HERE, "torch"]
    assert all(set(times) == {1, 3} and min(times.values()) > 0 for times in table.values())
    # The default target's weights in bf16: 134.5 M parameters (the tied embedding counted once).
    assert 250e6 < weight_bytes < 290e6 and bandwidth > 1e9


def test_the_ctypes_signatures_are_the_headers_prototypes() -> None:
    """kernels.SIGNATURES, what ctypes passes, is what the C headers declare: each exported sk_ function's return
    and argument types, in order (a pointer of any type is a void pointer, char * returned a C string)."""
    import ctypes
    import re
    from pathlib import Path

    scalar = {"void": None, "int": ctypes.c_int, "long": ctypes.c_long, "float": ctypes.c_float}
    scalar["int64_t"] = ctypes.c_int64

    def ctype(decl: str, returned: bool = False) -> type | None:
        decl = decl.replace("const ", "").strip()
        if "*" in decl:
            return ctypes.c_char_p if returned and decl.startswith("char") else ctypes.c_void_p
        return scalar[decl.split()[0]]

    here = Path(kernels.__file__).parent
    found = {}
    for header in ("common.h", "quant.h", "layers.h", "dot4.h"):
        text = (here / header).read_text()
        prototypes = r"^((?:const )?(?:void|int|long|float|char|int64_t) ?\**)\s*(sk_\w+)\(([^)]*)\)\s*[;{]"
        for m in re.finditer(prototypes, text, re.M):
            ret, name, args = m.groups()
            params = (
                []
                if args.strip() in ("", "void")
                else [a.rsplit(" ", 1)[0] + "*" * a.count("*") for a in (" ".join(p.split()) for p in args.split(","))]
            )
            found[name] = (ctype(ret, returned=True), [ctype(p) for p in params])
    assert found == kernels.SIGNATURES

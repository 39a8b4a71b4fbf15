"""The AMX bf16 product: right values, rows independent of the row count, same bits as oneDNN where the
decoder relies on it, and a clean fallback when turned off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from app.engine import amx
from app.engine.model import PackedLinear


@pytest.fixture(scope="module")
def lib():
    lib = amx.kernel()
    if lib is None:
        # A CPU with AMX and a compiler must get the kernel: failing to build it here is a bug, not a skip.
        assert not amx._cpu_has_amx(), "this CPU has AMX but the kernel did not load (see the log for why)"
        pytest.skip("this CPU has no AMX tiles; PackedLinear runs on oneDNN (tested elsewhere)")
    return lib


@pytest.mark.parametrize(("n", "k", "bias"), [(3072, 576, False), (960, 576, True), (100, 64, True)])
def test_values_match_float32_product(lib, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    x = torch.randn(2, 5, k, generator=g).bfloat16()
    y = amx.AmxLinear(lib, w, b)(x)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.shape == (2, 5, n) and y.dtype == torch.bfloat16
    # bf16 output rounding: relative 2^-8 of the magnitude, plus the f32 accumulation's own error.
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=0.06 * ref.abs().max().item() / 8)


def test_a_row_does_not_depend_on_the_row_count(lib) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1536, 576, generator=g).bfloat16()
    lin = amx.AmxLinear(lib, w, None)
    x = torch.randn(40, 576, generator=g).bfloat16()
    whole = lin(x)
    for rows in (1, 2, 7, 16, 17, 33):
        assert torch.equal(lin(x[:rows]), whole[:rows]), rows
    assert torch.equal(lin(x[23:24]), whole[23:24])


def test_same_bits_as_onednn_up_to_32_rows(lib) -> None:
    # The decoder's fallback is oneDNN: the same tokens whichever runs (oneDNN's own kernels change at 40 rows).
    g = torch.Generator().manual_seed(2)
    w = torch.randn(576, 1536, generator=g).bfloat16()
    x = torch.randn(32, 1536, generator=g).bfloat16()
    onednn = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
    assert torch.equal(amx.AmxLinear(lib, w, None)(x), onednn)


def test_packed_linear_uses_it_and_can_be_turned_off(lib, monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(128, 64).bfloat16()
    assert PackedLinear(w, None).fused is not None
    monkeypatch.setenv("SPECSERVE_AMX", "0")
    amx.kernel.cache_clear()
    try:
        off = PackedLinear(w, None)
        assert off.fused is None and off.packed is not None
        x = torch.randn(3, 64).bfloat16()
        torch.testing.assert_close(off(x).float(), F.linear(x.float(), w.float()), rtol=1e-2, atol=0.1)
    finally:
        monkeypatch.delenv("SPECSERVE_AMX")
        amx.kernel.cache_clear()
    assert amx.kernel() is not None


def test_fused_norm_swiglu_and_residual_match_torch(lib) -> None:
    # What DecoderBlock runs inside the product calls on AMX, against the torch ops it replaces.
    g = torch.Generator().manual_seed(3)
    k, n = 64, 128
    w = (torch.randn(n, k, generator=g) / 8).bfloat16()
    lin = amx.AmxLinear(lib, w, None)
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


def _attend(lib, q, k, v, start):
    # q [1, T, H, D] at positions start.. over caches k, v [KV, S, D] whose keys start.. are q's rows' own.
    t = q.shape[1]
    new_k, new_v = (c[:, start : start + t].transpose(0, 1)[None].contiguous() for c in (k, v))
    return amx.attention(lib, q, new_k, new_v, [(0, t, k, v, start)])


@pytest.mark.parametrize(("t", "start", "heads", "kv"), [(1, 0, 9, 3), (8, 40, 9, 3), (17, 100, 4, 4), (3, 15, 8, 1)])
def test_attention_matches_float32_sdpa(lib, t: int, start: int, heads: int, kv: int) -> None:
    g = torch.Generator().manual_seed(t + start)
    d, capacity = 64, start + t + 20
    k = torch.randn(kv, capacity, d, generator=g).bfloat16()
    v = torch.randn(kv, capacity, d, generator=g).bfloat16()
    q = torch.randn(1, t, heads, d, generator=g).bfloat16()
    got = _attend(lib, q, k.clone(), v.clone(), start)
    torch.testing.assert_close(got.float(), _sdpa_reference(q, k, v, start), rtol=2e-2, atol=2e-2)


def test_attention_rows_depend_only_on_themselves(lib) -> None:
    # The property that lets decoding drop padding and a fixed key span: a row's bits are the same whatever
    # rows share the call, however large the cache, whatever lies in its unwritten slots.
    g = torch.Generator().manual_seed(7)
    kv, heads, d, start, t = 3, 9, 64, 50, 12
    k = torch.randn(kv, 200, d, generator=g).bfloat16()
    v = torch.randn(kv, 200, d, generator=g).bfloat16()
    q = torch.randn(1, t, heads, d, generator=g).bfloat16()
    whole = _attend(lib, q, k, v, start)
    for i in (0, 5, 11):
        alone = _attend(lib, q[:, i : i + 1], k, v, start + i)
        assert torch.equal(alone, whole[:, i : i + 1]), i
    bigger_k = torch.cat([k, torch.randn(kv, 300, d, generator=g).bfloat16()], dim=1)
    bigger_v = torch.cat([v, torch.randn(kv, 300, d, generator=g).bfloat16()], dim=1)
    assert torch.equal(_attend(lib, q, bigger_k, bigger_v, start), whole)
    k[:, start + t :] = 7.0  # garbage past the last written key is never read
    v[:, start + t :] = float("nan")
    assert torch.equal(_attend(lib, q, k, v, start), whole)


def test_attention_of_several_sequences_in_one_call(lib) -> None:
    # A batch's call writes each sequence's new keys into its own cache and gives each the bits it gets alone.
    g = torch.Generator().manual_seed(8)
    kv, heads, d = 3, 9, 64
    shapes = [(1, 30), (5, 12), (17, 0), (3, 99)]  # (rows, start)
    caches = [(torch.randn(kv, 130, d, generator=g).bfloat16(), torch.randn(kv, 130, d, generator=g).bfloat16())]
    caches += [
        (torch.randn(kv, 130, d, generator=g).bfloat16(), torch.randn(kv, 130, d, generator=g).bfloat16())
        for _ in shapes[1:]
    ]
    n = sum(t for t, _ in shapes)
    qkv = torch.randn(1, n, heads + 2 * kv, d, generator=g).bfloat16()  # as the decoder lays rows out
    q, k, v = qkv[:, :, :heads], qkv[:, :, heads : heads + kv], qkv[:, :, heads + kv :]
    alone, parts, offset = [], [], 0
    for (t, start), (kc, vc) in zip(shapes, caches, strict=True):
        rows = slice(offset, offset + t)
        kc1, vc1 = kc.clone(), vc.clone()
        alone.append(amx.attention(lib, q[:, rows], k[:, rows], v[:, rows], [(0, t, kc1, vc1, start)]))
        assert torch.equal(kc1[:, start : start + t], k[0, rows].transpose(0, 1))  # written into the cache
        parts.append((offset, t, kc, vc, start))
        offset += t
    together = amx.attention(lib, q, k, v, parts)
    assert torch.equal(together, torch.cat(alone, dim=1))


def test_auto_dtype_is_bfloat16_wherever_the_kernel_runs_without_a_timing_probe(monkeypatch):
    from app.engine import loading

    def no_timing() -> float:
        raise AssertionError("timed a probe although AMX decides")

    monkeypatch.setattr(amx, "kernel", lambda: object())
    monkeypatch.setattr(loading.time, "perf_counter", no_timing)
    assert loading._bf16_is_faster_on_cpu.__wrapped__() is True

"""`specserve bench --rows` (what a verification's rows cost per kernel and weight format) and `--synthetic`
(a bigger model's shape with random weights): run end to end at a few row counts, on a tiny synthetic shape.

Timings on a shared machine say nothing here: the tests check the figures' structure and what follows from
the bytes (positive times, the extra-row fractions as defined, native weights read fewer bytes than bf16),
never a speed.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from app.bench import rows, synthetic
from app.cli import main
from app.engine.model.loading import load_model
from tests.conftest import KERNEL_ENDS

# Tiny shapes: every matrix whole blocks of its format (K-quants: 256 inputs), the real tokenizer's vocabulary.
TINY_Q8 = synthetic.Shape("tiny", n_layers=2, dim=64, intermediate=128, n_heads=2, n_kv_heads=1, head_dim=32)
TINY_K = synthetic.Shape("tiny-k", n_layers=3, dim=256, intermediate=512, n_heads=4, n_kv_heads=2, head_dim=64)


def test_rows_times_every_kernel_and_weight_format(target_path: Path, tmp_path: Path, monkeypatch) -> None:
    """`specserve bench --rows`, two row counts for speed: a table per kernel and weight format, rows.json and
    rows.md written, each row's extra cost as defined, and native weights' read floor under bf16's."""
    # The best kernel and generic: each kernel's timing is the same code over another library.
    cheap = functools.partial(rows.row_costs, rows=(2, 1), context=8, repeats=1, warmup=0, on=KERNEL_ENDS)
    monkeypatch.setattr(rows, "row_costs", lambda target, weights, **draft: cheap(target, weights=weights, **draft))
    assert main(["bench", "--rows", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "rows.json").read_text())
    tables = result["tables"]
    assert [(t["kernel"], t["weights"]) for t in tables] == [(k, w) for k in KERNEL_ENDS for w in rows.ROW_WEIGHTS]
    assert result["read_bandwidth"] > 1e8 and result["context"] == 8 and result["threads"] >= 1
    for t in tables:
        one, two = t["rows"]
        assert (one["rows"], two["rows"]) == (1, 2) and one["ms"] > 0 and two["ms"] > 0
        assert one["extra_per_row"] is None
        assert two["extra_per_row"] == pytest.approx((two["ms"] - one["ms"]) / one["ms"])
        assert t["floor_ms"] == pytest.approx(t["step_bytes"] / result["read_bandwidth"] * 1e3)
        assert one["floor_of_ms"] == pytest.approx(t["floor_ms"] / one["ms"])
        # The catalog's feature draft beside each: its token's cost as a share of the target's 1-row step.
        drafted = t["draft_token"]
        # (generic's plain-C integer products cost a draft token more than its bf16 ones: bf16 there)
        assert drafted["runs_as"] == ("bfloat16" if t["kernel"] == "generic" else "Q8_0") and drafted["ms"] > 0
        assert drafted["of_step"] == pytest.approx(drafted["ms"] / one["ms"])
    for kernel in KERNEL_ENDS:
        native, bf16 = (t for t in tables if t["kernel"] == kernel)
        # The default target: Q4_1 layers and a Q8_0 tied head (about 96 MB) against 134.5 M bf16 parameters.
        assert native["runs_as"] == "Q8_0+Q4_1" and bf16["runs_as"] == "bfloat16"
        assert 80e6 < native["step_bytes"] < 110e6 and 250e6 < bf16["step_bytes"] < 290e6
        assert 0 < native["floor_ms"] < bf16["floor_ms"]
    markdown = (tmp_path / "rows.md").read_text()
    assert markdown.count("| rows | 1 | 2 |") == len(tables) and "extra per row" in markdown
    assert markdown.count("A token of the feature draft (") == len(tables)


def test_rows_refuses_float32_weights(tmp_path: Path, capsys) -> None:
    assert main(["bench", "--rows", "--weights", "float32", "--out", str(tmp_path)]) == 1
    assert "--rows times native and bf16" in capsys.readouterr().err


def test_synthetic_plan_follows_llama_cpp() -> None:
    """The 1.7B shape's files as llama.cpp lays them out: Q8_0 throughout, or Q4_K_M's Q4_K with Q6_K for the
    tied embedding and the attn_v and ffn_down of 12 of the 24 layers; sizes as the formats' blocks give."""
    shape = synthetic.SHAPES["1.7b"]
    q8 = synthetic.tensor_plan(shape, "q8_0")
    k = synthetic.tensor_plan(shape, "q4_k_m")
    assert len(q8) == len(k) == 2 + 24 * 9
    assert {t for _, _, t in q8} == {"Q8_0", "F32"} and q8[0] == ("token_embd.weight", (49152, 2048), "Q8_0")
    assert k[0][2] == "Q6_K" and {t for _, _, t in k} == {"Q4_K", "Q6_K", "F32"}
    more = {name.split(".")[1] for name, _, t in k[1:] if t == "Q6_K"}
    assert more == {str(i) for i in (0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23)}

    def size(plan: list) -> int:
        per = {"Q8_0": 34 / 32, "Q4_K": 144 / 256, "Q6_K": 210 / 256, "F32": 4}
        return sum(int(np.prod(dims) * per[t]) for _, dims, t in plan)

    assert 1.7e9 < size(q8) < 1.9e9 and 1.0e9 < size(k) < 1.2e9


@pytest.mark.parametrize(
    ("shape", "fmt", "formats"), [(TINY_Q8, "q8_0", "Q8_0"), (TINY_K, "q4_k_m", "Q6_K+Q4_K")], ids=["q8_0", "q4_k_m"]
)
def test_synthetic_gguf_loads_natively_and_runs(target_path: Path, tmp_path: Path, shape, fmt, formats) -> None:
    """The writer on a tiny shape: our loader reads the shape and the copied tokenizer, keeps every matrix as
    its blocks (`native`), and a forward gives finite logits; the blocks' values spread about SIGMA."""
    path = synthetic.write_gguf(tmp_path / f"tiny.{fmt}.gguf", shape, fmt, target_path)
    assert not path.with_name(path.name + ".partial").exists()
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data[:64], t.tensor_type)  # a few rows of each
        assert np.isfinite(values).all()
        if len(t.shape) == 2:
            assert 0.5 * synthetic.SIGMA < values.std() < 2 * synthetic.SIGMA, t.name
    loaded = load_model(path, "auto", "cpu", weights="native")
    c = loaded.config
    assert (c.n_layers, c.dim, c.intermediate_size, c.n_heads, c.n_kv_heads, c.head_dim) == (
        shape.n_layers,
        shape.dim,
        shape.intermediate,
        shape.n_heads,
        shape.n_kv_heads,
        shape.head_dim,
    )
    assert c.vocab_size == 49152 and c.tie_embeddings and c.rope_theta == 130000.0 and c.max_seq_len == 8192
    assert loaded.weights == formats
    # The default target's tokenizer, copied: SmolLM2's pre-tokenizer, its chat template, a round trip.
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert "<|im_start|>" in loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    ids = loaded.tokenizer.encode("Hello, how are you?")
    assert loaded.tokenizer.decode(ids) == "Hello, how are you?"
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids]))
    assert logits.shape == (1, len(ids), 49152) and torch.isfinite(logits).all()


def test_synthetic_bench_end_to_end(target_path: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """`specserve bench --synthetic` on a tiny shape standing in for 1.7b: the file written once into the cache
    and reused, target-only and n-gram decoding to max-new-tokens (the end-of-sequence token ignored),
    llama.cpp reported as not installed where it is not."""
    monkeypatch.setitem(synthetic.SHAPES, "1.7b", TINY_Q8)
    monkeypatch.setattr(synthetic, "synthetic_path", lambda directory, name, fmt: tmp_path / f"{name}.{fmt}.gguf")
    out = tmp_path / "out"
    argv = ["bench", "--synthetic", "1.7b", "--limit", "2", "-n", "6", "--weights", "native", "--out", str(out)]
    assert main(argv) == 0
    written = tmp_path / "1.7b.q8_0.gguf"
    assert written.exists()
    result = json.loads((out / "results.json").read_text())
    meta = result["meta"]
    assert meta["target"] == str(written) and meta["weights"] == "Q8_0" and meta["prompts"] == 2
    assert meta["synthetic"].startswith("1.7b q8_0")
    has_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    assert meta["llama_cpp"] == ("measured" if has_llama_cpp else "not installed")
    ours = [r for r in result["runs"] if r["config"] in ("none", "ngram/adaptive")]
    assert {r["config"] for r in ours} == {"none", "ngram/adaptive"} and all(r["tokens"] == 6 for r in ours)
    assert all(
        r["token_ids"] == next(o for o in ours if o["question_id"] == r["question_id"])["token_ids"] for r in ours
    )
    if not has_llama_cpp:
        assert "llama.cpp: not installed" in capsys.readouterr().err
    mtime = written.stat().st_mtime_ns
    assert main([*argv[:-1], str(tmp_path / "again")]) == 0
    assert written.stat().st_mtime_ns == mtime  # written once

"""Checkpoint readers (app/engine/model/weights.py) and the loader (app/engine/model/loading.py).

HF-format directories are written by transformers itself from tiny random Llama and Qwen2 models (GQA,
tied and untied embeddings, q/k/v bias, several RoPE settings, sharded safetensors) and read back with
`load_model`; logits must match transformers'. GGUF files are written with the `gguf` package from the
weights of a tiny random transformers model, with llama.cpp's q/k row permutation applied, in every
tensor type the loader reads that can be produced here: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
(quantized by gguf.quants) and Q4_K, Q6_K (random blocks, checked against an independent port of
llama.cpp's dequantizer, since gguf.quants cannot quantize them).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from app.engine.model.loading import load_model
from app.engine.model.tokenizer import TokenizerError
from app.engine.model.weights import WeightsError, read_checkpoint

VOCAB = 64


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights with O(1) activations and logits (HF's 0.02-std init gives near-zero logits)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model.eval()


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def _our_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids]))[0]


IDS = [1, 5, 9, 33, 2, 7, 7, 60, 12, 0, 41, 3, 19, 22, 63, 8]


# --- HF-format directories --------------------------------------------------------------------------------


def _hf_variant(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, rms_norm_eps=1e-6)
    common.update(max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    if kind == "llama-gqa-untied":
        cfg = LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
        return LlamaForCausalLM(cfg)
    if kind == "llama-mha-tied-theta5e5":
        cfg = LlamaConfig(
            **common, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=500000.0
        )
        return LlamaForCausalLM(cfg)
    if kind == "llama-head-dim-32":
        cfg = LlamaConfig(
            **common, num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False
        )
        return LlamaForCausalLM(cfg)
    if kind == "llama3-rope-scaling":
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
        rope["original_max_position_embeddings"] = 16
        cfg = LlamaConfig(**common, num_attention_heads=2, num_key_value_heads=1, rope_parameters=rope)
        return LlamaForCausalLM(cfg)
    if kind == "llama-linear-rope-scaling":
        rope = dict(rope_type="linear", rope_theta=10000.0, factor=4.0)
        cfg = LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope)
        return LlamaForCausalLM(cfg)
    if kind == "llama-dynamic-rope-scaling":  # plain RoPE up to max_position_embeddings, our context limit
        rope = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
        cfg = LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope)
        return LlamaForCausalLM(cfg)
    if kind == "qwen2-bias-tied":
        cfg = Qwen2Config(
            **common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6
        )
        return Qwen2ForCausalLM(cfg)
    if kind == "qwen2-bias-untied":
        cfg = Qwen2Config(
            **common, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e4
        )
        return Qwen2ForCausalLM(cfg)
    raise AssertionError(kind)


HF_VARIANTS = [
    "llama-gqa-untied",
    "llama-mha-tied-theta5e5",
    "llama-head-dim-32",
    "llama3-rope-scaling",
    "llama-linear-rope-scaling",
    "llama-dynamic-rope-scaling",
    "qwen2-bias-tied",
    "qwen2-bias-untied",
]


def _save_hf(model, path: Path, word_tokenizer, **save_kwargs) -> Path:
    model.save_pretrained(str(path), safe_serialization=True, **save_kwargs)
    word_tokenizer(VOCAB, (2,)).backend.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("kind", HF_VARIANTS)
def test_hf_directory_logits_match_transformers(tmp_path, word_tokenizer, kind):
    hf = _randomize(_hf_variant(kind), seed=HF_VARIANTS.index(kind))
    loaded = load_model(_save_hf(hf, tmp_path, word_tokenizer), "float32")
    cfg = loaded.config
    assert cfg.n_layers == 2 and cfg.vocab_size == VOCAB
    assert cfg.n_heads == hf.config.num_attention_heads and cfg.n_kv_heads == hf.config.num_key_value_heads
    head_dim = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
    assert cfg.head_dim == head_dim
    assert cfg.tie_embeddings == hf.config.tie_word_embeddings
    assert cfg.qkv_bias == kind.startswith("qwen2")
    assert cfg.rope_theta == pytest.approx(hf.config.rope_parameters["rope_theta"])
    ids = IDS * 3  # 48 positions: past the llama3 variant's original context of 16
    diff = (_our_logits(loaded.model, ids) - _hf_logits(hf, ids)).abs().max().item()
    assert diff <= 1e-4, f"{kind}: max |ours - transformers| = {diff}"


def test_hf_sharded_safetensors(tmp_path, word_tokenizer):
    hf = _randomize(_hf_variant("llama-gqa-untied"), seed=7)
    _save_hf(hf, tmp_path, word_tokenizer, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) >= 3 and (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_model(tmp_path, "float32")
    diff = (_our_logits(loaded.model, IDS) - _hf_logits(hf, IDS)).abs().max().item()
    assert diff <= 1e-4


def test_hf_eos_ids_merge_config_and_generation_config(tmp_path, word_tokenizer):
    hf = _randomize(_hf_variant("llama-gqa-untied"), seed=8)
    _save_hf(hf, tmp_path, word_tokenizer)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    ckpt = read_checkpoint(tmp_path, max_seq_len=100)
    assert ckpt.config.eos_token_ids == (2, 5)
    assert ckpt.config.max_seq_len == 100  # capped below max_position_embeddings=256
    assert read_checkpoint(tmp_path).config.max_seq_len == 256
    assert ckpt.tokenizer_meta["format"] == "hf"


def test_load_model_dtype(tmp_path, word_tokenizer):
    hf = _randomize(_hf_variant("qwen2-bias-tied"), seed=9)
    _save_hf(hf, tmp_path, word_tokenizer)
    f32 = load_model(tmp_path, "float32")
    bf16 = load_model(tmp_path, "bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    assert bf16.model.device.type == "cpu" and f32.model.dtype == torch.float32
    a, b = _our_logits(f32.model, IDS), _our_logits(bf16.model, IDS).float()
    assert (a - b).abs().max().item() < 0.1 * a.abs().max().item()
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(tmp_path, "float8")


# --- GGUF files ---------------------------------------------------------------------------------------------

# dim 256: every row is whole 256-value super-blocks, so the K-quants fit too.
G_DIM, G_HEADS, G_KV, G_FFN, G_LAYERS = 256, 4, 2, 256, 2


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute: HF rotate-half rows -> interleaved RoPE pairs.

    Works on any row-major array whose first axis is the output rows (float weights or quantized bytes:
    every row is quantized on its own, so permuting rows commutes with quantizing them).
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype("<f2").view(np.uint8).reshape(*x.shape, 2)


def _random_q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    nb = cols // 256
    d = rng.uniform(1.2e-4, 3.6e-4, (rows, nb)).astype(np.float16)
    dmin = (d.astype(np.float32) * 7.5).astype(np.float16)  # roughly centres the values
    scales = rng.integers(0, 256, (rows, nb, 12), dtype=np.uint8)
    qs = rng.integers(0, 256, (rows, nb, 128), dtype=np.uint8)
    return np.concatenate([_f16(d), _f16(dmin), scales, qs], axis=-1).reshape(rows, nb * 144)


def _random_q5_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    nb = cols // 256
    d = rng.uniform(0.6e-4, 1.8e-4, (rows, nb)).astype(np.float16)
    dmin = (d.astype(np.float32) * 15.5).astype(np.float16)
    scales = rng.integers(0, 256, (rows, nb, 12), dtype=np.uint8)
    qh_qs = rng.integers(0, 256, (rows, nb, 160), dtype=np.uint8)
    return np.concatenate([_f16(d), _f16(dmin), scales, qh_qs], axis=-1).reshape(rows, nb * 176)


def _random_q6_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    nb = cols // 256
    ql = rng.integers(0, 256, (rows, nb, 128), dtype=np.uint8)
    qh = rng.integers(0, 256, (rows, nb, 64), dtype=np.uint8)
    sc = rng.integers(-128, 128, (rows, nb, 16), dtype=np.int8).view(np.uint8)
    d = rng.uniform(2e-5, 7e-5, (rows, nb)).astype(np.float16)
    return np.concatenate([ql, qh, sc, _f16(d)], axis=-1).reshape(rows, nb * 210)


def _dequant_q4_k(raw: np.ndarray) -> np.ndarray:
    """A port of llama.cpp's dequantize_row_q4_K (ggml-quants.c), vectorized over blocks."""
    rows = raw.shape[0]
    blk = raw.reshape(-1, 144)
    d = blk[:, 0:2].copy().view("<f2")[:, 0].astype(np.float32)
    dmin = blk[:, 2:4].copy().view("<f2")[:, 0].astype(np.float32)
    sc, q = blk[:, 4:16].astype(np.int32), blk[:, 16:144].astype(np.int32)
    scale, mins = np.zeros((len(blk), 8), np.int32), np.zeros((len(blk), 8), np.int32)
    for j in range(8):  # get_scale_min_k4
        if j < 4:
            scale[:, j], mins[:, j] = sc[:, j] & 63, sc[:, j + 4] & 63
        else:
            scale[:, j] = (sc[:, j + 4] & 0xF) | ((sc[:, j - 4] >> 6) << 4)
            mins[:, j] = (sc[:, j + 4] >> 4) | ((sc[:, j] >> 6) << 4)
    y = np.zeros((len(blk), 256), np.float32)
    for n in range(4):
        ql = q[:, 32 * n : 32 * n + 32]
        d1, m1 = d * scale[:, 2 * n], dmin * mins[:, 2 * n]
        d2, m2 = d * scale[:, 2 * n + 1], dmin * mins[:, 2 * n + 1]
        y[:, 64 * n : 64 * n + 32] = d1[:, None] * (ql & 0xF) - m1[:, None]
        y[:, 64 * n + 32 : 64 * n + 64] = d2[:, None] * (ql >> 4) - m2[:, None]
    return y.reshape(rows, -1)


def _dequant_q6_k(raw: np.ndarray) -> np.ndarray:
    """A port of llama.cpp's dequantize_row_q6_K, vectorized over blocks."""
    rows = raw.shape[0]
    blk = raw.reshape(-1, 210)
    ql, qh = blk[:, 0:128].astype(np.int32), blk[:, 128:192].astype(np.int32)
    sc = blk[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = blk[:, 208:210].copy().view("<f2")[:, 0].astype(np.float32)[:, None]
    y = np.zeros((len(blk), 256), np.float32)
    i = np.arange(32) // 16
    for half in range(2):
        lo, hi, s, o = (
            ql[:, 64 * half : 64 * half + 64],
            qh[:, 32 * half : 32 * half + 32],
            sc[:, 8 * half :],
            128 * half,
        )
        q1 = ((lo[:, :32] & 0xF) | (((hi >> 0) & 3) << 4)) - 32
        q2 = ((lo[:, 32:] & 0xF) | (((hi >> 2) & 3) << 4)) - 32
        q3 = ((lo[:, :32] >> 4) | (((hi >> 4) & 3) << 4)) - 32
        q4 = ((lo[:, 32:] >> 4) | (((hi >> 6) & 3) << 4)) - 32
        y[:, o : o + 32] = d * s[:, i] * q1
        y[:, o + 32 : o + 64] = d * s[:, i + 2] * q2
        y[:, o + 64 : o + 96] = d * s[:, i + 4] * q3
        y[:, o + 96 : o + 128] = d * s[:, i + 6] * q4
    return y.reshape(rows, -1)


def _encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(what goes into the file, in HF row order; the float32 values it stands for)."""
    if qtype == Q.F32:
        return w, w
    if qtype == Q.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    if qtype == Q.Q4_K:
        raw = _random_q4_k(*w.shape, rng)
        expected = _dequant_q4_k(raw)
    elif qtype == Q.Q6_K:
        raw = _random_q6_k(*w.shape, rng)
        expected = _dequant_q6_k(raw)
    elif qtype == Q.Q5_K:  # no port of llama.cpp's here: gguf's dequantizer is the reference
        raw = _random_q5_k(*w.shape, rng)
        return raw, gguf.quants.dequantize(raw, qtype).astype(np.float32)
    else:
        raw = gguf.quants.quantize(w, qtype)
        return raw, gguf.quants.dequantize(raw, qtype).astype(np.float32)
    # The independent port and gguf's own dequantizer agree on these blocks.
    np.testing.assert_allclose(gguf.quants.dequantize(raw, qtype), expected, rtol=1e-5, atol=1e-7)
    return raw, expected


TOKENS = [chr(c) for c in range(ord("A"), ord("Z") + 1)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
TOKENS += [str(i) for i in range(8)] + ["ab", " ", "<|im_start|>", "<|im_end|>"]
assert len(TOKENS) == VOCAB


def _write_gguf(
    path: Path,
    arch: str,
    hf_sd: dict[str, torch.Tensor],
    qtype: Q,
    tied: bool,
    seed: int = 0,
    rope_theta: float = 10000.0,
    tokenizer_model: str = "gpt2",
    override: dict[str, tuple[np.ndarray, Q]] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    linear_rope_factor: float | None = None,
    extra_kv: dict[str, str] | None = None,
    add_bos: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Write a GGUF the way llama.cpp's converter lays it out; return the HF-layout weights it stands for.
    `add_bos`: the file's tokenizer.ggml.add_bos_token (None: the key is left out)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    if linear_rope_factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear_rope_factor)
    for name, tensor in (extra_tensors or {}).items():
        w.add_tensor(name, tensor)
    for key, value in (extra_kv or {}).items():
        w.add_string(key, value)
    w.add_context_length(128)
    w.add_embedding_length(G_DIM)
    w.add_block_count(G_LAYERS)
    w.add_feed_forward_length(G_FFN)
    w.add_head_count(G_HEADS)
    w.add_head_count_kv(G_KV)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(G_DIM // G_HEADS)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (VOCAB - 2) + [3, 3])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(VOCAB - 2)
    w.add_eos_token_id(VOCAB - 1)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    expected: dict[str, torch.Tensor] = {}
    permute = arch in ("llama", "smollm")  # the Llama family, whose q/k rows llama.cpp permutes

    def put(gguf_name: str, hf_name: str, n_head: int | None = None) -> None:
        t = hf_sd[hf_name].float().numpy()
        if override and gguf_name in override:
            raw, raw_type = override[gguf_name]
            w.add_tensor(gguf_name, raw, raw_dtype=raw_type)
            return
        if t.ndim == 1:  # norms and biases stay F32, as llama.cpp writes them
            w.add_tensor(gguf_name, t)
            expected[hf_name] = torch.from_numpy(t.copy())
            return
        raw, values = _encode(t, qtype, rng)
        expected[hf_name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        if permute and n_head is not None:
            raw = _permute(raw, n_head)
        w.add_tensor(gguf_name, raw, raw_dtype=qtype if raw.dtype == np.uint8 else None)

    put("token_embd.weight", "model.embed_tokens.weight")
    if not tied:
        put("output.weight", "lm_head.weight")
    put("output_norm.weight", "model.norm.weight")
    for i in range(G_LAYERS):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        put(p + "attn_q.weight", h + "self_attn.q_proj.weight", G_HEADS)
        put(p + "attn_k.weight", h + "self_attn.k_proj.weight", G_KV)
        put(p + "attn_v.weight", h + "self_attn.v_proj.weight")
        if arch == "qwen2":
            for n in "qkv":
                put(p + f"attn_{n}.bias", h + f"self_attn.{n}_proj.bias")
        put(p + "attn_output.weight", h + "self_attn.o_proj.weight")
        put(p + "attn_norm.weight", h + "input_layernorm.weight")
        put(p + "ffn_norm.weight", h + "post_attention_layernorm.weight")
        put(p + "ffn_gate.weight", h + "mlp.gate_proj.weight")
        put(p + "ffn_up.weight", h + "mlp.up_proj.weight")
        put(p + "ffn_down.weight", h + "mlp.down_proj.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if tied and "model.embed_tokens.weight" in expected:
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    return expected


def _gguf_source_model(arch: str, tied: bool, seed: int, rope_theta: float = 10000.0, rope: dict | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=G_DIM,
        intermediate_size=G_FFN,
        num_hidden_layers=G_LAYERS,
        num_attention_heads=G_HEADS,
        num_key_value_heads=G_KV,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    if rope:
        kwargs["rope_parameters"] = rope
    else:
        kwargs["rope_theta"] = rope_theta
    if arch == "qwen2":
        return _randomize(Qwen2ForCausalLM(Qwen2Config(**kwargs)), seed)
    return _randomize(LlamaForCausalLM(LlamaConfig(**kwargs)), seed)


def _expected_state_dict(exp: dict[str, torch.Tensor], qkv_bias: bool, tied: bool) -> dict[str, torch.Tensor]:
    """The decoder's own naming for HF-layout weights, written out independently of the reader."""
    sd = {"embed.weight": exp["model.embed_tokens.weight"], "norm.weight": exp["model.norm.weight"]}
    if not tied:
        sd["lm_head.weight"] = exp["lm_head.weight"]
    for i in range(G_LAYERS):
        h, o = f"model.layers.{i}.", f"layers.{i}."
        a = h + "self_attn."
        sd[o + "attn.wqkv.weight"] = torch.cat(
            [exp[a + "q_proj.weight"], exp[a + "k_proj.weight"], exp[a + "v_proj.weight"]]
        )
        if qkv_bias:
            sd[o + "attn.wqkv.bias"] = torch.cat(
                [exp[a + "q_proj.bias"], exp[a + "k_proj.bias"], exp[a + "v_proj.bias"]]
            )
        sd[o + "attn.wo.weight"] = exp[a + "o_proj.weight"]
        sd[o + "attn_norm.weight"] = exp[h + "input_layernorm.weight"]
        sd[o + "ffn_norm.weight"] = exp[h + "post_attention_layernorm.weight"]
        sd[o + "w13.weight"] = torch.cat([exp[h + "mlp.gate_proj.weight"], exp[h + "mlp.up_proj.weight"]])
        sd[o + "w2.weight"] = exp[h + "mlp.down_proj.weight"]
    return sd


GGUF_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"]


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_gguf_tensor_types_and_qk_unpermutation(tmp_path, qtype):
    """Every tensor reads back as the values written (q/k un-permuted), and logits match transformers
    running the same dequantized weights."""
    tied = qtype in ("F16", "Q4_1")  # both layouts of the head, across the types
    seed = GGUF_TYPES.index(qtype)
    src = _gguf_source_model("llama", tied, seed)
    path = tmp_path / f"tiny-{qtype}.gguf"
    exp = _write_gguf(path, "llama", src.state_dict(), Q[qtype], tied, seed)

    ckpt = read_checkpoint(path)
    want = _expected_state_dict(exp, qkv_bias=False, tied=tied)
    assert set(ckpt.state_dict) == set(want)
    for name, tensor in want.items():
        got = ckpt.state_dict[name]
        assert got.dtype == torch.float32 and got.shape == tensor.shape, name
        torch.testing.assert_close(got, tensor, rtol=1e-6, atol=1e-7, msg=f"{qtype}: {name} differs")

    src.load_state_dict({k: v for k, v in exp.items() if k in src.state_dict()}, strict=False)
    for k, v in exp.items():
        if k in src.state_dict():
            torch.testing.assert_close(src.state_dict()[k], v)  # the oracle now runs the file's values
    loaded = load_model(path, "float32")
    ids = IDS * 2
    diff = (_our_logits(loaded.model, ids) - _hf_logits(src, ids)).abs().max().item()
    assert diff <= 1e-4, f"{qtype}: max |ours - transformers| = {diff}"


def test_gguf_unpermutation_is_exact_on_f32(tmp_path):
    """The q/k rows the decoder gets are exactly transformers' rows: the permutation is undone, not redone."""
    src = _gguf_source_model("llama", tied=False, seed=21)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", src.state_dict(), Q.F32, tied=False)
    wqkv = read_checkpoint(path).state_dict["layers.1.attn.wqkv.weight"]
    hf = src.state_dict()
    q, k, v = wqkv.split([G_DIM, G_DIM // G_HEADS * G_KV, G_DIM // G_HEADS * G_KV])
    assert torch.equal(q, hf["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(k, hf["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(v, hf["model.layers.1.self_attn.v_proj.weight"])
    # And the file really holds permuted rows (otherwise this test would prove nothing).
    reader = gguf.GGUFReader(str(path))
    raw_q = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight").data
    assert not np.array_equal(raw_q, hf["model.layers.1.self_attn.q_proj.weight"].numpy())


def test_gguf_from_transformers_own_gguf_loader(tmp_path):
    """transformers reads our tiny llama GGUF (undoing the permutation its own way): same logits."""
    from transformers import AutoModelForCausalLM

    src = _gguf_source_model("llama", tied=False, seed=22, rope_theta=50000.0)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", src.state_dict(), Q.Q8_0, tied=False, rope_theta=50000.0)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    ours = load_model(path, "float32")
    assert ours.config.rope_theta == 50000.0
    diff = (_our_logits(ours.model, IDS) - _hf_logits(theirs, IDS)).abs().max().item()
    assert diff <= 1e-4


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_qwen2_with_bias_is_not_permuted(tmp_path, qtype):
    src = _gguf_source_model("qwen2", tied=True, seed=23, rope_theta=1e6)
    path = tmp_path / "tiny-qwen2.gguf"
    exp = _write_gguf(path, "qwen2", src.state_dict(), Q[qtype], tied=True, rope_theta=1e6)
    loaded = load_model(path, "float32")
    assert loaded.config.qkv_bias and loaded.config.tie_embeddings
    src.load_state_dict({k: v for k, v in exp.items() if k in src.state_dict()}, strict=False)
    diff = (_our_logits(loaded.model, IDS) - _hf_logits(src, IDS)).abs().max().item()
    assert diff <= 1e-4


def _llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf writes it for Llama 3.1 RoPE scaling."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.parametrize("kind", ["llama3-rope-freqs", "linear"])
def test_gguf_rope_scaling_matches_transformers(tmp_path, kind):
    if kind == "linear":
        rope = dict(rope_type="linear", rope_theta=10000.0, factor=4.0)
        extra, linear = None, 4.0
    else:
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
        rope["original_max_position_embeddings"] = 64
        extra, linear = {"rope_freqs.weight": _llama3_rope_factors(rope, G_DIM // G_HEADS)}, None
    src = _gguf_source_model("llama", tied=False, seed=27, rope=rope)
    path = tmp_path / f"{kind}.gguf"
    exp = _write_gguf(
        path,
        "llama",
        src.state_dict(),
        Q.F32,
        False,
        rope_theta=rope["rope_theta"],
        extra_tensors=extra,
        linear_rope_factor=linear,
    )
    loaded = load_model(path, "float32")
    assert loaded.config.rope_scaling is not None
    assert loaded.config.rope_scaling["rope_type"] == ("linear" if kind == "linear" else "freq_factors")
    src.load_state_dict({k: v for k, v in exp.items() if k in src.state_dict()}, strict=False)
    ids = IDS * 3
    diff = (_our_logits(loaded.model, ids) - _hf_logits(src, ids)).abs().max().item()
    assert diff <= 1e-4, f"{kind}: max |ours - transformers| = {diff}"


def test_unsupported_rope_scaling_is_refused_not_ignored(tmp_path, word_tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    rope = dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1, rope_parameters=rope)
    _save_hf(Qwen2ForCausalLM(cfg), tmp_path / "hf", word_tokenizer)
    with pytest.raises(WeightsError, match="RoPE scaling 'yarn' is not supported"):
        read_checkpoint(tmp_path / "hf")
    src = _gguf_source_model("llama", tied=True, seed=28)
    path = tmp_path / "yarn.gguf"
    _write_gguf(path, "llama", src.state_dict(), Q.F32, True, extra_kv={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(WeightsError, match="RoPE scaling 'yarn' is not supported"):
        read_checkpoint(path)


def test_gguf_metadata(tmp_path):
    src = _gguf_source_model("llama", tied=False, seed=24)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", src.state_dict(), Q.F16, tied=False, rope_theta=12345.0)
    ckpt = read_checkpoint(path)
    c = ckpt.config
    assert (c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.intermediate_size, c.head_dim) == (
        VOCAB,
        G_DIM,
        G_LAYERS,
        G_HEADS,
        G_KV,
        G_FFN,
        G_DIM // G_HEADS,
    )
    assert c.rope_theta == 12345.0 and c.norm_eps == pytest.approx(1e-6) and not c.tie_embeddings
    assert c.max_seq_len == 128 and read_checkpoint(path, max_seq_len=32).config.max_seq_len == 32
    assert c.bos_token_id == VOCAB - 2 and c.eos_token_ids == (VOCAB - 1,)
    assert ckpt.tokenizer_meta["format"] == "gguf" and ckpt.tokenizer_meta["tokens"] == TOKENS
    loaded = load_model(path, "float32")
    assert loaded.tokenizer.eos_token_ids == {VOCAB - 1}
    assert loaded.tokenizer.encode("Hab<|im_end|>") == [TOKENS.index("H"), TOKENS.index("ab"), VOCAB - 1]


def _assert_reads_as_the_gguf_package(path: Path) -> None:
    from app.engine.model.gguf_file import GGUFFile

    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # the reader's own entries
    assert list(ours.fields) == list(fields)
    for key, f in fields.items():
        value = ours.fields[key]
        assert value == f.contents() and type(value) is type(f.contents()), key
        assert ours.types[key] == (f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, a.shape, a.n_elements, a.n_bytes) == (
            b.tensor_type,
            tuple(map(int, b.shape)),
            b.n_elements,
            b.n_bytes,
        )
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "phi3", "llama-q8_0", "llama-q4_k"])
def test_our_gguf_header_reader_reads_what_the_gguf_package_reads(tmp_path, arch):
    """app.engine.model.gguf_file (tens of times faster on large vocabularies) gives every metadata value, its
    types and every tensor's bytes as the `gguf` package's reader does, on a tiny file of each architecture
    (and quantized blocks)."""
    from app.bench import synthetic

    path = tmp_path / f"{arch}.gguf"
    if arch.startswith("llama"):
        qtype = Q.Q8_0 if arch.endswith("q8_0") else Q.Q4_K
        _write_gguf(path, "llama", _gguf_source_model("llama", tied=False, seed=25).state_dict(), qtype, tied=False)
    else:
        synthetic.write_tiny_gguf(path, arch)
    _assert_reads_as_the_gguf_package(path)


@pytest.mark.slow
def test_our_gguf_header_reader_on_the_real_target(target_path):
    """The same on the real target: a 49 k-token vocabulary with its merges, Q4_1 and Q8_0 blocks."""
    _assert_reads_as_the_gguf_package(target_path)


# --- what the readers refuse -------------------------------------------------------------------------------


def test_not_a_model_path(tmp_path):
    with pytest.raises(WeightsError, match="does not exist"):
        read_checkpoint(tmp_path / "missing.gguf")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(WeightsError, match="neither a GGUF file nor an HF-format directory"):
        read_checkpoint(text)
    with pytest.raises(WeightsError, match=r"no config\.json"):
        read_checkpoint(tmp_path)
    with pytest.raises(WeightsError, match="does not exist"):
        load_model(tmp_path / "missing.gguf")


def test_hf_directory_refusals(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(WeightsError, match="model_type 'gpt2' is not supported") as err:
        read_checkpoint(tmp_path)
    assert "llama" in str(err.value) and "\n" not in str(err.value)
    cfg = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 8,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="no safetensors weights"):
        read_checkpoint(tmp_path)


def test_smollm3_is_refused_for_its_nope_layers(tmp_path, word_tokenizer):
    """SmolLM3 is otherwise a Llama, but it skips RoPE on every 4th layer, which this decoder does not do: a
    loadable-looking checkpoint must be refused, naming the architecture and the reason, not run with wrong logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1)
    hf = _save_hf(LlamaForCausalLM(cfg), tmp_path / "hf", word_tokenizer)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "model_type": "smollm3", "no_rope_layer_interval": 4}))
    for load in (read_checkpoint, load_model):
        with pytest.raises(WeightsError, match="model_type 'smollm3' is not supported: its NoPE layers") as err:
            load(hf)
        assert "\n" not in str(err.value)
    src = _gguf_source_model("llama", tied=True, seed=29)
    path = tmp_path / "smollm3.gguf"
    _write_gguf(path, "smollm3", src.state_dict(), Q.F32, True)
    with pytest.raises(WeightsError, match="architecture 'smollm3' is not supported: its NoPE layers"):
        read_checkpoint(path)


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(WeightsError, match="architecture 'falcon' is not supported") as err:
        read_checkpoint(path)
    assert "falcon.gguf" in str(err.value) and "llama" in str(err.value)


def test_gguf_unsupported_tensor_type(tmp_path):
    src = _gguf_source_model("llama", tied=True, seed=25)
    path = tmp_path / "iq4nl.gguf"
    # The embedding in IQ4_NL (18-byte blocks of 32 values), a type this loader does not read.
    blocks = np.concatenate(
        [_f16(np.full((VOCAB, G_DIM // 32), 0.01, np.float32)), np.zeros((VOCAB, G_DIM // 32, 16), np.uint8)], axis=-1
    ).reshape(VOCAB, -1)
    override = {"token_embd.weight": (blocks, Q.IQ4_NL)}
    _write_gguf(path, "llama", src.state_dict(), Q.F32, tied=True, override=override)
    with pytest.raises(WeightsError, match=r"token_embd\.weight has type IQ4_NL"):
        read_checkpoint(path)


@pytest.mark.parametrize("add_bos", [True, False, None])
def test_gguf_prompts_get_bos_as_the_file_says(tmp_path, add_bos):
    """tokenizer.ggml.add_bos_token decides whether a prompt starts with BOS, as in llama.cpp (a file that does
    not say: no BOS); a chat template that writes bos_token itself does not get a second one."""
    bos, hab = VOCAB - 2, [TOKENS.index("H"), TOKENS.index("ab")]
    path = tmp_path / "tiny.gguf"
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    src = _gguf_source_model("llama", tied=True, seed=27)
    _write_gguf(
        path, "llama", src.state_dict(), Q.F32, True, extra_kv={"tokenizer.chat_template": template}, add_bos=add_bos
    )
    assert read_checkpoint(path).tokenizer_meta["add_bos_token"] is bool(add_bos)
    tokenizer = load_model(path, "float32").tokenizer
    assert tokenizer.add_bos is bool(add_bos)
    assert tokenizer.encode("Hab") == ([bos] if add_bos else []) + hab
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hab"}], add_generation_prompt=False)
    assert chat == "<|im_start|>Hab" and tokenizer.encode(chat) == [bos, *hab]


def test_load_model_builds_the_kernels_in_the_cache_dir_it_is_given(tmp_path):
    """bfloat16 on a CPU kernel: the kernel chosen while loading is built in `cache_dir`/kernels."""
    from app.engine import kernels

    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", _gguf_source_model("llama", True, 28).state_dict(), Q.F32, True)
    with kernels.selected("generic"):
        model = load_model(path, "bfloat16", "cpu", cache_dir=tmp_path / "cache").model
        assert model.kernel is not None and model.kernel.path.parent == tmp_path / "cache" / "kernels"
    with kernels.selected("generic"):  # float32 needs no kernel: nothing is built
        load_model(path, "float32", "cpu", cache_dir=tmp_path / "unused")
    assert not (tmp_path / "unused").exists()


def test_gguf_unsupported_tokenizer_model(tmp_path):
    src = _gguf_source_model("llama", tied=True, seed=26)
    path = tmp_path / "unigram.gguf"
    _write_gguf(path, "llama", src.state_dict(), Q.F32, tied=True, tokenizer_model="t5")
    read_checkpoint(path)  # the weights are fine
    with pytest.raises(TokenizerError, match=r"tokenizer model 't5' is not supported \(supported: gpt2, llama\)"):
        load_model(path)


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_llama_cpp_baseline_copies_keep_the_weights(tmp_path, kind):
    """`specserve bench --llama-cpp f32|bf16` runs llama.cpp on a dequantized copy of the target's GGUF: every
    metadata field is kept (file type updated), vectors stay F32, and the weights read back as the source's,
    exactly in f32 and to bf16's rounding in bf16."""
    from app.bench.llamacpp import convert_gguf

    src = tmp_path / "tiny-Q4_1.gguf"
    _write_gguf(src, "llama", _gguf_source_model("llama", True, 5).state_dict(), Q.Q4_1, True, 5)
    dst = convert_gguf(src, tmp_path / f"tiny.{kind}.gguf", kind)

    before, after = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(dst))
    assert int(after.fields["general.file_type"].contents()) == {"f32": 0, "bf16": 32}[kind]
    for name, field in before.fields.items():
        if not name.startswith("GGUF.") and name != "general.file_type":
            assert after.fields[name].contents() == field.contents(), name
    types = {t.name: t.tensor_type for t in after.tensors}
    assert {types[t.name] for t in after.tensors if len(t.shape) == 1} == {Q.F32}
    assert {types[t.name] for t in after.tensors if len(t.shape) > 1} == {Q.F32 if kind == "f32" else Q.BF16}

    want, got = read_checkpoint(src).state_dict, read_checkpoint(dst).state_dict
    assert set(got) == set(want)
    for name, tensor in want.items():
        expected = tensor if kind == "f32" or tensor.dim() == 1 else tensor.bfloat16().float()
        assert torch.equal(got[name], expected), name
    assert convert_gguf(src, dst, kind) == dst  # an existing copy is reused
    with pytest.raises(ValueError, match="unknown GGUF type"):
        convert_gguf(src, tmp_path / "x.gguf", "q8")

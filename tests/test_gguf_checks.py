"""What a checkpoint must be before the C kernels compute on it (issue 67): every tensor the shape its parameter
has for the model's config, a quantized one's rows the bytes its format takes, refused at load as a WeightsError
naming the file and the tensor; and the kernels' Python side refusing, with a ValueError, sizes that do not fit
the buffers it hands to C (a crafted GGUF would otherwise have them read and written out of bounds)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from app.engine import kernels
from app.engine.kernels.quantized import QuantizedWeight, quantize
from app.engine.model.config import ModelConfig
from app.engine.model.loading import load_model
from app.engine.model.transformer import Transformer
from app.engine.model.weights import Checkpoint, WeightsError, check_shapes, read_checkpoint
from tests.test_weights import G_DIM, G_FFN, VOCAB, _gguf_source_model, _save_hf, _write_gguf

BF16 = torch.bfloat16


def _quantized(rows: int, cols: int, qtype: Q) -> tuple[np.ndarray, Q]:
    values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    return gguf.quants.quantize(values, qtype), qtype


def _refused(path, weights: str) -> str:
    dtype = "auto" if weights == "native" else "bfloat16"
    with pytest.raises(WeightsError) as err:
        load_model(path, dtype, weights=weights)
    message = str(err.value)
    assert "\n" not in message and path.name in message
    return message


# Per tensor: a shape the C kernels would have been handed as is (native) and torch refused with a traceback
# (bf16). attn_output's K wider than the attention's output: each row read past x; attn_q's rows more than
# the heads: its outputs written past the layer stack's buffers.
WRONG = [
    ("blk.0.attn_output.weight", Q.Q8_0, (G_DIM, 2 * G_DIM)),
    ("blk.1.attn_q.weight", Q.Q4_0, (2 * G_DIM, G_DIM)),
    ("blk.1.ffn_down.weight", Q.Q8_0, (G_DIM, G_FFN + 32)),
    ("token_embd.weight", Q.Q8_0, (VOCAB + 8, G_DIM)),
]


@pytest.mark.parametrize("weights", ["native", "bf16"])
@pytest.mark.parametrize(("tensor", "qtype", "shape"), WRONG, ids=[w[0] for w in WRONG])
def test_a_quantized_matrix_of_another_shape_is_refused_naming_it(tmp_path, tensor, qtype, shape, weights):
    path = tmp_path / "crafted.gguf"
    sd = _gguf_source_model("llama", tied=True, seed=80).state_dict()
    _write_gguf(path, "llama", sd, qtype, tied=True, override={tensor: _quantized(*shape, qtype)})
    message = _refused(path, weights)
    assert f"tensor {tensor} has shape {list(shape)}" in message
    assert "expects" in message


@pytest.mark.parametrize("weights", ["native", "bf16"])
def test_a_norm_of_another_shape_is_refused_naming_it(tmp_path, weights):
    path = tmp_path / "crafted-norm.gguf"
    sd = _gguf_source_model("llama", tied=True, seed=81).state_dict()
    override = {"blk.1.ffn_norm.weight": (np.ones(G_DIM + 32, np.float32), Q.F32)}
    _write_gguf(path, "llama", sd, Q.Q8_0, tied=True, override=override)
    message = _refused(path, weights)
    assert f"tensor blk.1.ffn_norm.weight has shape [{G_DIM + 32}]; the model's config expects [{G_DIM}]" in message


def test_an_hf_tensor_of_another_shape_is_refused_naming_it(tmp_path, word_tokenizer):
    """The check after assembly, in the decoder's names, for any checkpoint: here an HF directory's final norm."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1)
    hf = _save_hf(LlamaForCausalLM(cfg), tmp_path / "hf", word_tokenizer)
    weights = load_file(str(hf / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(80)
    save_file(weights, str(hf / "model.safetensors"))
    with pytest.raises(
        WeightsError, match=r"hf: tensor norm\.weight has shape \[80\]; the model's config expects \[64\]"
    ):
        load_model(hf, "float32")


def test_a_truncated_gguf_is_refused_in_one_line(tmp_path):
    path = tmp_path / "cut.gguf"
    _write_gguf(path, "llama", _gguf_source_model("llama", tied=True, seed=82).state_dict(), Q.Q8_0, tied=True)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(WeightsError, match=r"cut\.gguf: not a GGUF this loader can read") as err:
        read_checkpoint(path)
    assert "\n" not in str(err.value)


def _config() -> ModelConfig:
    return ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=64)


def test_check_shapes_refuses_quantized_rows_of_other_sizes_or_bytes():
    """What `load_model` checks, on a checkpoint built by hand: the shapes against the parameters, and each
    quantized segment's bytes per row (`QuantizedWeight` checks them when built; its segments can be swapped
    after)."""
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in Transformer(_config()).state_dict().items()}
    plain = {name: torch.zeros(shape) for name, shape in expected.items()}
    check_shapes(Checkpoint(_config(), plain, source="/x/m.gguf"), expected)

    wide = dict(plain, **{"layers.0.attn.wo.weight": quantize(torch.randn(64, 128), "Q8_0")})
    with pytest.raises(WeightsError, match=r"m\.gguf: tensor layers\.0\.attn\.wo\.weight has shape \[64, 128\]"):
        check_shapes(Checkpoint(_config(), wide, source="/x/m.gguf"), expected)

    short = quantize(torch.randn(64, 64), "Q8_0")
    short.segments[0] = ("Q8_0", short.segments[0][1][:, :34])  # one block of the two 64 inputs take
    cut = dict(plain, **{"layers.0.attn.wo.weight": short})
    with pytest.raises(WeightsError, match=r"wo\.weight has Q8_0 rows of \[34\] bytes; 64 inputs take 68"):
        check_shapes(Checkpoint(_config(), cut, source="/x/m.gguf"), expected)

    extra = dict(plain, **{"lm_head.weight": torch.zeros(64, 64)})
    with pytest.raises(WeightsError, match=r"unexpected \['lm_head\.weight'\]"):
        check_shapes(Checkpoint(_config(), extra, source="/x/m.gguf"), expected)


def test_load_quantized_refuses_a_matrix_of_another_shape():
    with torch.device("meta"):
        model = Transformer(_config())
    with pytest.raises(
        ValueError, match=r"layers\.0\.w2\.weight: a quantized weight \[64, 96\] for a parameter \[64, 64\]"
    ):
        model.load_quantized({"layers.0.w2.weight": quantize(torch.randn(64, 96), "Q8_0")}, None)


def test_quantized_rows_must_be_whole_blocks():
    with pytest.raises(ValueError, match="whole blocks of 32 inputs, not 48"):
        QuantizedWeight([("Q8_0", torch.zeros(2, 34, dtype=torch.uint8))], 48)


# --- the C boundary -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generic() -> kernels.Kernel:
    return kernels.load("generic")


def _products(kern: kernels.Kernel) -> list:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g)
    return [kern.linear(w.to(BF16), None), kern.qlinear(quantize(w, "Q8_0"), None)]


def test_products_refuse_a_residual_of_another_shape_or_type(generic):
    x = torch.randn(3, 64).to(BF16)
    for product in _products(generic):
        assert product(x, residual=torch.zeros(3, 64, dtype=BF16)).shape == (3, 64)
        for residual in (torch.zeros(3, 32, dtype=BF16), torch.zeros(2, 64, dtype=BF16), torch.zeros(3, 64)):
            with pytest.raises(ValueError, match="a residual is bf16 \\[3, 64\\]"):
                product(x, residual=residual)


def test_products_refuse_rows_of_another_width_or_type(generic):
    for product in _products(generic):
        # Two rows' worth in one: the C side would write two output rows into one.
        with pytest.raises(ValueError, match="a product of 64 inputs takes rows of 64, not 128"):
            product(torch.randn(1, 128).to(BF16))
        with pytest.raises(ValueError, match="takes rows of 128, not 64"):
            product(torch.randn(1, 64).to(BF16), swiglu=True)
        with pytest.raises(ValueError, match="bf16 rows"):
            product(torch.randn(1, 64))
        with pytest.raises(ValueError, match="fused norm is a bf16 weight \\[64\\]"):
            product(torch.randn(1, 64).to(BF16), norm=torch.ones(32, dtype=BF16))
        with pytest.raises(ValueError, match="one of norm, swiglu and geglu"):
            product(torch.randn(1, 128).to(BF16), norm=torch.ones(64, dtype=BF16), swiglu=True)


def test_products_refuse_weights_the_kernels_would_misread(generic):
    with pytest.raises(ValueError, match="bias \\[64\\]"):
        generic.linear(torch.randn(64, 64).to(BF16), torch.zeros(32))
    with pytest.raises(ValueError, match="K a multiple of 32"):
        generic.linear(torch.randn(64, 48).to(BF16), None)
    short = quantize(torch.randn(8, 64), "Q8_0")
    short.segments[0] = ("Q8_0", short.segments[0][1][:, :34])
    with pytest.raises(ValueError, match="rows of 64 inputs are \\[rows, 68\\] bytes"):
        generic.qlinear(short, None)


def test_rms_norm_refuses_a_residual_of_another_shape(generic):
    x = torch.randn(2, 32).to(BF16)
    with pytest.raises(ValueError, match="a residual is bf16 \\[2, 32\\]"):
        generic.rms_norm(x, torch.ones(32, dtype=BF16), 1e-5, residual=torch.zeros(1, 32, dtype=BF16))


def test_attention_refuses_positions_past_the_cache(generic):
    q, k, v = (torch.randn(1, 2, n, 32).to(BF16) for n in (2, 1, 1))
    cache = torch.zeros(1, 4, 32, dtype=BF16)
    assert generic.attention(q, k, v, [(0, 2, cache, cache.clone(), 2)]).shape == (1, 2, 64)
    with pytest.raises(ValueError, match=r"positions 3\.\.4 past a cache of 4"):
        generic.attention(q, k, v, [(0, 2, cache, cache.clone(), 3)])
    with pytest.raises(ValueError, match=r"rows 1\.\.2 of an attention call of 2"):
        generic.attention(q, k, v, [(1, 2, cache, cache.clone(), 0)])

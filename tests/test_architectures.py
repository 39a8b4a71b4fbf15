"""Every registered architecture against transformers as the oracle (a test fails where one has no tiny model).

Besides the Llama family, on tiny random-weight GGUFs written the way llama.cpp's converter lays each one out
(app.bench.synthetic.write_tiny_gguf), which transformers' GGUF loader reads too: float32 logits, greedy tokens, the
bfloat16 kernels, rows' independence, the tokenizer and the chat template; the HF-directory path from the same
weights; refusals. The Llama family (llama, mistral, qwen2, smollm): transformers' own class from a tiny config,
written as an HF directory (smollm, which only a GGUF names, as a GGUF), float32 logits and greedy tokens. The real
Gemma 3 270M file (an optional catalog target the user fetches; skipped where it is not fetched) last, marked slow.

Bounds: float32 logits within 1e-4 of transformers' (measured: 3e-5 at logits of 30-70); bfloat16 on a kernel within
5% of the largest logit (measured 1-4%: activations rounded to bfloat16 in every layer), the argmax equal wherever
transformers' top two are further apart than twice that.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from app import store
from app.bench.synthetic import TINY, write_tiny_gguf
from app.engine import kernels
from app.engine.model.architectures import REGISTRY
from app.engine.model.loading import load_model
from app.engine.model.tokenizer import Tokenizer
from app.engine.model.weights import WeightsError, read_checkpoint
from tests.conftest import BENCH_PROMPTS, KERNELS

ARCHS = list(TINY)
# What a GGUF does not say and transformers assumes otherwise (query_pre_attn_scalar 256, Qwen3's head size 128):
# set as the file's values, which our loader takes (llama.cpp's rules: the head size).
HF_OVERRIDES = {
    "qwen3": {"head_dim": 32},
    "gemma2": {"query_pre_attn_scalar": 32},
    "gemma3": {"query_pre_attn_scalar": 32},
}
F32_BOUND = 1e-4
BF16_BOUND = 0.05  # of the largest logit
TEXTS = [
    "Hello world",
    " leading space",
    "   three leading spaces",
    "def main():\n    print('hi')\n\treturn 0",
    "emoji 😀👍🏽 ok",
    "中文 你好 世界",
    "the quick brown fox\n\njumps over",
    "",
    "  ",
]
MESSAGES = [
    {"role": "user", "content": "Hi there "},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {arch: write_tiny_gguf(root / arch / f"{arch}.gguf", arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def hf_models(files: dict[str, Path]) -> dict:
    from transformers import AutoModelForCausalLM

    return {
        arch: AutoModelForCausalLM.from_pretrained(
            str(f.parent), gguf_file=f.name, dtype=torch.float32, **HF_OVERRIDES.get(arch, {})
        ).eval()
        for arch, f in files.items()
    }


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    cache = model.new_cache(len(prompt) + n + 1)
    logits = model(torch.tensor([prompt]), 0, cache)[0, -1]
    out = []
    for _ in range(n):
        out.append(int(logits.float().argmax()))
        logits = model(torch.tensor([[out[-1]]]), cache.length, cache)[0, -1]
    return out


def _hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and, per step, the gap between its top two logits."""
    x = torch.tensor([prompt])
    out = hf.generate(
        x,
        attention_mask=torch.ones_like(x),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    gaps = [float(step[0].topk(2).values[0] - step[0].topk(2).values[1]) for step in out.logits]
    return out.sequences[0, len(prompt) :].tolist(), gaps


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_logits_and_greedy_tokens_equal_transformers(arch, files, hf_models):
    ours = load_model(files[arch], "float32")
    assert ours.config.architecture == arch
    ids = _ids(24, 1)  # longer than the Gemma models' window of 8
    with torch.inference_mode():
        theirs = hf_models[arch](ids).logits
        mine = ours.model(ids)
        cached = ours.model(ids, 0, ours.model.new_cache(32))
    assert (mine - theirs).abs().max() < F32_BOUND * theirs.abs().max()
    assert (cached - theirs).abs().max() < F32_BOUND * theirs.abs().max()
    for prompt in (_ids(5, 2)[0].tolist(), _ids(13, 3)[0].tolist()):
        with torch.inference_mode():
            assert _greedy(ours.model, prompt, 16) == _hf_greedy(hf_models[arch], prompt, 16)[0]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_on_every_kernel_within_the_bound(arch, kernel, files, hf_models):
    with kernels.selected(kernel):
        model = load_model(files[arch], "bfloat16").model
    ids = _ids(24, 1)
    with torch.inference_mode():
        theirs = hf_models[arch](ids).logits[0]
        mine = model(ids, 0, model.new_cache(32))[0].float()
        bound = BF16_BOUND * float(theirs.abs().max())
        assert (mine - theirs).abs().max() < bound
        top = theirs.topk(2, dim=-1).values
        decided = top[:, 0] - top[:, 1] > 2 * bound
        assert torch.equal(mine.argmax(-1)[decided], theirs.argmax(-1)[decided])
        # Greedy decoding: the same tokens up to the first step transformers decides by less than the bound.
        prompt = _ids(12, 4)[0].tolist()
        expected, gaps = _hf_greedy(hf_models[arch], prompt, 16)
        for got, want, gap in zip(_greedy(model, prompt, 16), expected, gaps, strict=True):
            if got != want:
                assert gap < 2 * bound, (got, want, gap)
                break


@pytest.mark.parametrize("kernel", kernels.available())
@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "phi3"])
def test_rows_stay_independent_on_the_kernels(arch, kernel, files):
    # Batched == alone and chunked prefill == whole, bit for bit, past the sliding window too (Gemma 3's per-op
    # steps between the kernel's products, and its windowed attention on views of the cache).
    with kernels.selected(kernel):
        model = load_model(files[arch], "bfloat16").model
    if not kernels.attention_fits(model.kernel, model.config.head_dim, model.dtype, model.device):
        # amx's attention takes head sizes of 64s (these have 32): SDPA runs it, and the model says its rows are
        # not independent, so the engine keeps its promises there as on torch's path (padding, no batching).
        assert not model.rows_independent() and model._stack is None
        return
    assert model.rows_independent()
    prompts = [_ids(n, n)[0] for n in (5, 12, 20)]
    with torch.inference_mode():
        caches = [model.new_cache(64) for _ in prompts]
        batched = model.hidden_batch([(p, 0, c) for p, c in zip(prompts, caches, strict=True)])
        for p, b in zip(prompts, batched, strict=True):
            assert torch.equal(model.hidden(p[None], 0, model.new_cache(64))[0], b)
        whole = model.hidden(prompts[2][None], 0, model.new_cache(64))[0]
        cache = model.new_cache(64)
        first = model.hidden(prompts[2][None, :7], 0, cache)[0]
        rest = model.hidden(prompts[2][None, 7:], 7, cache)[0]
        assert torch.equal(torch.cat([first, rest]), whole)


@pytest.mark.parametrize("kernel", kernels.available())
@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "phi3"])
def test_the_layer_stack_runs_their_blocks_with_the_layer_by_layer_bits(arch, kernel, files):
    # q/k norms, sandwich norms, GeGLU, sliding windows with a local RoPE in one kernel call: the hidden states and
    # the cache of the layer-by-layer path, bit for bit, for a prompt that crosses the window of 8 and a step past it.
    with kernels.selected(kernel):
        model = load_model(files[arch], "bfloat16").model
    if not kernels.attention_fits(model.kernel, model.config.head_dim, model.dtype, model.device):
        assert model._stack is None  # no layer stack where the kernel's attention does not run (amx: 64s)
        return
    assert model._stack is not None and model._stack.n_layers == len(model.layers)
    stack, ids = model._stack, _ids(13, 5)
    runs = []
    with torch.inference_mode():
        for fused in (stack, None):
            model._stack = fused
            cache = model.new_cache(32)
            try:
                runs.append([model.hidden(ids, 0, cache), model.hidden(ids[:, :1], 13, cache), cache.k, cache.v])
                runs[-1].append(model.hidden(ids[:, :3], 14, cache))  # three rows past the window
            finally:
                model._stack = stack
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_a_block_the_kernel_cannot_run_says_so(files, caplog):
    # Gemma 2's soft-capped attention is not in the kernel's: per op in torch, said once at load, and no batching.
    with kernels.selected(kernels.available()[0]), caplog.at_level(logging.INFO, logger="app.engine.model.transformer"):
        model = load_model(files["gemma2"], "bfloat16").model
    assert not model.rows_independent()
    assert any("soft-capping" in r.message and "rows are not independent" in r.message for r in caplog.records)
    assert any("the C layer stack does not run attention soft-capping" in r.message for r in caplog.records)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_and_chat_template_equal_transformers(arch, files):
    from transformers import AutoTokenizer

    f = files[arch]
    ckpt = read_checkpoint(f)
    ours = Tokenizer.from_metadata(ckpt.tokenizer_meta, ckpt.config.eos_token_ids)
    theirs = AutoTokenizer.from_pretrained(str(f.parent), gguf_file=f.name)
    for text in TEXTS:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, bos=False) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    rendered = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(MESSAGES) == rendered
    assert ours.add_bos == bool(ckpt.tokenizer_meta["add_bos_token"])


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_directory_of_the_same_weights_loads_the_same(arch, files, hf_models, tmp_path):
    # transformers writes its model (config.json + safetensors, tokenizer.json): our HF reader gives its logits.
    from transformers import AutoTokenizer

    hf = hf_models[arch]
    config = hf.config.__class__.from_dict({k: v for k, v in hf.config.to_dict().items() if k != "quantization_config"})
    plain = type(hf)(config)  # the same weights without the GGUF quantizer, which cannot be saved
    plain.load_state_dict(hf.state_dict())
    plain.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(str(files[arch].parent), gguf_file=files[arch].name).save_pretrained(tmp_path)
    ours = load_model(tmp_path, "float32")
    ids = _ids(20, 5)
    with torch.inference_mode():
        theirs = hf_models[arch](ids).logits
        assert (ours.model(ids) - theirs).abs().max() < F32_BOUND * theirs.abs().max()
    assert ours.tokenizer.encode(TEXTS[3], bos=False) == read_tokenizer(files[arch]).encode(TEXTS[3], bos=False)


def read_tokenizer(path: Path) -> Tokenizer:
    ckpt = read_checkpoint(path)
    return Tokenizer.from_metadata(ckpt.tokenizer_meta, ckpt.config.eos_token_ids)


def test_an_unsupported_architecture_names_the_supported_ones(tmp_path):
    import gguf

    path = tmp_path / "x.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(WeightsError) as exc:
        read_checkpoint(path)
    message = str(exc.value)
    assert "'mamba' is not supported" in message and "'gemma3'" in message and "'qwen3'" in message
    assert "\n" not in message
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(WeightsError, match=r"model_type 'mamba' is not supported \(supported: .*'gemma3_text'"):
        read_checkpoint(tmp_path / "hf")


def test_a_draft_with_another_tokenizer_is_refused_saying_what_differs(files):
    from app.engine.drafting.base import DraftError
    from app.engine.drafting.model import ModelDrafter

    gemma, phi = load_model(files["gemma3"], "float32"), load_model(files["phi3"], "float32")
    with pytest.raises(DraftError) as exc:
        ModelDrafter("phi", phi, gemma)
    message = str(exc.value)
    assert "does not share the target's vocabulary" in message and "tokens;" in message and "\n" not in message
    ModelDrafter("self", gemma, gemma)  # the same tokenizer is accepted


# --- the architectures without a tiny GGUF above: transformers' own class, its weights written as a checkpoint ----

# The Llama-block architectures: transformers' class built from a tiny config with random weights, saved as an HF
# directory; `smollm`, which only a GGUF names (its HF checkpoints say `llama`), as a GGUF of a Llama's weights laid
# out as llama.cpp's converter lays out the Llama family's (q/k rows permuted), transformers' Llama the oracle.
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # Mistral 7B v0.1's kind of config: every layer slides, its window shorter than the 24 ids compared below.
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
}
GGUF_AS_LLAMA = ("smollm",)
OTHERS = [*HF_CLASSES, *GGUF_AS_LLAMA]


def test_every_registered_architecture_has_a_tiny_model_test():
    # An architecture added to REGISTRY fails here until it has a tiny model of its own above (TINY) or here.
    assert sorted(REGISTRY) == sorted([*TINY, *OTHERS])


def _tiny_transformers_model(arch: str, seed: int, **overrides):
    """transformers' model of `arch` with random weights: a tiny config of its own class (HF_CLASSES, `overrides`
    on top), or for a GGUF-only name the Llama of the shape `tests.test_weights._write_gguf` writes."""
    import transformers

    from tests.test_weights import VOCAB, _gguf_source_model, _randomize

    if arch not in HF_CLASSES:
        return _gguf_source_model("llama", tied=False, seed=seed)
    config_class, model_class, extra = HF_CLASSES[arch]
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        **{**extra, **overrides},
    )
    return _randomize(getattr(transformers, model_class)(config), seed)


@pytest.mark.parametrize("arch", OTHERS)
def test_the_other_architectures_equal_transformers_float32(arch, tmp_path, word_tokenizer):
    from gguf import GGMLQuantizationType

    from tests.test_weights import VOCAB, _save_hf, _write_gguf

    hf = _tiny_transformers_model(arch, seed=OTHERS.index(arch))
    if arch in HF_CLASSES:
        ours = load_model(_save_hf(hf, tmp_path, word_tokenizer), "float32")
    else:
        path = tmp_path / f"{arch}.gguf"
        written = _write_gguf(path, arch, hf.state_dict(), GGMLQuantizationType.F32, tied=False)
        assert all(torch.equal(written[name], t) for name, t in hf.state_dict().items() if name in written)
        ours = load_model(path, "float32")
    assert ours.config.architecture == arch
    assert ours.config.qkv_bias == (arch == "qwen2")
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        theirs = hf(ids).logits
        mine = ours.model(ids)
        cached = ours.model(ids, 0, ours.model.new_cache(32))
    assert (mine - theirs).abs().max() < F32_BOUND * theirs.abs().max()
    assert (cached - theirs).abs().max() < F32_BOUND * theirs.abs().max()
    prompt = ids[0, :9].tolist()
    with torch.inference_mode():
        assert _greedy(ours.model, prompt, 12) == _hf_greedy(hf, prompt, 12)[0]


@pytest.mark.parametrize(("extra", "unread"), [({"attention_bias": True}, "o_proj.bias"), ({"mlp_bias": True}, "mlp")])
def test_an_hf_tensor_the_decoder_would_leave_out_is_refused(extra, unread, tmp_path, word_tokenizer):
    """A Llama whose config gives the attention's output (`attention_bias` biases o_proj too) or the MLP biases: the
    decoder has none there, so loading it would give wrong logits; it is refused naming the tensor."""
    from tests.test_weights import _save_hf

    path = _save_hf(_tiny_transformers_model("llama", 0, **extra), tmp_path, word_tokenizer)
    with pytest.raises(WeightsError, match=rf"does not compute with: .*{unread}"):
        load_model(path, "float32")


# --- the real Gemma 3 270M (Q4_K_M), an optional target: fetched once into the store's cache -------------------

GEMMA = "gemma-3-270m-q4_k_m"


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    # Never fetched by the tests (the Gemma terms are the user's to accept, and it costs two minutes here): run
    # `specserve models fetch gemma-3-270m-q4_k_m` first.
    if store.status(GEMMA) != "ok":
        pytest.skip(f"{GEMMA} is not fetched (specserve models fetch {GEMMA})")
    return store.resolve(GEMMA)


@pytest.fixture(scope="module")
def gemma_f32(gemma_path):
    return load_model(gemma_path, "float32")


@pytest.mark.slow
def test_real_gemma3_greedy_equals_transformers_float32(gemma_path, gemma_f32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.bench.specbench import read_prompts

    hf = AutoModelForCausalLM.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name, dtype=torch.float32)
    tok = gemma_f32.tokenizer
    theirs = AutoTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)
    for text in TEXTS:
        assert tok.encode(text, bos=False) == theirs.encode(text, add_special_tokens=False), text
    # Held out: six of Spec-Bench's categories, their first turns as plain text (the file has no chat template),
    # BOS first as the file's add_bos_token says (transformers' GGUF tokenizer adds it whatever the file says).
    assert tok.add_bos
    equal = 0
    for text in [p.text[:200] for p in read_prompts(BENCH_PROMPTS)][:6]:
        ids = tok.encode(text)
        assert ids == theirs.encode(text)
        with torch.inference_mode():
            mine = _greedy(gemma_f32.model, ids, 12)
            x = torch.tensor([ids])
            out = hf.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12, min_new_tokens=12
            )
        equal += mine == out[0, len(ids) :].tolist()
    assert equal >= 5, f"{equal} of 6 prompts equal"


@pytest.mark.slow
def test_real_gemma3_k_quants_run_on_the_integer_kernels(gemma_path, gemma_f32):
    if kernels.kernel() is None:
        pytest.skip("no CPU kernel")
    native = load_model(gemma_path, "auto", weights="native")
    assert {"Q4_K", "Q6_K"} <= set(native.weights.split("+"))
    assert native.model.rows_independent()
    # Activations quantized to 8 bits in the integer products: the argmax of most positions as in float32.
    ids = torch.tensor([native.tokenizer.encode(read_tokens_text())])
    with torch.inference_mode():
        quantized = native.model(ids, 0, native.model.new_cache(ids.shape[1]))[0].float()
        exact = gemma_f32.model(ids)[0]
    assert (quantized.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.8


def read_tokens_text() -> str:
    from app.bench.specbench import read_prompts

    return read_prompts(BENCH_PROMPTS)[0].text[:400]

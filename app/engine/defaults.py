"""The engine's defaults, in one place.

`app.service.settings.Settings` (and through it the serve flags, which `generate` and `bench` share), `Engine`,
`GenerationParams` and `app.engine.factory.build_engine` all read these, so that a server, a CLI run and an
engine built in code decode alike unless told otherwise (tests that need a deterministic draft length ask for
a fixed one).

This module imports nothing, so that the settings and the command line can read it without loading torch.
"""

from __future__ import annotations

# The longest draft a request or the server may ask for (the API's and the settings' limit on num_draft_tokens);
# every request's KV cache has room for a verification of that many tokens plus one (app.engine.step.SLACK).
MAX_DRAFT_TOKENS = 16
# Tokens drafted per step: the most ever drafted under the adaptive or heuristic schedule.
DEFAULT_NUM_DRAFT_TOKENS = 6
# The most a lookup in text already written (the request's own, its prediction, earlier answers) drafts per step on
# the adaptive schedule, which drafts that far only where the match's measured acceptance pays for the rows.
DEFAULT_LOOKUP_DRAFT_TOKENS = MAX_DRAFT_TOKENS
# The memory the index of earlier answers may hold (app.engine.drafting.suffix_index.TrafficIndex; 0: none kept).
# 64 MiB holds about 250,000 answer tokens: every answer of a busy hour on a 2-core server.
DEFAULT_SUFFIX_INDEX_MB = 64
# How the draft length is chosen per step (app.engine.drafting.draft_length.SCHEDULES): from measured acceptance
# and costs.
DEFAULT_DRAFT_SCHEDULE = "adaptive"
# A model draft stops proposing when its top probability falls below this (0: never).
DEFAULT_DRAFT_P_MIN = 0.05

# Chunked prefill (where rows are independent of the batch): at most this many prompt tokens per step, and chunks
# sized so that a step takes about this long, so running streams never wait long behind a long prompt.
DEFAULT_PREFILL_CHUNK_TOKENS = 512
DEFAULT_PREFILL_STEP_SECONDS = 0.25
# Automatic prefix caching (app.engine.prefix_cache): the most memory its blocks of keys and values may take
# (0: off). 1 GiB holds about 45,000 positions of the 135M target in bfloat16.
DEFAULT_PREFIX_CACHE_MB = 1024
# The share of the prefix cache and of the index of earlier answers that each tenant is owed: a tenant that overflows
# one while holding more than this pays with its own least recently used entries, never another tenant's.
DEFAULT_TENANT_CACHE_SHARE = 0.5

# How sampled tokens are drawn (GenerationParams.sampler): "gumbel", the default, gives target-only sampling's
# tokens for a seed whatever the draft; "rejection" accepts a model draft more often. README, "Sampling".
SAMPLERS = ("gumbel", "rejection")

# The most alternatives a request may ask log-probabilities of, per token (OpenAI's limit on top_logprobs and
# completions' logprobs, vLLM's default max_logprobs); TGI's top_n_tokens is held to it too.
MAX_LOGPROBS = 20

# How a GGUF's quantized matrices are held (app.engine.model.loading.load_model): `native` as the file's blocks,
# computed on by the CPU kernels; `bf16` / `float32` dequantized at load; `auto` the default: native on the avx2,
# avx512 and VNNI kernels, else dequantized (each kernel's `auto_native`, app/engine/kernels/table.py).
WEIGHTS = ("auto", "native", "bf16", "float32")
# How a feature draft's matrices run on the target's CPU kernel (see `app.engine.drafting.eagle.load_draft`).
DRAFT_WEIGHTS = ("auto", "q8_0", "q4_0", "bf16")
DEFAULT_DRAFT_WEIGHTS = "auto"
DRAFT_WEIGHTS_HELP = (
    "a trained feature draft's matrices on the CPU kernels: `q8_0` or `q4_0` blocks on the integer products (half "
    "or a quarter of bf16's bytes per draft token; `q4_0` its output rows too), or `bf16`; `auto` (default): `q8_0` "
    "on a kernel with integer dot products (all but generic), else `bf16`. Elsewhere (torch's path, CUDA) it runs "
    "in the target's dtype. Only the draft's speed and guesses change, never an answer's tokens"
)
WEIGHTS_HELP = (
    "a GGUF's quantized matrices: `native` computed on as the file's blocks by the CPU kernels (8-bit activations "
    "for Q4_0-Q8_0, as llama.cpp; a third of bf16's memory for Q4), `bf16` or `float32` dequantized at load; "
    "`auto` (default): native on the avx2, avx512 and VNNI kernels with dtype auto or bfloat16, else dequantized to "
    "the dtype"
)

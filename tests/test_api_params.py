"""Each request schema builds the engine's record itself (`to_params`): a field crosses from the wire to the engine
in the schema's own method, with each dialect's rules (TGI's sampling rule and penalty scope, OpenAI's default
temperature and seeds, each route's log-probabilities)."""

from __future__ import annotations

import pytest

from app.api.schemas import ChatCompletionRequest, CompletionRequest, GenerateParameters
from app.engine.decoding.penalties import PenaltyParams
from app.engine.step import GenerationParams

MESSAGES = [{"role": "user", "content": "hi"}]


def test_tgi_parameters_build_the_engine_record() -> None:
    p = GenerateParameters.model_validate(
        {
            "top_k": 5,
            "seed": 7,
            "stop": ["\n"],
            "repetition_penalty": 1.2,
            "frequency_penalty": 0.5,
            "top_n_tokens": 3,
            "speculative": {"schedule": "fixed", "p_min": 0.2, "sampler": "rejection", "lookup_draft_tokens": 3},
        }
    )
    params = p.to_params(stream=True)
    assert isinstance(params, GenerationParams)
    # top_k asks for sampling, at temperature 1.0 (TGI's rule)
    assert (params.temperature, params.top_k, params.top_p, params.seed) == (1.0, 5, 1.0, 7)
    assert params.stop == ("\n",)
    # TGI's scope: frequency counts the prompt's tokens too
    assert params.penalties == PenaltyParams(1.2, 0.0, 0.5, count_prompt=True)
    assert (params.logprobs, params.prompt_logprobs) == (3, None)
    assert (params.draft_schedule, params.draft_p_min, params.sampler, params.lookup_draft_tokens) == (
        "fixed",
        0.2,
        "rejection",
        3,
    )
    # Not streamed and without details, no token's log-probability is shown: none is computed.
    assert p.to_params(stream=False).logprobs is None


def test_tgi_greedy_leaves_sampling_neutral() -> None:
    params = GenerateParameters.model_validate({"temperature": 0, "top_k": 5, "seed": 7}).to_params(stream=False)
    assert (params.temperature, params.top_k, params.top_p, params.seed) == (0.0, 0, 1.0, None)
    assert params.sampler == "gumbel"
    details = GenerateParameters.model_validate({"details": True, "decoder_input_details": True})
    assert (details.to_params(stream=False).logprobs, details.to_params(stream=False).prompt_logprobs) == (0, 0)


def test_openai_requests_build_the_engine_record() -> None:
    body = CompletionRequest.model_validate(
        {
            "prompt": "x",
            "seed": -1,
            "top_p": 0.5,
            "presence_penalty": 1.0,
            "min_tokens": 2,
            "stop_token_ids": [3],
            "ignore_eos": True,
            "echo": True,
            "logprobs": 2,
            "prompt_logprobs": 4,
        }
    )
    params = body.to_params(default_temperature=0.7)
    # The server's temperature when the request sends none; a negative seed as two's complement.
    assert (params.temperature, params.top_k, params.top_p, params.seed) == (0.7, 0, 0.5, 2**64 - 1)
    # vLLM's scopes: presence and frequency over generated tokens only
    assert params.penalties == PenaltyParams(1.0, 1.0, 0.0)
    assert (params.min_tokens, params.stop_token_ids, params.ignore_eos) == (2, (3,), True)
    # echo with logprobs and prompt_logprobs: the prompt's with the most alternatives either asks
    assert (params.logprobs, params.prompt_logprobs) == (2, 4)
    assert body.max_new_tokens() == (None, "max_tokens") and body.default_max_tokens == 16
    # Greedy at the server's default 0: the sampling fields are neutral.
    assert body.to_params(default_temperature=0.0).seed is None
    with pytest.raises(ValueError, match="samples need sampling"):
        CompletionRequest.model_validate({"prompt": "x", "n": 2}).to_params(default_temperature=0.0)


def test_chat_requests_build_the_engine_record() -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2, "max_tokens": 5, "max_completion_tokens": 9}
    )
    params = body.to_params(default_temperature=1.0)
    assert (params.logprobs, params.prompt_logprobs) == (2, None)
    # the new name wins over the deprecated one, and messages name it
    assert body.max_new_tokens() == (9, "max_completion_tokens") and body.default_max_tokens is None
    provenance = ChatCompletionRequest.model_validate({"messages": MESSAGES, "provenance": True, "stream": True})
    # provenance reports each token's log-probability: computed, without alternatives
    assert provenance.to_params(default_temperature=1.0).logprobs == 0

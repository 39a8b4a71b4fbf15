"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``.

lm-eval's ``local-completions`` (and other vLLM clients) probe ``/tokenizer_info`` and then tokenize and
detokenize through the server, so that a loglikelihood task needs no tokenizer of its own (no hub download):
the tokens are the served target's own. The shapes are vLLM's.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from app.api import admission
from app.api.deps import get_runtime
from app.api.errors import APIError
from app.api.openai import check_model
from app.api.schemas import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, TokenizerInfo
from app.engine.model.tokenizer import Tokenizer, TokenizerError
from app.service.runtime import Runtime

router = APIRouter(tags=["tokenizer (vLLM-compatible)"])
Runtime_ = Annotated[Runtime, Depends(get_runtime)]


@router.post("/tokenize", response_model=TokenizeResponse, summary="Tokenize a prompt or a conversation (vLLM)")
async def tokenize(body: TokenizeRequest, runtime: Runtime_) -> TokenizeResponse:
    """The served target's token ids of `prompt` (or of `messages` as the chat route renders them)."""
    check_model(body.model, runtime)
    tokenizer = runtime.tokenizer
    if body.messages is not None:
        turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        # As the chat route encodes them: special tokens' strings in the messages are text (Tokenizer.encode_chat).
        try:
            ids = await admission.run(
                tokenizer.encode_chat, turns, body.add_generation_prompt, None, bool(body.add_special_tokens)
            )
        except TokenizerError as exc:
            raise APIError("validation", f"messages: {exc}") from exc
    else:
        assert body.prompt is not None
        # A long prompt: in the bounded pool, as /v1/completions'. Without special tokens, no BOS but one the text
        # wrote.
        ids = await admission.run(tokenizer.encode, body.prompt, body.add_special_tokens is not False)
    # A decode per token, as many as the prompt has: in the pool too, not on the event loop.
    strs = await admission.run(_token_strs, tokenizer, ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=runtime.info.context_length, tokens=ids, token_strs=strs)


def _token_strs(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text, special tokens shown."""
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def _bos(runtime: Runtime) -> str | None:
    """The text of the model's BOS token, if it has one."""
    bos = runtime.tokenizer.bos_token_id
    return runtime.tokenizer.decode([bos], skip_special_tokens=False) if bos is not None else None


@router.post("/detokenize", response_model=DetokenizeResponse, summary="Text of token ids (vLLM)")
async def detokenize(body: DetokenizeRequest, runtime: Runtime_) -> DetokenizeResponse:
    """The text of `tokens`, as the served target's tokenizer decodes them."""
    check_model(body.model, runtime)
    vocab = runtime.info.vocab_size
    if any(t >= vocab for t in body.tokens):
        raise APIError("validation", f"tokens: token ids must lie in [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=runtime.tokenizer.decode(body.tokens, skip_special_tokens=False))


@router.get("/tokenizer_info", response_model=TokenizerInfo, summary="The tokenizer's configuration (vLLM)")
async def tokenizer_info(runtime: Runtime_) -> TokenizerInfo:
    """The served tokenizer's special tokens and chat template, as vLLM's /tokenizer_info gives them."""
    tokenizer = runtime.tokenizer
    return TokenizerInfo(
        bos_token=_bos(runtime),
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.eos_token,  # the model has none; clients that pad use the end-of-sequence token, as HF's
        add_bos_token=tokenizer.add_bos,
        chat_template=tokenizer.chat_template,
        model_max_length=runtime.info.context_length,
        vocab_size=runtime.info.vocab_size,
    )

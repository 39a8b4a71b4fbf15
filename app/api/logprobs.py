"""Log-probabilities as each API writes them: OpenAI's completions (legacy) and chat formats, vLLM's
`prompt_logprobs`, TGI's tokens. The engine gives, per token, its log-probability, rank and most likely
alternatives as token ids (app.engine.decoding.logprobs); this module names the tokens.

A token is named by its own text (``decode([id])`` with special tokens shown), as vLLM does, so that a
chosen token and the same token among the alternatives have the same name; the text a token added to the
answer (in ``TokenOut.text``) may differ: an end-of-sequence token adds none, and a character split across
tokens appears with its last token.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.api.schemas import ChatTokenLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs, Token, TopLogprob
from app.engine.decoding.logprobs import TokenLogprob
from app.engine.model.tokenizer import Tokenizer
from app.service.events import TokenOut


class TokenNames:
    """Names of token ids for one answer (each decoded once); `as_ids`: ``token_id:<id>``, vLLM's
    return_tokens_as_token_ids."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool = False) -> None:
        self._tok = tokenizer
        self._as_ids = as_ids
        self._names: dict[int, str] = {}
        self._special = tokenizer.special_ids | tokenizer.eos_token_ids

    def __call__(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            name = self._names[token_id] = self._name(token_id)
        return name

    def _name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._as_ids else self._tok.decode([token_id], skip_special_tokens=False)

    def special(self, token_id: int) -> bool:
        return token_id in self._special


def _top_dict(names: TokenNames, lp: TokenLogprob, n: int | None = None) -> dict[str, float]:
    """The (first `n`) alternatives and the chosen token, most likely first; two ids of one text keep the
    likelier."""
    top: dict[str, float] = {}
    for token_id, logprob in lp.top[:n]:
        top.setdefault(names(token_id), logprob)
    top.setdefault(names(lp.token_id), lp.logprob)
    return top


def completion_logprobs(
    names: TokenNames,
    tokens: Sequence[TokenOut],
    prompt: Sequence[TokenLogprob | None] | None = None,
    prompt_ids: Sequence[int] = (),
    offset: int = 0,
    n: int | None = None,
) -> CompletionLogprobs:
    """OpenAI's legacy `logprobs` of `tokens` (each with its `logprob`), after the echoed `prompt`'s when given
    (one per prompt token of `prompt_ids`, None for the first). `offset`: where the generated text begins in the
    choice's text (after the echoed prompt); `n`: the alternatives to show of a prompt token (the engine may have
    computed more, for vLLM's prompt_logprobs). A prompt token's offset adds up the names before it (as vLLM's);
    a generated token's, the text the tokens before it added."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    if prompt is not None:
        at = 0
        for token_id, lp in zip(prompt_ids, prompt, strict=True):
            name = names(token_id)
            out.tokens.append(name)
            out.token_logprobs.append(None if lp is None else lp.logprob)
            out.top_logprobs.append(None if lp is None else _top_dict(names, lp, n))
            out.text_offset.append(at)
            at += len(name)
    for tok in tokens:
        assert tok.logprob is not None
        out.tokens.append(names(tok.id))
        out.token_logprobs.append(tok.logprob.logprob)
        out.top_logprobs.append(_top_dict(names, tok.logprob))
        out.text_offset.append(offset)
        offset += len(tok.text)
    return out


def _top(names: TokenNames, token_id: int, logprob: float) -> TopLogprob:
    name = names(token_id)
    return TopLogprob(token=name, logprob=logprob, bytes=list(name.encode("utf-8")))


def chat_logprobs(names: TokenNames, tokens: Sequence[TokenOut]) -> list[ChatTokenLogprob]:
    """OpenAI chat's `logprobs.content` of `tokens` (each with its `logprob`)."""
    out = []
    for tok in tokens:
        lp = tok.logprob
        assert lp is not None
        top = [_top(names, i, v) for i, v in lp.top]
        out.append(ChatTokenLogprob(**_top(names, tok.id, lp.logprob).model_dump(), top_logprobs=top))
    return out


def prompt_logprobs(names: TokenNames, prompt: Sequence[TokenLogprob | None], n: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) its own entry and the `n` most likely
    tokens', by token id; an alternative's rank is its place among them."""
    out: PromptLogprobs = []
    for lp in prompt:
        if lp is None:
            out.append(None)
            continue
        entries = {str(lp.token_id): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=names(lp.token_id))}
        for rank, (token_id, logprob) in enumerate(lp.top[:n], 1):
            entries.setdefault(str(token_id), PromptLogprob(logprob=logprob, rank=rank, decoded_token=names(token_id)))
        out.append(entries)
    return out


def tgi_top_tokens(names: TokenNames, lp: TokenLogprob | None) -> list[Token]:
    """TGI's `top_tokens` of one position: the most likely tokens, each with its own text."""
    if lp is None:
        return []
    return [Token(id=i, text=names(i), logprob=v, special=names.special(i)) for i, v in lp.top]

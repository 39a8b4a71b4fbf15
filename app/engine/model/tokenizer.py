"""Text <-> token ids with the `tokenizers` library, and the model's chat template with jinja2.

A GGUF tokenizer is rebuilt from the file's own metadata (tokens, merges, special tokens, pre-tokenizer
kind), the way llama.cpp reads it: byte-level BPE (`tokenizer.ggml.model` gpt2) or SentencePiece BPE (`llama`:
Gemma, Phi-3, Llama 2; pieces merged best first, unknown characters as their UTF-8 bytes); an HF directory
brings its tokenizer.json.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# Regexes of llama.cpp's pre-tokenizer kinds (`tokenizer.ggml.pre`), for byte-level BPE vocabularies.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Tokens that end a turn in the chat formats we know; generation stops on any of them that is special.
_END_OF_TURN = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|end|>",
    "</s>",
    "<|eom_id|>",
    "<end_of_turn>",
)
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4
_GGUF_MODELS = ("gpt2", "llama")
# SentencePiece's word boundary: a space, as its pieces spell it.
_SPACE = "\u2581"
# Architectures whose SentencePiece vocabulary lists its pieces in merge order (their scores do not follow it).
_PIECES_IN_ORDER = ("gemma", "gemma2", "gemma3")
# What stands in a client's text for a special token's string while the chat template renders it (see
# `Tokenizer.encode_chat`): private-use characters, which templates' filters (trim, tojson) leave alone.
_HIDE_OPEN, _HIDE_CLOSE = "\ue000", "\ue001"


class TokenizerError(ValueError):
    """A tokenizer that cannot be built, or a chat that cannot be rendered."""


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        split = _LLAMA3_SPLIT
    elif pre in ("qwen2", "deepseek-r1-qwen"):
        split = _QWEN2_SPLIT
    elif pre == "smollm":
        # SmolLM's own tokenizer splits every digit before the GPT-2 rules.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        split = _GPT2_SPLIT
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])


def _from_gguf_meta(meta: dict[str, Any]) -> tuple[HFTokenizer, list[str]]:
    if meta.get("model") not in _GGUF_MODELS:
        raise TokenizerError(
            f"GGUF tokenizer model {meta.get('model')!r} is not supported (supported: {', '.join(_GGUF_MODELS)}); "
            "use the model's HF-format directory instead"
        )
    tokens: list[str] = list(meta["tokens"])
    if meta["model"] == "llama":
        tok, tokens = _sentencepiece(meta, tokens)
    else:
        merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
        tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
        tok.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("pre"))
        tok.decoder = decoders.ByteLevel()
    types = list(meta.get("token_type") or [])
    special = [tokens[i] for i, t in enumerate(types) if t == _GGUF_CONTROL]
    # (A user-defined piece the vocabulary spells otherwise, Gemma's runs of spaces, is a piece like any other.)
    vocab = tok.get_vocab()
    user = [tokens[i] for i, t in enumerate(types) if t == _GGUF_USER_DEFINED and tokens[i] in vocab]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok, special


def _sentencepiece(meta: dict[str, Any], tokens: list[str]) -> tuple[HFTokenizer, list[str]]:
    """SentencePiece BPE from a GGUF's pieces: spaces are U+2581, two pieces merge into the piece they spell when it
    is in the vocabulary, the best such piece first (by score; by its place in the file where the architecture's
    scores do not follow the merge order), and a character no piece covers becomes its UTF-8 bytes' <0xXX>
    pieces. A space is prefixed to the text after a special token and at the start where the file says
    `add_space_prefix` (llama.cpp's default for these vocabularies), as llama.cpp does."""
    in_order = meta.get("architecture") in _PIECES_IN_ORDER
    if in_order:
        # Gemma files spell its pieces of two or more spaces with spaces, not U+2581.
        tokens = [_SPACE * len(t) if len(t) > 1 and not t.strip(" ") else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = list(meta.get("scores") or [])
    if in_order or len(scores) != len(tokens):
        priority = {t: -float(i) for i, t in enumerate(tokens)}
    else:
        priority = {t: float(x) for t, x in zip(tokens, scores, strict=True)}
    unk_id = meta.get("unk_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    model = models.BPE(
        vocab=vocab, merges=_piece_merges(vocab, priority), unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    tok = HFTokenizer(model)
    prefix = meta.get("add_space_prefix")
    prefix = (not in_order) if prefix is None else bool(prefix)
    replace = normalizers.Replace(" ", _SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tok, tokens


def _piece_merges(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a piece into two pieces, best piece first,
    then the longer left part, the longer right part; ties in the order the pieces come, then by the parts' ids."""
    found: list[tuple[float, int, int, int, int, int, str, str]] = []
    for rank, (piece, score) in enumerate(priority.items()):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-score, -len(left), -len(right), rank, vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None) -> str:
    # transformers' tojson (templates render tools with it): plain JSON, keys in their order, not jinja2's
    # HTML-escaped, key-sorted one.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators)


def _raise(message: str) -> None:
    raise TokenizerError(message)


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """`value` (JSON-like: mappings, lists, strings, scalars) with `fn` applied to every string in it, keys too."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {fn(k) if isinstance(k, str) else k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, fn) for v in value]
    return value


class Tokenizer:
    """Encoding, decoding and chat formatting for one model."""

    def __init__(
        self,
        backend: HFTokenizer,
        special_tokens: Sequence[str],
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool = False,
        eos_token: str | None = None,
    ) -> None:
        self.backend = backend
        # What chat templates call eos_token: the model's own (as transformers passes it), when known.
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.special_ids = frozenset(i for t in special_tokens if (i := backend.token_to_id(t)) is not None)
        texts = sorted({t for t in special_tokens if backend.token_to_id(t) is not None}, key=len, reverse=True)
        # Longest first, so that a token whose text begins with another's is found whole.
        self._special_text = re.compile("|".join(map(re.escape, texts))) if texts else None
        ends = {i for t in _END_OF_TURN if (i := backend.token_to_id(t)) is not None and i in self.special_ids}
        self.eos_token_ids: frozenset[int] = frozenset(ends | set(eos_token_ids))
        self._template = None
        self.takes_tools = False
        if chat_template:
            # As transformers renders templates, so that both give the same prompt text.
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = _tojson
            self._template = env.from_string(chat_template)
            # Whether the template renders the functions a model may call itself (Qwen2.5's does; SmolLM2's not).
            self.takes_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(chat_template))

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Build from a checkpoint's tokenizer metadata (see `weights.Checkpoint.tokenizer_meta`)."""
        if meta.get("format") == "gguf":
            backend, special = _from_gguf_meta(meta)
            bos = meta.get("bos_token_id")
            # Whether a prompt starts with BOS is the file's own `tokenizer.ggml.add_bos_token`, as llama.cpp
            # reads it (Llama 3's files say yes, the default SmolLM2's no); a file that does not say gets none.
            add_bos = bool(meta.get("add_bos_token", False))
            eos, tokens = meta.get("eos_token_id"), meta["tokens"]
            eos_token = tokens[eos] if eos is not None and 0 <= eos < len(tokens) else None
            return cls(
                backend, special, meta.get("chat_template"), bos, eos_token_ids, add_bos=add_bos, eos_token=eos_token
            )
        path = Path(meta["path"])
        tj = path / "tokenizer.json"
        if not tj.exists():
            raise TokenizerError(f"{path}: no tokenizer.json")
        backend = HFTokenizer.from_file(str(tj))
        cfg = meta.get("config") or {}
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # several named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        special = [t.content for t in backend.get_added_tokens_decoder().values() if t.special]
        bos_tok = cfg.get("bos_token")
        bos_tok = bos_tok.get("content") if isinstance(bos_tok, dict) else bos_tok
        bos = backend.token_to_id(bos_tok) if bos_tok else None
        # HF's own processor config decides BOS; disable it so encode() alone never double-adds.
        backend.post_processor = None
        eos_tok = cfg.get("eos_token")
        eos_tok = eos_tok.get("content") if isinstance(eos_tok, dict) else eos_tok
        add_bos = bool(cfg.get("add_bos_token", False))
        return cls(backend, special, template, bos, eos_token_ids, add_bos=add_bos, eos_token=eos_tok)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it (as a chat template writes them) are parsed. BOS comes
        first where the model's tokenizer adds it (`add_bos`) and `bos` asks for it, unless the text begins with it
        already (False: text that continues a sequence, such as a predicted answer)."""
        # encode_batch, not encode: the same ids, but it lets go of the GIL while it works, where encode holds
        # it throughout (0.5 s for a megabyte of prompt, during which no other thread, the worker stepping the
        # running generations included, runs a line of Python).
        return self._with_bos(self.backend.encode_batch([text], add_special_tokens=False)[0].ids, bos)

    def _with_bos(self, ids: list[int], bos: bool) -> list[int]:
        """`ids` with BOS first where the model's tokenizer adds it and `bos` asks for it, unless they begin with it."""
        if bos and self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; undecodable bytes become U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @cached_property
    def _plain(self) -> HFTokenizer:
        """A copy of the backend that reads special tokens' strings as ordinary text (its own copy: the switch is
        the whole tokenizer's, and the backend is shared by threads that do want them parsed)."""
        plain = HFTokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        bos: bool = True,
    ) -> list[int]:
        """Token ids of a conversation rendered with the chat template (see `apply_chat_template`), where only
        the template's own markers are special tokens: a special token's string in a message, a tool call or a
        tool's schema is encoded as the ordinary text it spells. BOS as `encode` adds it.

        Encoding the rendered text whole would parse `<|im_end|>\\n<|im_start|>system` typed by a client as the
        end of its turn and the start of a system turn. So every such string in the client's values is swapped for
        a placeholder that no client can guess before the template renders them; the special tokens left in the
        rendered text are the template's, and the text between them, placeholders put back, is encoded with no
        special tokens at all. A conversation without such strings is encoded whole, exactly as before."""
        found: list[str] = []
        nonce = secrets.token_hex(8)
        pattern = self._special_text

        def hide(text: str) -> str:
            def placeholder(match: re.Match[str]) -> str:
                found.append(match.group(0))
                return f"{_HIDE_OPEN}{nonce}.{len(found) - 1}{_HIDE_CLOSE}"

            return pattern.sub(placeholder, text) if pattern is not None else text

        hidden_messages = _map_strings(list(messages), hide)
        hidden_tools = None if tools is None else _map_strings(list(tools), hide)
        text = self.apply_chat_template(hidden_messages, add_generation_prompt, hidden_tools)
        if not found:
            return self.encode(text, bos)
        hidden = re.compile(f"{_HIDE_OPEN}{nonce}\\.(\\d+){_HIDE_CLOSE}")

        def restore(part: str) -> str:
            return hidden.sub(lambda m: found[int(m.group(1))], part)

        whole = self.backend.encode_batch([text], add_special_tokens=False)[0]
        marks = [(i, span) for i, span in zip(whole.ids, whole.offsets, strict=True) if i in self.special_ids]
        gaps, start = [], 0
        for _, (begin, end) in marks:
            gaps.append(restore(text[start:begin]))
            start = end
        gaps.append(restore(text[start:]))
        encoded = [e.ids for e in self._plain.encode_batch(gaps, add_special_tokens=False)]
        ids: list[int] = list(encoded[0])
        for (token, _), after in zip(marks, encoded[1:], strict=True):
            ids += [token, *after]
        return self._with_bos(ids, bos)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render a conversation (a list of {role, content}, as transformers takes it: an assistant's
        `tool_calls`, a tool's `tool_call_id` too) with the model's own chat template; `tools`, the functions the
        model may call in OpenAI's format, go to a template that renders them (`takes_tools`)."""
        if self._template is None:
            raise TokenizerError("this model has no chat template; send a plain prompt instead")
        bos = self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = next(iter(sorted(self.eos_token_ids)), None)
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=None if tools is None else list(tools),
                bos_token=bos,
                eos_token=self.eos_token or (self.backend.id_to_token(eos) if eos is not None else ""),
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def difference(self, other: Tokenizer) -> str | None:
        """What differs between this tokenizer's vocabulary and `other`'s, in a few words (None: the same ids for the
        same tokens, and the same special tokens): the sizes, then a special token, then the first differing id."""
        mine, theirs = self.backend.get_vocab(), other.backend.get_vocab()
        if mine == theirs and self.special_ids == other.special_ids:
            return None
        head = f"{len(theirs)} vs {len(mine)} tokens"
        names = {i: t for t, i in mine.items()}
        other_names = {i: t for t, i in theirs.items()}
        special = sorted(self.special_ids ^ other.special_ids)
        if special:
            i = special[0]
            return f"{head}; special token {names.get(i, other_names.get(i))!r} (id {i}) is special in only one"
        for i in sorted(set(names) | set(other_names)):
            if names.get(i) != other_names.get(i):
                return f"{head}; id {i} is {other_names.get(i)!r} in one and {names.get(i)!r} in the other"
        return head

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for logs and /info."""
        return {
            "vocab_size": self.vocab_size,
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": sorted(self.eos_token_ids),
            "chat_template": self.chat_template is not None,
        }

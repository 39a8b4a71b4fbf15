"""Incremental detokenization (app/engine/decoding/detokenizer.py): complete characters only, stop strings held
back and never released, the `keep` count of a push.

Most tests use a byte-level toy tokenizer whose token id is the byte value, so that any character can be
split across tokens at will; one test uses the default target's tokenizer.
"""

from __future__ import annotations

import pytest

from app.engine.decoding.detokenizer import Detokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def btok(byte_tokenizer):
    return byte_tokenizer()


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _feed_one_by_one(detok: Detokenizer, ids: list[int]) -> tuple[list[str], list[int]]:
    deltas, keeps = [], []
    for i in ids:
        delta, keep = detok.push([i])
        deltas.append(delta)
        keeps.append(keep)
    return deltas, keeps


@pytest.mark.parametrize("text", ["😀", "a😀b", "中文", "é", "👨‍👩‍👧 ok", "x\u0301🇫🇷y"])
def test_a_character_split_across_tokens_is_never_emitted_broken(btok, text):
    detok = Detokenizer(btok)
    released = ""
    for i in _bytes(text):
        delta, keep = detok.push([i])
        assert REPLACEMENT not in delta
        assert keep == 1
        released += delta
        assert text.startswith(released)
    released += detok.flush()
    assert released == text == detok.text


def test_the_byte_tokens_of_an_emoji_release_nothing_until_the_last(btok):
    detok = Detokenizer(btok)
    deltas, _ = _feed_one_by_one(detok, _bytes("😀"))
    assert deltas == ["", "", "", "😀"]


def test_real_tokenizer_split_characters(target_f32):
    tok = target_f32.tokenizer
    text = "Voilà: 😀👍🏽 中文 and 東京 — ok"
    ids = tok.encode(text)
    # The setup: some token boundary really falls inside a character.
    assert any(REPLACEMENT in tok.decode(ids[:n]) for n in range(1, len(ids)))
    detok = Detokenizer(tok)
    deltas, keeps = _feed_one_by_one(detok, ids)
    assert all(REPLACEMENT not in d for d in deltas) and keeps == [1] * len(ids)
    assert "".join(deltas) + detok.flush() == text == tok.decode(ids)


def test_real_tokenizer_leading_spaces_survive_incremental_decoding(target_f32):
    tok = target_f32.tokenizer
    text = "Hello world, this is  a test.\n  Indented line\tand a tab."
    detok = Detokenizer(tok)
    deltas, _ = _feed_one_by_one(detok, tok.encode(text))
    assert "".join(deltas) + detok.flush() == text


def test_word_tokens_join_like_a_full_decode(word_tokenizer):
    tok = word_tokenizer(10)
    detok = Detokenizer(tok)
    deltas, _ = _feed_one_by_one(detok, [1, 2, 3])
    assert deltas == ["t1", " t2", " t3"]
    assert detok.flush() == "" and detok.text == "t1 t2 t3"


# --- stop strings ---------------------------------------------------------------------------------------------


def test_stop_string_spanning_tokens_is_held_back_and_never_emitted(btok):
    text = "Hello STOP world"
    detok = Detokenizer(btok, stop=["STOP"])
    deltas, keeps = _feed_one_by_one(detok, _bytes(text))
    stop_end = text.index("STOP") + len("STOP")
    # Every token up to and including the one completing the stop is kept; none after it.
    assert keeps == [1] * stop_end + [0] * (len(text) - stop_end)
    released = "".join(deltas) + detok.flush()
    assert released == "Hello " == detok.text
    assert not any(ch in d for d in deltas for ch in "STOP")
    assert detok.stopped_at == len("Hello ")


def test_stop_completed_inside_a_multi_token_push(btok):
    text = "Hello STOP world"
    detok = Detokenizer(btok, stop=["STOP"])
    delta, keep = detok.push(_bytes(text))
    assert (delta, keep) == ("Hello ", text.index("STOP") + len("STOP"))
    assert detok.push(_bytes("more")) == ("", 0)
    assert detok.flush() == "" and detok.text == "Hello "


def test_stop_split_across_two_pushes(btok):
    detok = Detokenizer(btok, stop=["STOP"])
    assert detok.push(_bytes("abc ST")) == ("abc ", 6)  # "ST" could start the stop string: held back
    assert detok.push(_bytes("OP def")) == ("", 2)
    assert detok.text == "abc "


def test_held_back_text_is_released_once_it_cannot_be_a_stop(btok):
    detok = Detokenizer(btok, stop=["STOP"])
    deltas, _ = _feed_one_by_one(detok, _bytes("xx STAR"))
    assert deltas == ["x", "x", " ", "", "", "STA", "R"]
    assert detok.flush() == "" and detok.stopped_at is None


def test_a_stop_prefix_at_the_end_is_released_by_flush(btok):
    detok = Detokenizer(btok, stop=["STOP"])
    deltas, _ = _feed_one_by_one(detok, _bytes("end ST"))
    assert "".join(deltas) == "end "
    assert detok.flush() == "ST" and detok.text == "end ST"


def test_stop_at_the_very_start(btok):
    detok = Detokenizer(btok, stop=["STOP"])
    assert detok.push(_bytes("STOPabc")) == ("", 4)
    assert detok.text == "" and detok.flush() == ""


def test_the_earliest_of_several_stops_wins(btok):
    detok = Detokenizer(btok, stop=["world", "lo w"])
    delta, keep = detok.push(_bytes("hello world!"))
    assert detok.text == "hel" and delta == "hel"
    assert keep == len("hello w")  # the first stop to complete ends it, at "lo w"


def test_a_multibyte_stop_string(btok):
    text = "hi 😀 there"
    detok = Detokenizer(btok, stop=["😀"])
    deltas, keeps = _feed_one_by_one(detok, _bytes(text))
    assert "".join(deltas) + detok.flush() == "hi "
    assert sum(keeps) == len(_bytes("hi 😀"))


def test_empty_stop_strings_are_ignored(btok):
    detok = Detokenizer(btok, stop=[""])
    assert detok.push(_bytes("abc")) == ("abc", 3)
    assert detok.stopped_at is None


def test_flush_releases_a_trailing_incomplete_character(btok):
    detok = Detokenizer(btok)
    deltas, _ = _feed_one_by_one(detok, [*_bytes("ok "), *_bytes("😀")[:2]])
    assert "".join(deltas) == "ok "
    tail = detok.flush()
    assert REPLACEMENT in tail


def test_include_stop_keeps_the_stop_string_and_nothing_after(btok):
    detok = Detokenizer(btok, stop=["END"], include_stop=True)
    released, keep = detok.push(_bytes("one END two"))
    assert keep == len("one END")
    assert released + detok.flush() == detok.text == "one END"


def test_stop_strings_count_only_past_the_armed_tokens(btok):
    """min_tokens: a stop string that ends within the first `armed` ids ends nothing, now or later; one that
    ends after them does, even when it began before."""
    detok = Detokenizer(btok, stop=["ab"])
    released, keep = detok.push(_bytes("xab"), armed=3)
    assert keep == 3 and detok.stopped_at is None
    more, keep = detok.push(_bytes("cab"))
    assert keep == 3 and released + more + detok.flush() == detok.text == "xabc"
    straddling = Detokenizer(btok, stop=["ab"])
    released, keep = straddling.push(_bytes("xab"), armed=2)  # "a" is armed-out, "b" completes it after
    assert keep == 3 and straddling.text == "x"


def test_special_tokens_keep_their_text_unless_skipped(btok):
    special = btok.encode("<|im_end|>")
    assert len(special) == 1
    for skip, expected in ((True, "hi"), (False, "hi<|im_end|>")):
        detok = Detokenizer(btok, skip_special=skip)
        released, _ = detok.push([*_bytes("hi"), *special])
        assert released + detok.flush() == expected

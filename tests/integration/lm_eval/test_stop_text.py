"""The stop-string shortcuts decide exactly what the full checks decide.

* ``UntilMatcher`` (lm-eval's rule) with its ``StopTextFilter`` against the same matcher without
  it: the first step that matches is the same, over random token streams on four kinds of
  tokenizer (character, byte-level BPE with multi-byte text, metaspace BPE, WordPiece).
* ``StopStrings`` (HF ``stop_strings``) with its final-token table against transformers'
  ``StopStringCriteria`` alone, at every step.
"""

from __future__ import annotations

import random

import pytest
import torch

from hf_paged.engine.stop_strings import StopStrings
from hf_paged.integration.lm_eval.stop_text import StopTextFilter, UntilMatcher, until_matcher
from hf_paged.testing import build_char_tokenizer

CORPUS = [
    "the cat sat on the mat.\n\nQ: what is it? A: a cat's mat, isn't it!",
    "Ünïcödé wörds — “quotes” and ‘more’ … 日本語のテキスト 🙂🙃 ok\n",
    "a=b; c+d, (e) [f] {g} <h> #tag @x 100% $5 ~y ^z |w \\ /q\ttab\n",
    "Answer: yes\nAnswer: no\n\n###\nEND</s>",
] * 3


def _trained(model, trainer, pre, decoder, normalizer=None):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoder
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="[UNK]")


def _byte_bpe():
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet,
                                  special_tokens=["</s>", "[UNK]"])  # fmt: skip
    return _trained(models.BPE(), trainer, pre_tokenizers.ByteLevel(add_prefix_space=False),
                    decoders.ByteLevel())  # fmt: skip


def _metaspace_bpe():
    from tokenizers import decoders, models, pre_tokenizers, trainers

    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>", "[UNK]"])
    return _trained(models.BPE(unk_token="[UNK]"), trainer, pre_tokenizers.Metaspace(),
                    decoders.Metaspace())  # fmt: skip


def _wordpiece():
    from tokenizers import decoders, models, pre_tokenizers, trainers

    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["</s>", "[UNK]"])
    return _trained(models.WordPiece(unk_token="[UNK]"), trainer,
                    pre_tokenizers.Whitespace(), decoders.WordPiece())  # fmt: skip


TOKENIZERS = {
    "char": lambda: build_char_tokenizer(vocab_size=160),
    "byte_bpe": _byte_bpe,
    "metaspace_bpe": _metaspace_bpe,
    "wordpiece": _wordpiece,
}


def _stop_sets(tok, rng, n):
    """Stop strings: substrings of decoded text (so they occur), lm-eval's usual ones and the
    EOS text; some end in whitespace (the filter must then check every token)."""
    texts = [tok.decode(tok.encode(t, add_special_tokens=False)) for t in CORPUS[:4]]
    fixed = ["\n\n", "</s>", "Answer:", "Answer: ", " ", "? ", ".", "ok\n", "🙃", "###", "t "]
    out = []
    for _ in range(n):
        stops = set(rng.sample(fixed, 2))
        for _ in range(rng.randint(0, 2)):
            t = rng.choice(texts)
            a = rng.randrange(len(t))
            stops.add(t[a : a + rng.randint(1, 4)])
        out.append(tuple(sorted(s for s in stops if s)))
    return out


def _stream(tok, rng, stops, length):
    """A token stream mixing random ids with the encodings of the stop strings and corpus bits."""
    pieces = [tok.encode(s, add_special_tokens=False) for s in stops]
    pieces += [tok.encode(t[i : i + 6], add_special_tokens=False)
               for t in CORPUS[:4] for i in range(0, len(t), 7)]  # fmt: skip
    ids: list[int] = []
    while len(ids) < length:
        if rng.random() < 0.5:
            ids.append(rng.randrange(len(tok)))
        else:
            ids.extend(rng.choice(pieces))
    return ids[:length]


def _first_match(matcher, ids, prompt_len):
    for end in range(prompt_len + 1, len(ids) + 1):
        if matcher.matches(ids, end):
            return end
    return None


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_until_filter_finds_the_same_first_stop(name):
    tok = TOKENIZERS[name]()
    rng = random.Random(name)
    num_skipped = num_steps = 0
    for stops in _stop_sets(tok, rng, 12):
        text_filter = StopTextFilter(tok, stops)
        lookback = {s: len(tok.encode(s, add_special_tokens=False)) + 2 for s in stops}
        for _ in range(15):
            prompt_len = rng.randint(1, 6)
            ids = _stream(tok, rng, stops, prompt_len + 40)
            plain = UntilMatcher(tok, lookback, prompt_len)
            fast = UntilMatcher(tok, lookback, prompt_len, text_filter)
            want = _first_match(plain, ids, prompt_len)
            assert _first_match(fast, ids, prompt_len) == want, (stops, ids, prompt_len)
            last = want or len(ids)
            num_steps += last - prompt_len
            num_skipped += sum(not text_filter.may_end(t) for t in ids[prompt_len:last])
    assert num_steps > 1000
    if name == "char":  # the shortcut must actually skip work where it is decidable
        assert num_skipped > num_steps // 4


def test_until_filter_checks_every_token_when_undecidable():
    tok = TOKENIZERS["byte_bpe"]()
    f = StopTextFilter(tok, ("\ufffd", "x"))  # U+FFFD also stands for broken UTF-8
    assert f.always and all(f.may_end(i) for i in range(len(tok)))
    f = StopTextFilter(tok, ("x",))
    partial = [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]
    assert partial and all(f.may_end(i) for i in partial)  # a byte of a multi-byte character


def test_until_filter_skips_fillers_for_the_eos_text():
    """The bench's case: a char tokenizer padded with ``<xN>`` fillers and until = (\\n\\n, </s>):
    fillers end in '>' but cannot end '</s>'; the EOS token and '>' itself can."""
    tok = build_char_tokenizer(vocab_size=300)
    f = StopTextFilter(tok, ("\n\n", "</s>"))
    filler = tok.convert_tokens_to_ids("<x7>")
    assert not f.may_end(filler) and not f.may_end(tok.convert_tokens_to_ids("a"))
    assert f.may_end(tok.eos_token_id) and f.may_end(tok.convert_tokens_to_ids(">"))


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_stop_strings_table_is_the_criterion(name):
    tok = TOKENIZERS[name]()
    rng = random.Random(f"hf-{name}")
    for stops in _stop_sets(tok, rng, 6):
        try:
            fast = StopStrings.build(tok, stops)
        except ValueError:  # transformers refuses strings no token can end; nothing to compare
            continue
        assert fast._can_end is not None
        for _ in range(10):
            ids = _stream(tok, rng, stops, 30)
            for end in range(1, len(ids) + 1):
                tail = torch.tensor([ids[max(0, end - fast.window) : end]])
                want = bool(fast.criterion(tail, None)[0])
                assert fast.matches(ids, end) == want, (stops, ids[:end])


def test_until_filter_sees_a_character_split_over_byte_tokens():
    """'€' is three bytes; each byte token alone decodes to U+FFFD, so none may be skipped."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = TOKENIZERS["byte_bpe"]()
    chars = bytes_to_unicode()
    euro = [tok.convert_tokens_to_ids(chars[b]) for b in "€".encode()]
    prompt = tok.encode("Q", add_special_tokens=False)
    ids = prompt + tok.encode("ab", add_special_tokens=False) + euro
    stops = ("€",)
    f = StopTextFilter(tok, stops)
    m = UntilMatcher(tok, {"€": 5}, len(prompt), f)
    assert _first_match(m, ids, len(prompt)) == len(ids)


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_filled_filter_answers_as_the_lazy_one_and_is_shared(name):
    """``until_matcher``'s filter has learnt the whole vocabulary up front (same answers as
    learning token by token), and the next row with that tokenizer and stop strings shares it
    (and its windows: lm-eval's ``len(encode(s)) + 2``)."""
    tok = TOKENIZERS[name]()
    stops = ("\n\n", "ab", " ")
    first = until_matcher(tok, stops, prompt_len=3)
    filled, lazy = first.text_filter, StopTextFilter(tok, stops)
    ids = list(range(len(tok)))
    assert [filled.may_end(i) for i in ids] == [lazy.may_end(i) for i in ids]
    assert [filled.front_ok(i) for i in ids] == [lazy.front_ok(i) for i in ids]
    assert first.window == max(len(tok.encode(s, add_special_tokens=False)) + 2 for s in stops)
    second = until_matcher(tok, stops, prompt_len=5)
    assert second.text_filter is filled and second.prompt_len == 5
    other = until_matcher(TOKENIZERS[name](), stops, prompt_len=3)  # another tokenizer object
    assert other.text_filter is not filled

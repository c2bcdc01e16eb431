"""A character-level tokenizer built locally with ``tokenizers`` (nothing is downloaded)."""

from __future__ import annotations


def build_char_tokenizer(vocab_size: int | None = None):
    """A character-level fast tokenizer over printable ASCII, built with `tokenizers`.

    Ids: 0 <pad>, 1 <s>, 2 </s>, 3 <unk>, then the 95 printable ASCII characters (99 ids), then,
    when ``vocab_size`` is larger, filler tokens ``<xN>`` up to it (so every id a model with that
    vocabulary emits decodes). Has a minimal chat template.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    tokens = specials + [chr(c) for c in range(32, 127)]
    tokens += [f"<x{i}>" for i in range(max(0, (vocab_size or 0) - len(tokens)))]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=(
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}"
        ),
    )


def random_words(rng, n: int) -> str:
    """``n`` pseudo-words (2 to 4 syllables of a small alphabet) joined by spaces, with a full
    stop now and then: text a byte-level BPE tokenizer splits into about 1.5 tokens a word."""
    onsets, vowels = "bdfgklmnprstvz", "aeiou"
    words = []
    for _ in range(n):
        w = "".join(rng.choice(onsets) + rng.choice(vowels) for _s in range(rng.randint(1, 3)))
        words.append(w + ("." if rng.random() < 0.08 else ""))
    return " ".join(words)


def build_bpe_tokenizer(vocab_size: int | None = None, seed: int = 0, merges: int = 8000):
    """A byte-level BPE fast tokenizer trained here on :func:`random_words` text (a few
    seconds), in the shape of the Llama-3 / Qwen tokenizers: ``<|endoftext|>`` is EOS and pad,
    no BOS is added. About ``merges`` learned tokens; when ``vocab_size`` is larger, filler
    tokens ``<xN>`` up to it sit in the BPE vocabulary itself (never produced by encoding, cheap
    to load, unlike added tokens), so every id a model with that vocabulary emits decodes."""
    import json
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    corpus = [random_words(rng, 200) for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=merges, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    if vocab_size and vocab_size > tok.get_vocab_size():
        learned = json.loads(tok.to_str())
        vocab = learned["model"]["vocab"]
        vocab.update({f"<x{i}>": i for i in range(len(vocab), vocab_size)})
        tok = Tokenizer.from_str(json.dumps(learned))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")  # fmt: skip

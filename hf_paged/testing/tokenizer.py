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

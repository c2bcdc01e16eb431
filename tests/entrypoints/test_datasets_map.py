"""``paged_generate_map`` on what ``Dataset.map`` really hands it: columns in every
``with_format`` (numpy, torch, arrow, pandas), stop strings (they need the tokenizer in
``generate``), and ``num_proc`` (the error must reach the caller). Stock ``generate`` on each row
alone is the oracle."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_paged.entrypoints.datasets_map import paged_generate_map
from hf_paged.testing import save_checkpoint

datasets = pytest.importorskip("datasets", reason="needs the datasets package (not installed)")

SMALL = dict(device="cpu", num_kv_blocks=64, kv_block_size=4, max_num_seqs=4)
GREEDY = dict(max_new_tokens=5, do_sample=False)
CHAT = [{"role": "user", "content": "hi"}]
COLUMNS = {
    "ids": [[5, 6, 7], [8, 9, 10], [11, 12, 13]],  # equal lengths: a 2-D array or tensor
    "ragged": [[5, 6, 7], [8, 9], [40]],
    "strings": ["ab", "cde", "f"],
    "chats": [CHAT, [*CHAT, {"role": "assistant", "content": "x"}]],
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(checkpoint, its stock HF model, its tokenizer, a map function over column "p")."""
    path = save_checkpoint(str(tmp_path_factory.mktemp("map") / "llama"))
    fn = paged_generate_map(path, column="p", batch_size=2, use_tqdm=False, paged_config=SMALL,
                            **GREEDY)  # fmt: skip
    yield path, AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path), fn
    fn.close()


def stock_new_text(model, tok, row, **kwargs) -> str:
    if isinstance(row, str):
        ids = tok(row, return_tensors="pt")["input_ids"]
    elif isinstance(row[0], dict):
        ids = tok.apply_chat_template(row, add_generation_prompt=True, return_dict=True,
                                      return_tensors="pt")["input_ids"]  # fmt: skip
    else:
        ids = torch.tensor([row])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize("fmt", ["numpy", "torch", "arrow", "pandas"])
@pytest.mark.parametrize("column", sorted(COLUMNS))
def test_every_format_gives_each_row_its_stock_text(served, fmt, column):
    """A formatted column is a 2-D array, an array of strings or of arrays, a list of tensors, a
    pyarrow array or a pandas Series (it was refused as 'one row, not a batch')."""
    _, model, tok, fn = served
    rows = COLUMNS[column]
    ds = datasets.Dataset.from_dict({"p": rows}).with_format(fmt)
    out = ds.map(fn, **fn.map_kwargs).with_format(None)["generated"]
    assert list(out) == [stock_new_text(model, tok, r, **GREEDY) for r in rows]


def test_unbatched_formatted_row_or_input_columns_say_how_to_call(served):
    fn = served[3]
    ds = datasets.Dataset.from_dict({"p": COLUMNS["ids"]}).with_format("numpy")
    with pytest.raises(ValueError, match=r"one row, not a batch.*batched=True"):
        ds.map(fn)
    with pytest.raises(TypeError, match=r"batch=list is not allowed.*without input_columns"):
        ds.with_format(None).map(fn, input_columns="p", **fn.map_kwargs)  # was AttributeError


def test_stop_strings_get_the_tokenizer(served):
    """``tokenizer`` is this function's own argument, so ``generate`` gets it from there (stock
    generate refused the stop strings without it)."""
    path, model, tok, _ = served
    kw = dict(stop_strings=["e", "<x1"], **GREEDY)
    fn = paged_generate_map(path, column="p", use_tqdm=False, paged_config=SMALL, **kw)
    rows = ["Hello", "ab", "The capital"]
    try:
        out = fn({"p": rows})["generated"]
    finally:
        fn.close()
    want = [stock_new_text(model, tok, r, tokenizer=tok, **kw) for r in rows]
    assert out == want
    assert want != [stock_new_text(model, tok, r, **GREEDY) for r in rows]  # rows were cut


def test_num_proc_error_reaches_the_caller(served):
    """The workers get a stand-in whose call raises: Dataset.map re-raises that error (raised
    while unpickling, it killed the workers and the caller read 'a subprocess died')."""
    fn = served[3]
    ds = datasets.Dataset.from_dict({"p": ["a", "b", "c", "d"]})
    with pytest.raises(RuntimeError, match="can't be sent to another process.*without num_proc"):
        ds.map(fn, num_proc=2, **fn.map_kwargs)


def test_stock_warnings_are_said_once_per_map_call_not_per_prompt_length(served):
    """Stock's preparation runs once per row, and its ``max_length`` warning names the row's
    length: 12 rows of 12 lengths gave 12 warnings. One map call says it once."""
    path, _, _, _ = served
    fn = paged_generate_map(path, column="p", batch_size=5, use_tqdm=False, paged_config=SMALL,
                            do_sample=False)  # fmt: skip  (no max_new_tokens: stock warns)
    ds = datasets.Dataset.from_dict({"p": [list(range(5, 6 + n)) for n in range(12)]})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = ds.map(fn, **fn.map_kwargs)
    finally:
        fn.close()
    assert len(out["generated"]) == 12
    said = [str(w.message) for w in caught if "max_length" in str(w.message)]
    assert len(said) == 1, said

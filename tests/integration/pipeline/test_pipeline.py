"""``AutoPagedModelForCausalLM``, ``pipeline(..., backend="paged")`` and ``paged_generate_map``:
greedy outputs equal stock (same checkpoint, ``do_sample=False``), the engine really serves the
calls, and bad input names the argument."""

from __future__ import annotations

import pickle
import sys

import pytest
import torch
import transformers
from transformers import StoppingCriteria
from transformers.pipelines.pt_utils import KeyDataset

from hf_paged.entrypoints.datasets_map import paged_generate_map
from hf_paged.integration import dispatch
from hf_paged.integration.auto import AutoPagedModelForCausalLM, PagedModelForCausalLM
from hf_paged.integration.pipeline import (
    install_pipeline,
    is_pipeline_installed,
    uninstall_pipeline,
)
from tests.integration.pipe_utils import CHAT, GREEDY, PROMPTS, SMALL_ENGINE, stock_new_text

# transformers.pipeline patched for the whole module (conftest.py has the fixtures)
pytestmark = pytest.mark.usefixtures("pipeline_wrapper")


@pytest.fixture(scope="module")
def paged_pipe(ckpt, pipeline_wrapper):
    pipe = transformers.pipeline(
        "text-generation", model=ckpt, backend="paged", paged_config=SMALL_ENGINE, device="cpu"
    )
    yield pipe
    pipe.model.close()


# ---- pipeline(model=<path>, backend="paged") ----------------------------------------------------


def test_path_pipeline_never_builds_the_hf_model(paged_pipe, ckpt):
    model = paged_pipe.model
    assert isinstance(model, PagedModelForCausalLM)
    assert model.name_or_path == ckpt
    assert all(p.device.type == "meta" for p in model._skeleton.parameters())


def test_string(paged_pipe, stock_pipe, counter):
    assert paged_pipe(PROMPTS[0], **GREEDY) == stock_pipe(PROMPTS[0], **GREEDY)
    assert counter.calls == 1


@pytest.mark.parametrize("return_full_text", [True, False])
def test_list_with_batch_size(paged_pipe, stock_pipe, return_full_text):
    kw = dict(batch_size=2, return_full_text=return_full_text, **GREEDY)
    paged = paged_pipe(PROMPTS, **kw)
    assert paged == stock_pipe(PROMPTS, **kw)
    assert len({r[0]["generated_text"] for r in paged}) > 1  # the rows differ: a real check


def test_token_ids(paged_pipe, stock_pipe):
    paged = paged_pipe(PROMPTS[:3], return_tensors=True, **GREEDY)
    assert paged == stock_pipe(PROMPTS[:3], return_tensors=True, **GREEDY)
    assert len(paged[0][0]["generated_token_ids"]) == len(PROMPTS[0]) + GREEDY["max_new_tokens"]


def test_chat(paged_pipe, stock_pipe):
    chats = [CHAT, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "He"}]]
    assert paged_pipe(CHAT, **GREEDY) == stock_pipe(CHAT, **GREEDY)
    assert paged_pipe(chats, batch_size=2, **GREEDY) == stock_pipe(chats, batch_size=2, **GREEDY)


def test_key_dataset(paged_pipe, stock_pipe, hf_datasets):
    ds = hf_datasets.Dataset.from_dict({"text": PROMPTS})
    paged = list(paged_pipe(KeyDataset(ds, "text"), batch_size=2, **GREEDY))
    assert paged == list(stock_pipe(KeyDataset(ds, "text"), batch_size=2, **GREEDY))


# ---- pipeline(model=<loaded model>, backend=...) ------------------------------------------------


def test_loaded_model_goes_paged(stock_pipe, counter):
    model = stock_pipe.model
    dispatch.configure(model, **SMALL_ENGINE)
    try:
        pipe = transformers.pipeline(
            "text-generation", model=model, tokenizer=stock_pipe.tokenizer, backend="paged",
            device="cpu",
        )  # fmt: skip
        assert pipe(PROMPTS, batch_size=2, **GREEDY) == stock_pipe(PROMPTS, batch_size=2, **GREEDY)
        assert counter.calls == 0  # the list streams through one engine run, not per batch
        assert dispatch.get_engine(model).stats["max_num_running_seqs"] > 2
        pipe(PROMPTS[0], **GREEDY)
        assert counter.calls == 1  # one input: one paged generate call
        pipe(PROMPTS[0], backend="hf", **GREEDY)  # a call may override the pipeline's backend
        assert counter.calls == 1
    finally:
        dispatch.release(model)


def test_backend_hf_stays_stock_under_a_paged_default(stock_pipe, counter):
    dispatch.set_default_backend("paged")
    pipe = transformers.pipeline(
        "text-generation", model=stock_pipe.model, tokenizer=stock_pipe.tokenizer, backend="hf",
        device="cpu",
    )  # fmt: skip
    pipe(PROMPTS[0], **GREEDY)
    assert counter.calls == 0


def test_install_uninstall_restore_the_same_function():
    tf = sys.modules["transformers"]
    original = tf.pipelines.pipeline.__hf_paged_original__
    install_pipeline()  # idempotent
    assert tf.pipelines.pipeline.__hf_paged_original__ is original
    uninstall_pipeline()
    assert tf.pipelines.pipeline is original and tf.pipeline is original
    assert not is_pipeline_installed()
    install_pipeline()
    assert tf.pipeline is tf.pipelines.pipeline and is_pipeline_installed()


def test_bad_pipeline_input(ckpt, stock_pipe):
    with pytest.raises(ValueError, match="backend='fast' is not allowed.*'paged'"):
        transformers.pipeline("text-generation", model=ckpt, backend="fast")
    with pytest.raises(ValueError, match="task='fill-mask' is not allowed"):
        transformers.pipeline("fill-mask", model=ckpt, backend="paged")
    with pytest.raises(ValueError, match="must be a local checkpoint directory"):
        transformers.pipeline("text-generation", model="no/such-model", backend="paged")
    with pytest.raises(TypeError, match="paged_config=.* is not allowed"):
        transformers.pipeline("text-generation", model=ckpt, backend="paged", paged_config=3)
    with pytest.raises(TypeError, match=r"unknown key\(s\) \['bogus'\]"):
        transformers.pipeline(
            "text-generation", model=ckpt, backend="paged", paged_config={"bogus": 1}
        )


# ---- AutoPagedModelForCausalLM ------------------------------------------------------------------


def test_auto_model_surface(paged_pipe, ckpt):
    model = paged_pipe.model
    assert model.can_generate() and model.eval() is model and model.to("cuda") is model
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert model.config.architectures == ["LlamaForCausalLM"]
    assert model.generation_config.eos_token_id == 2
    with pytest.raises(NotImplementedError, match="no forward pass"):
        model(torch.tensor([[5, 6]]))
    with pytest.raises(OSError, match="from_pretrained"):
        AutoPagedModelForCausalLM()


def test_auto_generate_equals_stock(paged_pipe, stock_pipe):
    model, tok = paged_pipe.model, stock_pipe.tokenizer
    enc = tok(PROMPTS, return_tensors="pt", padding=True)  # the pipeline left-pads the tokenizer
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    paged = model.generate(**enc, **kw)
    stock = stock_pipe.model.generate(**enc, **kw)
    assert torch.equal(paged.sequences, stock.sequences)
    torch.testing.assert_close(torch.stack(paged.scores), torch.stack(stock.scores), atol=1e-4, rtol=1e-4)  # fmt: skip


def test_auto_generate_rejects_what_only_stock_does(paged_pipe, stock_pipe):
    model = paged_pipe.model
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(NotImplementedError, match="output_hidden_states"):
        model.generate(
            ids, max_new_tokens=2, output_hidden_states=True, return_dict_in_generate=True
        )
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=4)  # served since issue 25
    assert torch.equal(model.generate(ids, **beams), stock_pipe.model.generate(ids, **beams))
    with pytest.raises(NotImplementedError, match="assisted"):
        model.generate(ids, assistant_model=model, max_new_tokens=2)
    with pytest.raises(ValueError, match="backend='hf' is not allowed"):
        model.generate(ids, backend="hf")
    with pytest.raises(ValueError, match="paged_config=.* is not allowed"):
        model.generate(ids, paged_config={"max_num_seqs": 2})
    assert model.generate(ids, max_new_tokens=2, backend="paged").shape == (1, 5)  # still usable


def test_from_pretrained_bad_input(ckpt, tmp_path):
    with pytest.raises(ValueError, match="pretrained_model_name_or_path=.* is not allowed"):
        AutoPagedModelForCausalLM.from_pretrained(str(tmp_path))
    with pytest.raises(TypeError, match=r"unknown key\(s\) \['device_map'\]"):
        AutoPagedModelForCausalLM.from_pretrained(ckpt, device_map="auto")
    with pytest.raises(ValueError, match="max_num_seqs=0 is not allowed"):
        AutoPagedModelForCausalLM.from_pretrained(ckpt, max_num_seqs=0)


# ---- datasets.map -------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["paged", "loaded"])
def test_datasets_map_equals_stock_per_row(paged_pipe, stock_pipe, source, counter, hf_datasets):
    """Each row as if generated alone, all rows of a map batch in one engine run."""
    hf, tok = stock_pipe.model, stock_pipe.tokenizer
    model = paged_pipe.model if source == "paged" else hf
    kw = dict(max_new_tokens=7, do_sample=False, repetition_penalty=1.3)
    fn = paged_generate_map(
        model, tok, column="q", output_column="a", batch_size=3, use_tqdm=False,
        paged_config=None if source == "paged" else SMALL_ENGINE, **kw,
    )  # fmt: skip
    ds = hf_datasets.Dataset.from_dict({"q": PROMPTS})
    try:
        out = ds.map(fn, **fn.map_kwargs)
        chats = fn({"q": [CHAT, CHAT[:1]]})["a"]  # chat rows (a column of chats)
    finally:
        dispatch.release(hf)
    assert list(out["a"]) == [stock_new_text(hf, tok, r, **kw) for r in PROMPTS]
    assert chats == [stock_new_text(hf, tok, CHAT, **kw)] * 2
    assert counter.calls == 0  # engine requests directly, not generate calls


def test_datasets_map_external_options_fall_back_to_one_padded_call(paged_pipe, stock_pipe):
    class Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    hf, tok = stock_pipe.model, stock_pipe.tokenizer
    fn = paged_generate_map(paged_pipe.model, tok, stopping_criteria=[Never()], use_tqdm=False, **GREEDY)  # fmt: skip
    out = fn({"prompt": PROMPTS})
    assert out["generated"] == [stock_new_text(hf, tok, p, **GREEDY) for p in PROMPTS]
    beams = paged_generate_map(paged_pipe.model, tok, num_beams=3, use_tqdm=False, **GREEDY)
    out = beams({"prompt": PROMPTS})  # beam search: the padded call, served on the engine
    assert out["generated"] == [stock_new_text(hf, tok, p, num_beams=3, **GREEDY) for p in PROMPTS]


def test_datasets_map_bad_input(paged_pipe, stock_pipe):
    fn = paged_generate_map(paged_pipe.model, stock_pipe.tokenizer, **GREEDY)
    with pytest.raises(ValueError, match=r"column='prompt' is not allowed.*\['text'\]"):
        fn({"text": ["a"]})
    with pytest.raises(ValueError, match=r"prompt\[1\]=3 is not allowed"):
        fn({"prompt": ["a", 3]})
    beams = paged_generate_map(
        paged_pipe.model, stock_pipe.tokenizer, num_beams=2, num_return_sequences=2, **GREEDY
    )
    with pytest.raises(ValueError, match="num_return_sequences=2 is not allowed"):
        beams({"prompt": ["a"]})
    n2 = paged_generate_map(
        paged_pipe.model,
        stock_pipe.tokenizer,
        num_return_sequences=2,
        do_sample=True,
        max_new_tokens=2,
    )
    with pytest.raises(ValueError, match="num_return_sequences=2 is not allowed"):
        n2({"prompt": ["a"]})
    with pytest.raises(RuntimeError, match="num_proc"):  # in another process: calling raises
        pickle.loads(pickle.dumps(fn))({"prompt": ["a"]})
    with pytest.raises(ValueError, match="batch_size=0 is not allowed"):
        paged_generate_map(paged_pipe.model, stock_pipe.tokenizer, batch_size=0)
    with pytest.raises(TypeError, match="model_or_path=int is not allowed"):
        paged_generate_map(3, stock_pipe.tokenizer)


def test_datasets_map_without_batched_raises(paged_pipe, stock_pipe, hf_datasets):
    """Unbatched rows (a string, a list of ids, a chat) are one row, not a batch of them."""
    fn = paged_generate_map(paged_pipe.model, stock_pipe.tokenizer, use_tqdm=False, **GREEDY)
    ds = hf_datasets.Dataset.from_dict({"prompt": ["ab", "cd"]})
    with pytest.raises(ValueError, match=r"one row, not a batch.*batched=True.*fn.map_kwargs"):
        ds.map(fn)
    for row in ([5, 6, 7], CHAT):
        with pytest.raises(ValueError, match=r"batched=True"):
            fn({"prompt": row})
    assert len(fn({"prompt": [[5, 6, 7], "ab"]})["generated"]) == 2  # a real batch still runs


def test_datasets_map_logs_have_no_nested_bar_codes(paged_pipe, stock_pipe, capfd, hf_datasets):
    """Dataset.map's bar plus ours, written to a file (not a terminal): no cursor-up codes."""
    fn = paged_generate_map(paged_pipe.model, stock_pipe.tokenizer, batch_size=2, **GREEDY)
    ds = hf_datasets.Dataset.from_dict({"prompt": PROMPTS})
    capfd.readouterr()
    out = ds.map(fn, **fn.map_kwargs)
    err = capfd.readouterr().err
    assert len(out["generated"]) == len(PROMPTS)
    assert "\x1b[A" not in err

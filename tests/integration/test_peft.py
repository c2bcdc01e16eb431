"""PEFT adapters on the paged engine, with stock PEFT as the oracle: greedy token ids of
``generate(backend="paged")``, ``LLM(peft_model)`` and ``pipeline(model=peft_model)`` equal the
PEFT model's own ``generate``, for LoRA on every attention and MLP projection, after
``merge_and_unload``, after in-place updates of lora_B and of base weights, inside
``disable_adapter()``, with a second adapter set active, merged without unloading, and with
``modules_to_save``. What merged weights can't reproduce falls back with a named reason.

PEFT initialises lora_B to zero (the adapter would change nothing); every adapter here gets
random non-zero factors, and each test checks that the adapter really changes the output.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("peft")
from peft import (  # noqa: E402
    IA3Config,
    LoraConfig,
    PromptTuningConfig,
    TaskType,
    get_peft_model,
)

from hf_paged import (  # noqa: E402
    LLM,
    PagedFallbackWarning,  # noqa: E402
    SamplingParams,
)
from hf_paged.integration import dispatch  # noqa: E402
from hf_paged.integration.auto import AutoPagedModelForCausalLM  # noqa: E402
from hf_paged.integration.fallback import reset_fallback_warnings  # noqa: E402
from hf_paged.testing import (  # noqa: E402
    PAD,
    SMALL_ENGINE,
    build_hf_model,  # noqa: E402
    fallback_warnings,
    left_pad,
    make_prompts,
    randomize_lora_,
    tiny_tokenizer,
)

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
LENGTHS = [1, 3, 4, 5, 8, 9]  # 1 and both sides of the 4-token block boundaries
NEW = 16


def _lora(family: str = "llama", targets=ATTN + MLP, seed: int = 0, **config):
    base = build_hf_model(family, seed=seed)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, **config))
    randomize_lora_(model, seed + 100, "default", modules_to_save=True)
    return model.eval()


def _inputs(max_new_tokens: int = NEW) -> dict:
    ids, mask = left_pad(make_prompts(LENGTHS))
    return dict(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=PAD,
    )  # fmt: skip


def _paged(model, **kwargs) -> torch.Tensor:
    """``generate(backend="paged")`` with a fallback warning as an error (it must serve)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", PagedFallbackWarning)
        return model.generate(**_inputs(), backend="paged", paged_config=SMALL_ENGINE, **kwargs)


def _same_as_stock(model) -> torch.Tensor:
    """Stock PEFT and paged greedy on the same call; asserts they are equal; returns them."""
    stock = model.generate(**_inputs())
    paged = _paged(model)
    assert torch.equal(paged, stock)
    return stock


@pytest.fixture(autouse=True)
def release_engines():
    yield
    import gc

    gc.collect()  # each test's models (and their engines) go with it


@pytest.fixture(scope="module")
def base_outputs():
    """Stock greedy of the plain base models, to check that adapters change the output."""
    return {f: build_hf_model(f, seed=0).generate(**_inputs()) for f in ("llama", "qwen3")}


# ---- parity -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_lora_on_attention_and_mlp_equals_stock_peft(family, base_outputs):
    model = _lora(family)
    before = {n: (p.detach().clone(), p._version) for n, p in model.named_parameters()}
    out = _same_as_stock(model)
    assert not torch.equal(out, base_outputs[family])  # the adapter matters
    for n, p in model.named_parameters():  # the user's model is not mutated
        assert torch.equal(p, before[n][0]) and p._version == before[n][1], n


def test_lora_on_embedding_and_lm_head(base_outputs):
    model = _lora("llama", targets=["embed_tokens", "lm_head", "q_proj"])
    assert not torch.equal(_same_as_stock(model), base_outputs["llama"])


def test_merge_and_unload_equals_stock_peft():
    model = _lora("llama")
    adapted = model.generate(**_inputs())
    merged = model.merge_and_unload()
    assert torch.equal(_paged(merged), adapted)
    assert torch.equal(merged.generate(**_inputs()), adapted)


@pytest.mark.parametrize("target", ["lora_B", "base"])
def test_in_place_updates_between_calls_are_reflected(target):
    model = _lora("llama")
    first = _same_as_stock(model)
    layer = model.base_model.model.model.layers[0]
    with torch.no_grad():  # what an optimizer step or an RL weight sync does
        if target == "lora_B":
            for proj in (layer.self_attn.q_proj, layer.mlp.down_proj):
                proj.lora_B["default"].weight.mul_(-3.0)
        else:
            layer.mlp.down_proj.base_layer.weight.mul_(-1.0)
            layer.self_attn.v_proj.base_layer.weight.mul_(-1.0)
    second = _same_as_stock(model)
    assert not torch.equal(first, second)


def test_disable_adapter_serves_the_base_weights(base_outputs):
    model = _lora("llama")
    adapted = _same_as_stock(model)
    with model.disable_adapter():
        assert torch.equal(_same_as_stock(model), base_outputs["llama"])
    assert torch.equal(_paged(model), adapted)  # enabled again after the block


def test_second_adapter_set_active():
    model = _lora("llama")
    first = _same_as_stock(model)
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=4, target_modules=MLP + ["q_proj"]))
    randomize_lora_(model, 7, "second", modules_to_save=True)
    model.set_adapter("second")
    second = _same_as_stock(model)
    assert not torch.equal(first, second)
    model.set_adapter("default")
    assert torch.equal(_paged(model), first)
    model.base_model.set_adapter(["default", "second"])  # both active: their deltas add
    both = _same_as_stock(model)
    assert not torch.equal(both, first) and not torch.equal(both, second)


def test_merged_adapter_without_unload():
    model = _lora("llama")
    adapted = model.generate(**_inputs())
    model.merge_adapter()
    assert torch.equal(_same_as_stock(model), adapted)
    model.unmerge_adapter()
    assert torch.equal(_same_as_stock(model), adapted)


def test_modules_to_save_copy_is_served(base_outputs):
    model = _lora("llama", targets=["v_proj"], modules_to_save=["lm_head"])
    out = _same_as_stock(model)
    assert not torch.equal(out, base_outputs["llama"])
    with model.disable_adapter():  # the original lm_head again
        assert torch.equal(_same_as_stock(model), base_outputs["llama"])


def test_engine_reused_across_adapter_changes(engines_built):
    """Plain LoRA is served from slots: a scaling change needs no rebuild. Merged adapters
    (``modules_to_save`` keeps the merged path) rebuild when their state changes."""
    from peft.tuners.lora import LoraLayer

    built = engines_built
    for targets, extra, engines in (
        (ATTN + MLP, {}, 1),
        (["v_proj"], {"modules_to_save": ["lm_head"]}, 2),
    ):
        built.clear()
        model = _lora("llama", targets=targets, **extra)
        dispatch.configure(model, **{**SMALL_ENGINE, "max_num_seqs": 4})  # the PeftModel's calls
        paged = dict(_inputs(), backend="paged")
        model.generate(**paged)
        model.generate(**paged)
        assert len(built) == 1 and built[0].config.max_num_seqs == 4
        assert dispatch.get_engine(model) is built[0]
        assert (built[0].lora is not None) == (engines == 1)
        for m in model.modules():  # scaling only: no parameter changes
            if isinstance(m, LoraLayer):
                m.set_scale("default", 0.5)
        assert torch.equal(model.generate(**paged), model.generate(**_inputs()))
        assert len(built) == engines


# ---- LLM and pipeline ---------------------------------------------------------------------


def _new_tokens(row: torch.Tensor, prompt_width: int, eos: int = 2) -> list[int]:
    new = row[prompt_width:].tolist()
    return new[: new.index(eos) + 1] if eos in new else new


def test_llm_of_a_peft_model_equals_stock_peft():
    model = _lora("qwen3")
    stock = model.generate(**_inputs())
    width = stock.shape[1] - NEW
    prompts = make_prompts(LENGTHS)
    with LLM(model, **SMALL_ENGINE) as llm:
        outs = llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=NEW), use_tqdm=False
        )
    assert [o.outputs[0].token_ids for o in outs] == [_new_tokens(r, width) for r in stock]


def test_pipeline_of_a_peft_model_equals_stock_peft():
    import transformers

    from hf_paged.integration.pipeline import install_pipeline

    install_pipeline()
    model, tok = _lora("llama"), tiny_tokenizer()
    texts = ["Hello, my name is", "ab", "def fib(n):"]
    greedy = dict(max_new_tokens=NEW, do_sample=False)
    stock = transformers.pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
    paged = transformers.pipeline(
        "text-generation", model=model, tokenizer=tok, device="cpu", backend="paged",
        paged_config=SMALL_ENGINE,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", PagedFallbackWarning)
        assert paged(texts, batch_size=2, **greedy) == stock(texts, batch_size=2, **greedy)


def test_datasets_map_of_a_peft_model_equals_stock_peft():
    from datasets import Dataset

    from hf_paged import paged_generate_map

    model, tok = _lora("llama", targets=["q_proj", "down_proj"]), tiny_tokenizer()
    texts = ["Hello", "ab c", "def fib(n):"]
    fn = paged_generate_map(
        model, tok, column="prompt", paged_config=SMALL_ENGINE, use_tqdm=False,
        max_new_tokens=NEW, do_sample=False,
    )  # fmt: skip
    out = Dataset.from_dict({"prompt": texts}).map(fn, **fn.map_kwargs)
    stock = []
    for text in texts:
        enc = tok(text, return_tensors="pt")
        row = model.generate(**enc, max_new_tokens=NEW, do_sample=False)[0]
        stock.append(tok.decode(row[enc["input_ids"].shape[1] :], skip_special_tokens=True))
    assert out["generated"] == stock


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A saved LoRA adapter (with a tokenizer) on a saved base checkpoint, as PEFT writes it."""
    from transformers import AutoModelForCausalLM

    from hf_paged.testing import save_checkpoint

    root = tmp_path_factory.mktemp("adapter")
    base = AutoModelForCausalLM.from_pretrained(save_checkpoint(str(root / "base")))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=ATTN + MLP))
    randomize_lora_(model, 5, "default", modules_to_save=True)
    model.save_pretrained(str(root / "adapter"))
    tiny_tokenizer().save_pretrained(str(root / "adapter"))
    return str(root / "adapter")


def test_pipeline_of_an_adapter_directory(adapter_dir):
    import transformers

    from hf_paged.integration.pipeline import install_pipeline

    install_pipeline()
    greedy = dict(max_new_tokens=NEW, do_sample=False)
    stock = transformers.pipeline("text-generation", model=adapter_dir, device="cpu")
    paged = transformers.pipeline(
        "text-generation", model=adapter_dir, device="cpu", backend="paged",
        paged_config=SMALL_ENGINE,
    )  # fmt: skip
    assert paged.model.peft_config  # transformers loaded base + adapter
    with pytest.raises(ValueError, match="PEFT adapter directory"):
        AutoPagedModelForCausalLM.from_pretrained(adapter_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PagedFallbackWarning)
        assert paged(["Hello", "xyz"], **greedy) == stock(["Hello", "xyz"], **greedy)


def test_adapter_loaded_through_transformers(adapter_dir, base_outputs):
    """``model.load_adapter`` (transformers' PEFT integration) injects the same LoRA layers."""
    import json
    import os

    from transformers import AutoModelForCausalLM

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        base_path = json.load(f)["base_model_name_or_path"]
    model = AutoModelForCausalLM.from_pretrained(base_path).eval()
    model.load_adapter(adapter_dir)
    assert not torch.equal(_same_as_stock(model), base_outputs["llama"])  # same base weights


def test_bf16_base_with_fp32_adapters_is_served():
    """PEFT upcasts adapter weights to fp32 on a bf16 base; the merged weights are bf16."""
    base = build_hf_model("llama", seed=0).to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "down_proj"])).eval()
    randomize_lora_(model, 2, "default", modules_to_save=True)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    ids = torch.tensor([[5, 6, 7, 8]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", PagedFallbackWarning)
        paged = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, backend="paged")
    assert dispatch.get_engine(model.base_model.model).runtime.dtype == torch.bfloat16
    stock = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(paged[:, :5], stock[:, :5])  # bf16 rounding may part them later


# ---- what merged weights can't reproduce ------------------------------------------------------


def _prompt_tuning():
    cfg = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=3)
    return get_peft_model(build_hf_model("llama", seed=0), cfg).eval()


def _ia3():
    cfg = IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    model = get_peft_model(build_hf_model("llama", seed=0), cfg)
    randomize_lora_(model, 3, "default", scale=1.0, modules_to_save=True)
    return model.eval()


def _dora():
    return _lora("llama", targets=["q_proj", "v_proj"], use_dora=True)


@pytest.mark.parametrize(
    "make, reason",
    [(_prompt_tuning, "peft_prompt_learning"), (_ia3, "peft_ia3"), (_dora, "peft_dora")],
)
def test_unsupported_peft_falls_back_and_llm_refuses(make, reason):
    model = make()
    reset_fallback_warnings()
    stock = model.generate(**_inputs(8))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        paged = model.generate(**_inputs(8), backend="paged", paged_config=SMALL_ENGINE)
    assert torch.equal(paged, stock)
    (message,) = fallback_warnings(rec)
    assert f"[{reason}]" in message
    with pytest.raises(ValueError, match=reason):
        LLM(model, **SMALL_ENGINE)


def test_lora_on_tied_embeddings_falls_back():
    """Qwen3's lm_head is its embedding: one engine tensor can't hold two different weights."""
    model = _lora("qwen3", targets=["lm_head", "q_proj"])
    reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        paged = model.generate(**_inputs(8), backend="paged", paged_config=SMALL_ENGINE)
    assert torch.equal(paged, model.generate(**_inputs(8)))
    assert any("[peft_tied_weights]" in m for m in fallback_warnings(rec))


def test_per_row_adapter_names_are_served():
    model = _lora("llama", targets=["q_proj", "v_proj"])
    names = ["default", "__base__"] * (len(LENGTHS) // 2)
    stock = model.generate(**_inputs(8), adapter_names=names)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PagedFallbackWarning)
        paged = model.generate(**_inputs(8), adapter_names=names, backend="paged")
    assert torch.equal(paged, stock)


def test_disabled_while_merged_falls_back(base_outputs):
    model = _lora("llama")
    model.merge_adapter()
    reset_fallback_warnings()
    with model.disable_adapter(), warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = model.generate(**_inputs(), backend="paged", paged_config=SMALL_ENGINE)
    assert torch.equal(out, base_outputs["llama"])  # stock unmerged the weights
    assert any("[peft_disabled_merged]" in m for m in fallback_warnings(rec))


# ---- on one GPU (marker gpu, skipped without CUDA) ----------------------------------------------
# PEFT LoRA on one GPU (Triton backend, decode CUDA graphs): fp32 greedy equals stock PEFT,
# also after an in-place lora_B update between calls (the rebuilt engine's graphs see the new
# merged weights), and a bf16 base with fp32 adapter weights (PEFT's default autocast) is served,
# not refused for mixed dtypes.


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


peft = pytest.importorskip("peft")


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ENGINE = dict(num_kv_blocks=256, kv_block_size=16, max_num_seqs=16)
CUDA_NEW = 24


def _cuda_lora(family: str, dtype=torch.float32):
    base = build_hf_model(family, seed=0).to("cuda", dtype)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS)
    model = peft.get_peft_model(base, cfg)
    return randomize_lora_(model, seed=1).eval()


def _cuda_inputs():
    lengths = [1, 15, 16, 17, 33, 40]
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device="cuda")
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device="cuda")
    return dict(
        input_ids=ids, attention_mask=mask, max_new_tokens=CUDA_NEW, do_sample=False, pad_token_id=0
    )


def _cuda_paged(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error", PagedFallbackWarning)
        return model.generate(**_cuda_inputs(), backend="paged", paged_config=ENGINE)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_lora_fp32_equals_stock_peft_with_graphs(family):
    model = _cuda_lora(family)
    assert torch.equal(_cuda_paged(model), model.generate(**_cuda_inputs()))
    with torch.no_grad():
        model.base_model.model.model.layers[1].mlp.down_proj.lora_B["default"].weight.mul_(-2)
    assert torch.equal(_cuda_paged(model), model.generate(**_cuda_inputs()))


@pytest.mark.gpu
@needs_cuda
def test_bf16_base_with_fp32_adapters_is_served_on_cuda():
    model = _cuda_lora("llama", dtype=torch.bfloat16)
    dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert dtypes == {torch.float32}  # PEFT upcasts adapter weights by default
    out = _cuda_paged(model)  # raises on a fallback warning
    stock = model.generate(**_cuda_inputs())
    assert out.shape == stock.shape
    # bf16 rounding differs between merged and unmerged LoRA; the first new token agrees
    width = _cuda_inputs()["input_ids"].shape[1]
    assert (out[:, width] == stock[:, width]).float().mean() >= 0.8

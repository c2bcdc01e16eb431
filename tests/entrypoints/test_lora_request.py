"""``LLM.generate(..., lora_request=...)`` over adapters saved by PEFT equals the PEFT model's own
greedy ``generate`` for each prompt (CPU fp32): four adapters of different ranks and targets and
the base model in one call, one ``LoRARequest`` for all prompts, a reloaded adapter with new
weights under the same name, host-cache eviction and reload; bad adapters are refused by name
and leave the engine serving the others."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("peft")
from transformers import AutoModelForCausalLM  # noqa: E402

from hf_paged import LLM, LoRARequest, SamplingParams  # noqa: E402
from hf_paged.testing import SMALL_ENGINE, make_prompts, save_checkpoint  # noqa: E402
from hf_paged.testing.models import save_random_lora  # noqa: E402

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
SPECS = {  # name -> (rank, alpha, targets, rslora)
    "sql": (4, 8, ATTN + MLP, False),
    "chat": (2, 4, ["q_proj", "v_proj"], False),
    "code": (8, 16, MLP, True),
    "math": (16, 8, ["o_proj", "k_proj", "down_proj"], False),
}
LENGTHS = [1, 3, 4, 5, 9, 6]
NEW = 10


def _save_adapter(base_dir: str, out: str, name: str, seed: int, **overrides) -> str:
    r, alpha, targets, rslora = SPECS[name]
    cfg = {**dict(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora), **overrides}
    return save_random_lora(base_dir, out, seed, **cfg)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    base = save_checkpoint(str(root / "base"))
    dirs = {n: _save_adapter(base, str(root / n), n, seed=10 + i) for i, n in enumerate(SPECS)}
    return base, dirs


def _peft_greedy(base_dir: str, adapter_dir: str | None, prompts) -> list[list[int]]:
    """Stock PEFT, each prompt alone (the oracle)."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        row = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0]  # fmt: skip
        out.append(row[len(p) :].tolist())
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def test_lora_requests_over_four_adapters_equal_peft(saved):
    base, dirs = saved
    prompts = make_prompts(LENGTHS, seed=3)
    names = ["sql", "chat", None, "code", "math", "sql"]
    reqs = {n: LoRARequest(n, i + 1, dirs[n]) for i, n in enumerate(SPECS)}
    with LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, **SMALL_ENGINE) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                            lora_request=[reqs[n] if n else None for n in names])  # fmt: skip
        got = [o.outputs[0].token_ids for o in outs]
        for i, n in enumerate(names):
            assert got[i] == _peft_greedy(base, dirs[n] if n else None, [prompts[i]])[0], (i, n)
        # one adapter for every prompt, on the same engine
        one = llm.generate(prompts[:3], GREEDY, use_tqdm=False, lora_request=reqs["code"])
        assert [o.outputs[0].token_ids for o in one] == _peft_greedy(base, dirs["code"],
                                                                     prompts[:3])  # fmt: skip
    assert len({tuple(g) for g in got[:5]}) == 5  # every adapter changes the output


def test_reloaded_adapter_is_a_new_key_and_the_cache_evicts(saved, tmp_path):
    base, dirs = saved
    prompt = make_prompts([9], seed=4)  # two full blocks of 4: prefix-cached between calls
    path = _save_adapter(base, str(tmp_path / "v1"), "sql", seed=50)
    with LLM(base, enable_lora=True, max_loras=1, max_cpu_loras=2, **SMALL_ENGINE) as llm:
        first = (
            llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("sql", 7, path))[
                0
            ]
            .outputs[0]
            .token_ids
        )
        _save_adapter(base, path, "sql", seed=51)  # new weights, same name and path
        second = (
            llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("sql", 8, path))[
                0
            ]
            .outputs[0]
            .token_ids
        )
        assert second == _peft_greedy(base, path, prompt)[0] and first != second
        keys = list(llm.engine.lora.adapters)
        assert len(keys) == 2 and keys[0].split("@")[0] == keys[1].split("@")[0] == "sql"
        # a third and fourth adapter evict the oldest from the host cache (max_cpu_loras=2)
        for i, n in enumerate(("chat", "code")):
            llm.generate(
                prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest(n, 20 + i, dirs[n])
            )
        assert len(llm.engine.lora.adapters) == 2
        again = (
            llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("sql", 8, path))[
                0
            ]
            .outputs[0]
            .token_ids
        )
        assert again == second  # loaded again from disk


def _bad_rank(base, tmp):
    return _save_adapter(base, str(tmp / "big"), "sql", seed=1, r=32, lora_alpha=32)


def _bad_target(base, tmp):
    return _save_adapter(
        base, str(tmp / "head"), "chat", seed=2, target_modules=["lm_head", "q_proj"]
    )


def _bad_embedding(base, tmp):
    return _save_adapter(base, str(tmp / "emb"), "chat", seed=2, target_modules=["embed_tokens"])


def _bad_base(base, tmp):
    other = save_checkpoint(str(tmp / "other_base"), family="qwen3")
    return _save_adapter(other, str(tmp / "other"), "chat", seed=3)


def _bad_dora(base, tmp):
    return _save_adapter(base, str(tmp / "dora"), "chat", seed=4, use_dora=True)


@pytest.mark.parametrize("make, message", [
    (_bad_rank, "rank 32, above the engine's slot rank max_lora_rank=16"),
    (_bad_target, "targets modules the engine does not wrap: 'lm_head'"),
    (_bad_embedding, "targets modules the engine does not wrap: 'model.embed_tokens'"),
    (_bad_base, "does not fit this base model"),
    (_bad_dora, "use_dora=True"),
])  # fmt: skip
def test_bad_adapters_are_refused_by_name(saved, tmp_path, make, message):
    base, dirs = saved
    bad = make(base, tmp_path)
    prompts = make_prompts([3, 5], seed=5)
    good = LoRARequest("chat", 1, dirs["chat"])
    with LLM(base, enable_lora=True, **SMALL_ENGINE) as llm:
        before = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=good)
        with pytest.raises(ValueError, match="LoRA adapter 'oops'") as err:
            llm.generate(prompts, GREEDY, use_tqdm=False,
                         lora_request=[good, LoRARequest("oops", 2, bad)])  # fmt: skip
        assert message in str(err.value)
        assert not llm.engine.has_unfinished_requests()
        after = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=good)
        assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


def test_lora_request_needs_enable_lora_and_right_shapes(saved):
    base, dirs = saved
    req = LoRARequest("chat", 1, dirs["chat"])
    with LLM(base, **SMALL_ENGINE) as llm:
        with pytest.raises(ValueError, match="built without LoRA slots; build it with enable_lora"):
            llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=req)
    with LLM(base, enable_lora=True, **SMALL_ENGINE) as llm:
        with pytest.raises(ValueError, match="lora_request has 1 entries but there are 2"):
            llm.generate([[5, 6], [7]], GREEDY, use_tqdm=False, lora_request=[req])
        with pytest.raises(ValueError, match="is not a saved PEFT adapter"):
            llm.generate([[5]], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("x", 3, os.path.dirname(dirs["chat"])))  # fmt: skip
    with pytest.raises(ValueError, match="lora_int_id=0 is not allowed"):
        LoRARequest("x", 0, dirs["chat"])
    with open(os.path.join(dirs["chat"], "adapter_config.json")) as f:
        assert json.load(f)["r"] == 2

"""``hf-paged generate --lora NAME=PATH``: output equal to ``LLM`` with the same
``LoRARequest``s, one adapter for all prompts or one per prompts-file line, and bad ``--lora``
values named."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")

from hf_paged import LLM, LoRARequest, SamplingParams  # noqa: E402
from hf_paged.testing import save_checkpoint, save_random_lora  # noqa: E402
from tests.entrypoints.cli.procs import run_cli  # noqa: E402

ENGINE = dict(num_kv_blocks=64, kv_block_size=4, device="cpu")
ENGINE_ARGS = ["--num-kv-blocks", "64", "--kv-block-size", "4", "--device", "cpu"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_lora")
    base = save_checkpoint(str(root / "base"))
    targets = {"sql": ["q_proj", "v_proj"], "chat": ["down_proj"]}
    dirs = {name: save_random_lora(base, str(root / name), i, scale=0.4, r=4, lora_alpha=8,
                                   target_modules=t)
            for i, (name, t) in enumerate(targets.items())}  # fmt: skip
    return base, dirs


def _llm_rows(base, prompts, loras):
    with LLM(base, enable_lora=True, **ENGINE) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False,
                            lora_request=loras)  # fmt: skip
    return [o.outputs[0].token_ids for o in outs]


def test_one_lora_for_every_prompt(saved, capsys):
    base, dirs = saved
    code, out, err = run_cli(capsys, "generate", base, "--prompt", "Hello", "--prompt", "ab",
                             "--max-tokens", "6", "--temperature", "0", "--in-order",
                             "--lora", f"sql={dirs['sql']}", *ENGINE_ARGS)  # fmt: skip
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["lora"] for r in rows] == ["sql", "sql"]
    req = LoRARequest("sql", 1, dirs["sql"])
    assert [r["token_ids"] for r in rows] == _llm_rows(base, ["Hello", "ab"], req)
    assert rows[0]["token_ids"] != _llm_rows(base, ["Hello"], None)[0]  # the adapter matters


def test_lora_per_prompts_file_line(saved, tmp_path, capsys):
    base, dirs = saved
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "Hello", "lora": "chat"}\nplain\n{"prompt": "ab", "lora": "sql"}\n')
    code, out, err = run_cli(capsys, "generate", base, "--prompts-file", str(f),
                             "--max-tokens", "6", "--temperature", "0", "--in-order",
                             "--lora", f"sql={dirs['sql']}", "--lora", f"chat={dirs['chat']}",
                             *ENGINE_ARGS)  # fmt: skip
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["lora"] for r in rows] == ["chat", None, "sql"]
    reqs = [LoRARequest("chat", 2, dirs["chat"]), None, LoRARequest("sql", 1, dirs["sql"])]
    assert [r["token_ids"] for r in rows] == _llm_rows(base, ["Hello", "plain", "ab"], reqs)


@pytest.mark.parametrize("lora, message", [
    ("sql", "--lora='sql' is not allowed: give NAME=PATH"),
    ("sql=/nonexistent", "is not a saved PEFT adapter"),
])  # fmt: skip
def test_bad_lora_names_the_argument(saved, capsys, lora, message):
    base, _ = saved
    code, _, err = run_cli(capsys, "generate", base, "--prompt", "a", "--temperature", "0",
                           "--lora", lora, *ENGINE_ARGS)  # fmt: skip
    assert code == 2 and message in err

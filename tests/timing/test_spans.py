"""``HF_PAGED_TIMINGS``: a process that imports hf_paged with it set appends one JSON line at
exit with its imports, model loading, engine start (and its steps) and engine-step times."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from hf_paged.testing import save_demo_model
from hf_paged.timing import spans

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = textwrap.dedent(
    """
    import sys, hf_paged
    from transformers import AutoModelForCausalLM
    from hf_paged import LLM, SamplingParams
    AutoModelForCausalLM.from_pretrained(sys.argv[1])  # timed as hf.from_pretrained
    with LLM(sys.argv[1], max_model_len=64, num_kv_blocks=16, kv_block_size=8) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    """
)


def test_a_process_writes_its_breakdown_at_exit(tmp_path):
    model = save_demo_model(str(tmp_path / "m"))
    record = tmp_path / "spans.jsonl"
    env = dict(os.environ, PYTHONPATH=REPO, HF_PAGED_TIMINGS=str(record), OMP_NUM_THREADS="1")
    for _ in range(2):  # two processes append two lines
        subprocess.run([sys.executable, "-c", SCRIPT, model], env=env, check=True, timeout=120)
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["pid"] != lines[1]["pid"]
    rec = lines[0]
    spans = rec["spans"]
    for name in ("hf.from_pretrained", "engine_start", "engine_start.model_load",
                 "engine_start.kv_cache", "engine.schedule", "engine.step_total"):  # fmt: skip
        assert spans[name]["total_s"] > 0 and spans[name]["calls"] >= 1, name
    assert spans["engine_start"]["calls"] == 1
    assert spans["engine_start.model_load"]["total_s"] <= spans["engine_start"]["total_s"]
    assert 0 < rec["imports_s"] < rec["uptime_s"]
    assert "engine_start.cuda_graphs" not in spans  # CPU: no graphs


def test_off_by_default_records_nothing():
    assert not spans.enabled()
    with spans.span("x"):
        pass
    spans.add("y", 1.0)
    assert spans.snapshot()["spans"] == {}

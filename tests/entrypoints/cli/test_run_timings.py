"""``hf-paged run --timings FILE [--backend hf]``: the same client phases recorded for a stock
run and a paged run of one unmodified script, and ``hf_paged/timing/breakdown.py``'s table
of them."""

from __future__ import annotations

import json
import textwrap

from hf_paged.testing import save_demo_model
from hf_paged.timing.breakdown import phases, table
from tests.entrypoints.cli.procs import finish, start_python

SCRIPT = textwrap.dedent(
    """
    import sys
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    out = pipe(["hello there", "a b c"], max_new_tokens=4, do_sample=False)
    print([o[0]["generated_text"] for o in out])
    """
)


def _run(tmp_path, model, record, *options):
    script = tmp_path / "client.py"
    script.write_text(SCRIPT)
    proc = start_python(["-m", "hf_paged.entrypoints.cli", "run", "--timings", str(record), *options,
                         str(script), model])  # fmt: skip
    code, out, err = finish(proc)
    assert code == 0, err[-3000:]
    (line,) = record.read_text().splitlines()
    return json.loads(line), out.strip().splitlines()[-1]


def test_stock_and_paged_runs_record_the_same_phases(tmp_path):
    model = save_demo_model(str(tmp_path / "m"))
    stock, stock_text = _run(tmp_path, model, tmp_path / "stock.jsonl", "--backend", "hf")
    paged, paged_text = _run(tmp_path, model, tmp_path / "paged.jsonl")
    assert stock_text == paged_text  # greedy: the same strings either way
    s, p = stock["spans"], paged["spans"]
    for spans in (s, p):  # the client's phases, on both sides
        assert spans["client.requests"]["calls"] == 1  # one pipeline call (generate nested in it)
        assert spans["client.tokenize"]["calls"] >= 1 and spans["client.results"]["calls"] >= 1
        assert spans["hf.from_pretrained"]["calls"] >= 1
    assert s["model.stock"]["calls"] >= 1 and "engine_start" not in s
    assert "engine.step_total" in p and "engine_start" in p
    assert "model.stock" not in p  # nothing ran stock in the paged process
    ps, pp = phases(stock), phases(paged)
    for ph in (ps, pp):
        parts = sum(v for k, v in ph.items() if k not in ("wall", "outside model work"))
        assert abs(parts - ph["wall"]) < 1e-6 and ph["model work"] > 0
    assert pp["engine start"] > 0 and ps["engine start"] == 0
    assert "| model work |" in table(ps, pp)

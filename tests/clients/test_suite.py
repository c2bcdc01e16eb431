"""The suite's own helpers, without a subprocess (no ``clients`` marker: they run in ``make
test``): stock's command rewritten to run under the timing hooks, and the switch that asks for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_paged.entrypoints.cli.run import parse
from tests.clients.suite import breakdown_on, timed_output, timed_stock_command

PREFIX = ["py", "-m", "hf_paged.entrypoints.cli", "run", "--timings", "/w/t.jsonl", "--backend",
          "hf"]  # fmt: skip


def test_a_module_command_runs_under_hf_paged_run_backend_hf():
    out = Path("/w/out/stock")
    cmd = ["py", "-m", "lm_eval", "--model", "hf", "--output_path", out, "--limit", 3]
    got = timed_stock_command(cmd, "/w/t.jsonl", {out: timed_output(out)})
    assert got == [*PREFIX, "-m", "lm_eval", "--model", "hf", "--output_path", "/w/out/stock_timed",
                   "--limit", "3"]  # fmt: skip
    opts, module, script, args = parse(got[4:])  # what `hf-paged run` makes of it
    assert opts == {"report": False, "timings": "/w/t.jsonl", "backend": "hf"}
    assert (module, script) == ("lm_eval", None) and args == [str(a) for a in got[10:]]


def test_a_script_command_runs_under_hf_paged_run_backend_hf(tmp_path):
    script = tmp_path / "client.py"
    script.write_text("")
    out = tmp_path / "stock.json"
    got = timed_stock_command(["py", script, "--out", out, "--n", 2], "/w/t.jsonl",
                              {out: timed_output(out)})  # fmt: skip
    assert got == [*PREFIX, str(script), "--out", str(tmp_path / "stock_timed.json"), "--n", "2"]
    opts, module, parsed_script, args = parse(got[4:])
    assert opts["backend"] == "hf" and module is None and parsed_script == str(script)
    assert args == ["--out", str(tmp_path / "stock_timed.json"), "--n", "2"]


def test_without_outputs_the_arguments_stay():
    assert timed_stock_command(["py", "-m", "m", "a"], "/w/t.jsonl") == [*PREFIX, "-m", "m", "a"]


@pytest.mark.parametrize("cmd", [["py"], ["py", "-m"], ["py", "-u", "s.py"]])
def test_other_python_command_lines_are_refused(cmd):
    with pytest.raises(ValueError, match="is not allowed"):
        timed_stock_command(cmd, "/w/t.jsonl")


def test_timed_output_is_a_sibling():
    assert timed_output(Path("/o/stock.json")) == Path("/o/stock_timed.json")
    assert timed_output(Path("/o/stock")) == Path("/o/stock_timed")


def test_the_switch_is_off_by_default_and_refuses_other_values(monkeypatch):
    monkeypatch.delenv("CLIENTS_BREAKDOWN", raising=False)
    assert breakdown_on() is False
    monkeypatch.setenv("CLIENTS_BREAKDOWN", "1")
    assert breakdown_on() is True
    monkeypatch.setenv("CLIENTS_BREAKDOWN", "yes")
    with pytest.raises(ValueError, match="CLIENTS_BREAKDOWN='yes' is not allowed"):
        breakdown_on()

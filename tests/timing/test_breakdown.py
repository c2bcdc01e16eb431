"""``hf_paged/timing/breakdown.py``: the phases of a stock and a paged timing record, the
table of both and ours minus stock's outside model work, on hand-made records."""

from __future__ import annotations

from hf_paged.timing.breakdown import SLACK_S, phases, side_by_side, table


def _record(uptime_s: float, spans: dict[str, float]) -> dict:
    return {"pid": 1, "uptime_s": uptime_s, "imports_s": 3.0,
            "spans": {k: {"total_s": v, "calls": 1} for k, v in spans.items()}}  # fmt: skip


CLIENT = {"hf.from_pretrained": 1.0, "client.setup": 0.5, "client.tokenize": 0.25,
          "client.results": 0.5}  # fmt: skip
STOCK = _record(10.0, {**CLIENT, "client.requests": 4.0, "model.stock": 3.0})
PAGED = _record(9.0, {**CLIENT, "client.requests": 2.5, "engine_start": 1.5,
                      "engine.step_total": 1.0})  # fmt: skip


def test_phases_split_the_wall_time():
    s, p = phases(STOCK), phases(PAGED)
    assert s["model work"] == 3.0 and s["engine start"] == 0.0
    assert s["adapter"] == 4.0 - 0.25 - 3.0  # the request phase less tokenization and model
    assert s["rest"] == 10.0 - (3.0 + 1.0 + 0.5 + 0.25 + 3.0 + 0.75 + 0.5)  # imports .. results
    assert s["outside model work"] == 7.0
    assert p["model work"] == 1.0 and p["engine start"] == 1.5
    assert p["adapter"] == 0.0  # 2.5 of requests hold 0.25 + 1.0 + an engine start of 1.5
    assert p["outside model work"] == 8.0
    for ph in (s, p):
        parts = sum(v for k, v in ph.items() if k not in ("wall", "outside model work"))
        assert abs(parts - ph["wall"]) < 1e-9


def test_side_by_side_gives_ours_minus_stocks_outside_model_work():
    both = side_by_side(STOCK, PAGED)
    assert both["outside_model_work_diff_s"] == 8.0 - 7.0
    assert both["within_slack"] is (1.0 <= SLACK_S)
    lines = both["table"].splitlines()
    assert lines[0] == "| phase | stock (s) | paged (s) | paged - stock (s) |"
    assert "| outside model work | 7.00 | 8.00 | +1.00 |" in lines
    assert "| model work | 3.00 | 1.00 | -2.00 |" in lines
    assert "| wall | 10.00 | 9.00 | -1.00 |" in lines
    slower = {**PAGED, "uptime_s": 9.5}  # 1.5 s more outside model work than stock
    assert side_by_side(STOCK, slower)["within_slack"] is False


def test_table_reads_missing_phases_as_zero():
    assert "| engine start | 0.00 | 0.00 | +0.00 |" in table({}, {})

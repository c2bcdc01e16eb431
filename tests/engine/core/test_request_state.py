"""RequestTable.add on the pure core (no torch): a request whose registration fails leaves the
table as it was, so the engine has no unfinished request that no step will ever finish."""

from __future__ import annotations

import pytest

from hf_paged.config import SamplingParams
from hf_paged.engine.core.request_state import RequestState, RequestTable


def test_a_failed_generator_leaves_the_table_as_it_was():
    def new_generator(seed):
        if seed > 7:  # the second completion's generator fails
            raise ValueError(f"seed {seed} refused")
        return ("generator", seed)

    table = RequestTable(new_generator)
    req = RequestState.build("r", None, [5, 6], SamplingParams(n=2, seed=7), False, (), None)
    with pytest.raises(ValueError, match="seed 8 refused"):
        table.add(req)
    assert not table and "r" not in table and table.of(req.seqs[0].seq_id) is None
    ok = RequestState.build("r", None, [5, 6], SamplingParams(n=2, seed=3), False, (), None)
    table.add(ok)  # the id is free again
    assert [table.of(s.seq_id) for s in ok.seqs] == [ok, ok]

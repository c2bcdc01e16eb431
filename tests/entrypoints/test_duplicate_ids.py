"""Repeated row ids are refused before anything runs (issue 23): they are the exactly-once and
resume key. Here ``rows.check_unique_ids`` and ``shard_generate``; ``map_generate``'s refusals
are in test_ray.py (they need a Ray session)."""

from __future__ import annotations

import os

import pytest

pa = pytest.importorskip("pyarrow")
datasets = pytest.importorskip("datasets")

from hf_paged import LLM  # noqa: E402
from hf_paged.entrypoints.rows import check_unique_ids  # noqa: E402
from hf_paged.entrypoints.torchrun import shard_generate  # noqa: E402
from tests.entrypoints.scale_utils import ENGINE, GREEDY, make_model, text_prompts  # noqa: E402

# 11 rows, three ids repeated (the case): 3 twice and 7 three times
DUP_IDS = [0, 1, 2, 3, 3, 4, 5, 6, 7, 7, 7]


def test_check_unique_ids_names_column_and_values():
    check_unique_ids(list(range(1000)), "id")
    check_unique_ids(pa.chunked_array([[0, 1], [2, 3]]), "id")
    with pytest.raises(ValueError) as err:
        check_unique_ids(pa.chunked_array([DUP_IDS[:5], DUP_IDS[5:]]), "row")
    msg = str(err.value)
    assert "id_column='row'" in msg and "2 id(s)" in msg and "11 rows" in msg
    assert "[3, 7]" in msg and "Deduplicate" in msg and "unique values" in msg
    with pytest.raises(ValueError, match=r"\['a'\]"):
        check_unique_ids(["a", "b", "a"], "id")
    with pytest.raises(ValueError, match=r"\[None\]"):  # two missing ids are one repeated id
        check_unique_ids(pa.array([1, None, None]), "id")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("dup"))


def test_shard_generate_refuses_before_writing(model, tmp_path):
    prompts = text_prompts(len(DUP_IDS), seed=5)
    ds = datasets.Dataset.from_dict({"id": DUP_IDS, "prompt": prompts})
    out = tmp_path / "parts"
    with LLM(model, **ENGINE) as llm:  # an open LLM: the refusal comes before any generate
        with pytest.raises(ValueError, match=r"id_column='id' has 2 id\(s\).*\[3, 7\]"):
            shard_generate(ds, str(out), model=llm, rank=0, world_size=1,
                           sampling_params=GREEDY)  # fmt: skip
        assert llm.stats["prefix_cache_query_tokens"] == 0  # nothing was generated
    assert not out.exists()
    path = str(tmp_path / "dup.parquet")  # from parquet, and a selection of rows, alike
    ds.to_parquet(path)
    with pytest.raises(ValueError, match="occur more than once"):
        shard_generate(path, str(out), model=model, rank=1, world_size=2, **ENGINE)
    with pytest.raises(ValueError, match=r"e\.g\. \[7\]"):
        shard_generate(ds.select([8, 9, 0]), str(out), model=model, **ENGINE)
    assert not out.exists()
    unique = ds.select([0, 1, 2, 3, 5])  # and unique ids pass
    report = shard_generate(unique, str(out), model=model, rank=0, world_size=1,
                            sampling_params=GREEDY, **ENGINE)  # fmt: skip
    assert report.rows_generated == 5 and os.listdir(out)

"""The scale-out clients as users start them, each in a fresh process, against stock
``generate`` on each row alone: ``map_generate`` on a local Ray Data with one engine actor (one
GPU where there is one), and ``shard_generate`` under ``torchrun --nproc-per-node 1``."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.clients.suite import TARGETS, run_one

pytestmark = pytest.mark.clients


def test_map_generate_on_ray_data(size, checkpoint, prompts, workroot, results, stock_reference):
    pytest.importorskip("ray.data", reason="ray[data] is not installed (not on the GPU image; "
                        "pip install 'hf-paged[ray]')")  # fmt: skip
    ref, stock = stock_reference
    out = workroot / "ray"
    cmd = [sys.executable, TARGETS / "ray_client.py", "--model", checkpoint, "--prompts",
           prompts, "--new-tokens", size.new_tokens, "--dtype", size.dtype, "--out",
           out / "paged.json"]  # fmt: skip
    paged = run_one(size, "ray_map_generate", "paged", cmd, out)
    got = json.loads((out / "paged.json").read_text())
    assert got == {str(i): r["ids"] for i, r in enumerate(ref)}
    results.add("ray_map_generate", [stock, paged], prompts=len(ref), identical_tokens=len(ref),
                stock_is="stock generate on each row alone",
                note="the engine runs in a Ray actor: its spans are not in the driver's record")  # fmt: skip


def test_shard_generate_under_torchrun(size, checkpoint, prompts, workroot, results,
                                       stock_reference):  # fmt: skip
    pytest.importorskip("datasets", reason="datasets is not installed (on the GPU image it "
                        "comes with the lm-eval wheels)")  # fmt: skip
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    ref, stock = stock_reference
    out = workroot / "torchrun"
    out.mkdir()
    texts = json.loads(prompts.read_text())
    data = out / "prompts.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "prompt": texts}), data)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
           TARGETS / "shard_client.py", "--model", checkpoint, "--data", data, "--new-tokens",
           size.new_tokens, "--dtype", size.dtype, "--out", out / "parts"]  # fmt: skip
    paged = run_one(size, "torchrun_shard_generate", "paged", cmd, out, OMP_NUM_THREADS="1")
    parts = sorted(p for p in os.listdir(out / "parts") if p.endswith(".parquet"))
    rows = [r for p in parts for r in pq.read_table(out / "parts" / p).to_pylist()]
    got = {r["id"]: r["generation_token_ids"] for r in rows}
    assert len(rows) == len(got) == len(ref)
    assert got == {i: r["ids"] for i, r in enumerate(ref)}
    results.add("torchrun_shard_generate", [stock, paged], prompts=len(ref),
                identical_tokens=len(ref), parts=len(parts),
                stock_is="stock generate on each row alone")  # fmt: skip

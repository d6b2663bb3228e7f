"""The PCP unmasked part reads the restored K/V in place (seqused_k) and the diagonals the local
rows (one call over every chunk): bench_pcp_kv_memory at a tiny size counts 0 copied bytes in
both, and the gathering variant of the unmasked part the formula's bytes."""
from __future__ import annotations

import json

import pytest

from benchmarks import bench_pcp_kv_memory as bench


@pytest.mark.distributed
def test_unmasked_part_copies_nothing(tmp_path):
    payload = bench.run(tmp_path, quick=True)  # 1024 tokens, pcp=2: c = 256
    assert json.loads((tmp_path / f"{bench.NAME}.json").read_text())["tokens"] == 1024
    row_bytes = 2 * bench.HKV * bench.HEAD_SIZE * 2  # K and V, bf16
    for r in payload["rows"]:
        assert r["output_finite"]
        copied = r["kv_bytes_materialized"]
        # unmasked keys of rank r: head chunk r and tail chunk 3 - r -> 3 c rows in all
        assert copied["unmasked"] == (3 * 256 * row_bytes if r["variant"] == "before" else 0)
        assert copied["diagonal"] == 0 and copied["window"] == 0

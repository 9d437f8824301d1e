"""`row_hashes`, the exact identity of a model row in the evaluation caches: the same digests whatever
the number of threads that compute them."""

from __future__ import annotations

import hashlib

import pytest
import torch

from fedprism.experiment.evaluate import row_hashes


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("n", [0, 1, 5, 17])
def test_row_hashes_are_blake2b_of_float32_rows_in_any_thread_count(threads, n):
    rows = torch.randn(n, 301, dtype=torch.float64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = row_hashes(rows)
    finally:
        torch.set_num_threads(before)
    want = [hashlib.blake2b(r.tobytes(), digest_size=16).digest() for r in rows.float().numpy()]
    assert got == want
    assert len(set(got)) == n                                     # distinct rows, distinct digests

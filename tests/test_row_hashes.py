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


def _hash_in_child(rows, out):
    import os

    from fedprism.experiment import evaluate

    torch.set_num_threads(2)
    out.put((row_hashes(rows), evaluate._HASHERS[0] == os.getpid()))


def test_a_forked_child_hashes_with_threads_of_its_own():
    """A process forked after the parent hashed with threads gets none of the parent's threads; it makes
    its own pool instead of queueing work that no thread would take (a hang)."""
    import multiprocessing as mp

    rows = torch.randn(6, 301)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = row_hashes(rows)                                    # the parent's pool now exists
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_hash_in_child, args=(rows, out))
        child.start()
        child.join(60)
        alive = child.is_alive()
        if alive:
            child.kill()
        assert not alive and child.exitcode == 0
        assert out.get(timeout=5) == (want, True)                   # the child's own pool
    finally:
        torch.set_num_threads(before)

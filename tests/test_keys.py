"""Chunk keys: prefix semantics, scoping, input-type independence and cross-process stability."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from kvcache import _native
from kvcache.keys import PERSON, ChunkHasher, chunk_keys, fold64, u32_bytes

TOKENS = [(i * 7919) % 50000 for i in range(1000)]


def test_one_key_per_full_chunk_partial_ignored() -> None:
    assert len(chunk_keys(TOKENS, "m", chunk_size=256)) == 3
    assert chunk_keys(TOKENS[:255], "m", chunk_size=256) == []
    assert len(chunk_keys(TOKENS[:512], "m", chunk_size=256)) == 2


def test_keys_are_128_bit_unsigned_and_distinct() -> None:
    keys = chunk_keys(TOKENS, "m", chunk_size=16)
    assert all(0 <= k < 1 << 128 for k in keys)
    assert len(set(keys)) == len(keys)
    assert any(k >= 1 << 64 for k in keys)


def test_rolling_prefix_semantics() -> None:
    base = chunk_keys(TOKENS, "m", chunk_size=64)
    assert chunk_keys(TOKENS[:300], "m", chunk_size=64) == base[:4]
    changed = list(TOKENS)
    changed[64 * 5 + 3] += 1  # a token in chunk 5
    other = chunk_keys(changed, "m", chunk_size=64)
    assert other[:5] == base[:5]
    assert all(a != b for a, b in zip(other[5:], base[5:], strict=True))  # later chunks all differ


def test_same_chunk_after_different_prefix_differs() -> None:
    a = chunk_keys([1] * 64 + [5] * 64, "m", chunk_size=64)
    b = chunk_keys([2] * 64 + [5] * 64, "m", chunk_size=64)
    assert a[1] != b[1]


@pytest.mark.parametrize(
    "other",
    [
        {"model_name": "m2"},
        {"cache_salt": "tenant-b"},
        {"scope": b"geometry-2"},
    ],
)
def test_scoping_never_shares_keys(other: dict) -> None:
    kw = {"model_name": "m", "cache_salt": "tenant-a", "scope": b"geometry-1"}
    a = chunk_keys(TOKENS, chunk_size=64, **kw)
    b = chunk_keys(TOKENS, chunk_size=64, **{**kw, **other})
    assert not set(a) & set(b)


def test_field_boundaries_are_length_prefixed() -> None:
    assert chunk_keys(TOKENS, "ab", cache_salt="c", chunk_size=64) != chunk_keys(
        TOKENS, "a", cache_salt="bc", chunk_size=64
    )


def test_input_types_agree() -> None:
    ref = chunk_keys(TOKENS, "m", chunk_size=32)
    assert chunk_keys(tuple(TOKENS), "m", chunk_size=32) == ref
    for dtype in (np.int32, np.int64, np.uint32):
        assert chunk_keys(np.array(TOKENS, dtype=dtype), "m", chunk_size=32) == ref
    assert chunk_keys(torch.tensor(TOKENS), "m", chunk_size=32) == ref
    assert chunk_keys(range(1000), "m", chunk_size=32) == chunk_keys(list(range(1000)), "m", chunk_size=32)


def test_out_of_range_tokens_fall_back_per_chunk() -> None:
    toks = list(TOKENS[:128])
    ref = chunk_keys(toks, "m", chunk_size=32)
    for weird in (-1, 1 << 32, (1 << 40) + 3):
        t = list(toks)
        t[100] = weird  # chunk 3
        keys = chunk_keys(t, "m", chunk_size=32)
        assert keys[:3] == ref[:3]  # in-range chunks keep their u32 keys
        assert keys[3] != ref[3]
        assert chunk_keys(np.array(t, dtype=np.int64), "m", chunk_size=32) == keys
    # -1 as int64 and 2**32 - 1 as uint32 share no bytes encoding (different tags)
    a = [0] * 31 + [-1]
    b = [0] * 31 + [(1 << 32) - 1]
    assert chunk_keys(a, "m", chunk_size=32) != chunk_keys(b, "m", chunk_size=32)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError):
        ChunkHasher("m", 0)
    with pytest.raises(TypeError):
        chunk_keys(np.zeros(64, dtype=np.float32), "m", chunk_size=32)
    with pytest.raises(ValueError):
        chunk_keys(np.zeros((2, 64), dtype=np.int64), "m", chunk_size=1)


def test_golden_value_pins_the_definition() -> None:
    # Changing the hash definition invalidates every stored chunk (disk, shared Redis): a change
    # here must be deliberate (bump SEED/PERSON to v2).
    key = chunk_keys(list(range(16)), "llama", chunk_size=16, cache_salt="s")[0]
    assert f"{key:032x}" == GOLDEN


GOLDEN = "6a3000d88423273ffb0a04a7576b60c0"


def test_stable_across_processes_and_hash_seeds() -> None:
    code = (
        "from kvcache.keys import chunk_keys;"
        "print(chunk_keys(list(range(600)), 'llama', chunk_size=128, cache_salt='t'))"
    )
    outs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outs.add(out.stdout)
    assert len(outs) == 1
    assert outs.pop().strip() == str(chunk_keys(list(range(600)), "llama", chunk_size=128, cache_salt="t"))


def test_fold64() -> None:
    for key in chunk_keys(TOKENS, "m", chunk_size=16):
        assert 0 <= fold64(key) < 1 << 64
    assert fold64((5 << 64) | 3) == 6


def _run(h: ChunkHasher, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    bufs = [u32_bytes(p) for p in prompts]
    assert all(b is not None for b in bufs)
    return h.keys_of_run([b for b in bufs if b is not None])


def test_the_native_blake2b_is_hashlibs() -> None:
    """The daemon's batched lookup hashes in native code: BLAKE2b written from RFC 7693 must
    give hashlib's digest for every length around the 128-byte block edges."""
    rng = random.Random(7)
    for n in [0, 1, 15, 16, 17, 127, 128, 129, 255, 256, 257, 1041, 4113, 5000]:
        data = rng.randbytes(n)
        want = hashlib.blake2b(data, digest_size=16, person=PERSON).digest()
        assert _native.blake2b_16(PERSON, data) == want, n


def test_keys_of_run_equals_keys_whatever_the_earlier_prompt_shares() -> None:
    """A run's prompts are hashed against the one before (a shared head once, the rest four
    at a time); each must get exactly the keys ``keys`` gives it alone."""
    h = ChunkHasher("m", 16)
    head = list(range(48))
    prompts = [
        head + list(range(100, 116)),  # shares three chunks with nothing before it
        head + list(range(200, 232)),  # three with the one before
        head[:16] + list(range(300, 340)),  # one, and a partial tail
        list(range(999, 1063)),  # none
        head[:40],  # a prefix of an earlier prompt, ending mid-chunk
        head[:8],  # no full chunk
        head + list(range(200, 232)),
        head + list(range(200, 232)),  # the same prompt twice
    ]
    keys, shared = _run(h, prompts)
    assert keys == [h.keys(p) for p in prompts]
    assert shared == [0, 3, 1, 0, 0, 0, 0, 5]
    assert keys[1][:3] == keys[0][:3] and all(a is b for a, b in zip(keys[1][:3], keys[0][:3], strict=True))


def test_keys_of_run_on_random_runs() -> None:
    """Random runs (chunk sizes 1 to 31, prompts that share any head with the one before or
    with an earlier one, repeats, tails): the keys are those ``keys`` gives alone, and the
    shared count is the longest common run of whole chunks with the prompt before."""
    rng = random.Random(3)
    for chunk in (1, 2, 16, 31):
        h = ChunkHasher("m", chunk)
        for _ in range(120):
            base = [rng.randrange(2**32) for _ in range(chunk * 7)]
            prompts: list[list[int]] = []
            for _ in range(rng.randrange(1, 12)):
                if prompts and rng.random() < 0.3:
                    prompts.append(list(prompts[-1]))
                    continue
                cut = rng.randrange(len(base) + 1)
                prompts.append(base[:cut] + [rng.randrange(2**32) for _ in range(rng.randrange(3 * chunk))])
            keys, shared = _run(h, prompts)
            assert keys == [h.keys(p) for p in prompts]
            for i in range(1, len(prompts)):
                a, b = prompts[i], prompts[i - 1]
                whole = min(len(a), len(b)) // chunk
                cuts = [(c * chunk, (c + 1) * chunk) for c in range(whole)]
                parts = (c for c, (lo, hi) in enumerate(cuts) if a[lo:hi] != b[lo:hi])
                same = next(parts, whole)
                assert shared[i] == same


def test_keys_of_run_finds_where_two_long_prompts_part_at_every_chunk() -> None:
    """For prompts of 11 chunks that part in each chunk (and at each end of it), the keys are
    those ``keys`` gives alone, and the head reused is exactly the chunks before the parting one."""
    h = ChunkHasher("m", 16)
    base = np.arange(11 * 16, dtype=np.uint32)
    for at in range(11 * 16 + 1):
        other = base.copy()
        other[at:] += 10_000  # the same tokens before ``at``, others from it on
        (first, keys), shared = h.keys_of_run([base.tobytes(), other.tobytes()])
        assert keys == h.keys(other.tolist()), at
        assert shared[1] == at // 16
        assert keys[: at // 16] == first[: at // 16]
        assert at // 16 == 11 or keys[at // 16] != first[at // 16]


def test_u32_bytes_is_none_past_uint32() -> None:
    assert u32_bytes([1, 2**32 - 1]) is not None
    assert u32_bytes([1, 2**32]) is None
    assert u32_bytes([-1]) is None


def test_uint32_ids_skip_the_range_scan_and_keep_their_keys() -> None:
    ids = np.arange(64, dtype=np.uint32)
    assert chunk_keys(ids, "m", chunk_size=16) == chunk_keys(list(range(64)), "m", chunk_size=16)
    big = np.array([2**32 - 1] * 16, dtype=np.uint32)
    assert chunk_keys(big, "m", chunk_size=16) == chunk_keys([2**32 - 1] * 16, "m", chunk_size=16)


def test_keys_of_run_lets_other_threads_run_while_it_hashes() -> None:
    """A daemon worker hashing a prompt of millions of tokens must not hold the interpreter
    lock meanwhile: the I/O thread answers other clients then. While one thread hashes 16 Mi
    ids (tens of milliseconds), this one keeps counting; holding the lock, the longest pause
    between two counts would be the whole call."""
    hasher = ChunkHasher("m", chunk_size=256)
    prompt = np.arange(1 << 24, dtype=np.uint32).tobytes()
    took: list[float] = []

    def hash_it() -> None:
        start = time.perf_counter()
        hasher.keys_of_run([prompt])
        took.append(time.perf_counter() - start)

    worker = threading.Thread(target=hash_it)
    last = time.perf_counter()
    longest = 0.0
    worker.start()
    while worker.is_alive():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    assert longest < took[0] / 2, f"paused {longest * 1e3:.0f} ms of a {took[0] * 1e3:.0f} ms hash"

"""Chunk keys: prefix semantics, scoping, input-type independence and cross-process stability."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvcache.keys import ChunkHasher, chunk_keys, fold64

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


def test_keys_after_equals_keys_whatever_the_earlier_prompt_shares() -> None:
    """A batch's prompts are hashed against the one before (a shared head once); each
    must get exactly the keys ``keys`` gives it alone, in every representation."""
    h = ChunkHasher("m", 16)
    head = list(range(48))
    prompts = [
        head + list(range(100, 116)),  # shares three chunks with nothing before it
        head + list(range(200, 232)),  # three with the one before
        head[:16] + list(range(300, 340)),  # one, and a partial tail
        list(range(999, 1063)),  # none
        head[:40],  # a prefix of an earlier prompt, ending mid-chunk
        head[:8],  # no full chunk
        [*head[:16], -1, *range(15)],  # a chunk outside uint32: hashed as keys does
        head + list(range(200, 232)),
    ]
    prior = None
    for p in prompts:
        for form in (p, np.asarray(p, dtype=np.int64), np.asarray(p, dtype=np.int64).astype(np.uint32)):
            if form is not p and min(p, default=0) < 0:
                continue
            keys, _ = h.keys_after(form, prior)
            assert keys == h.keys(p), p
        _, prior = h.keys_after(np.asarray(p, dtype=np.int64), prior)


def test_keys_after_finds_where_two_long_prompts_part_at_every_chunk() -> None:
    """The shared head is found by bisection over whole chunks: for prompts of 11 chunks that
    part in each chunk (and at each end of it), the keys are those ``keys`` gives alone, and
    the head reused is exactly the chunks before the parting one."""
    h = ChunkHasher("m", 16)
    base = np.arange(11 * 16, dtype=np.uint32)
    _, prior = h.keys_after(base, None)
    assert prior is not None
    for at in range(11 * 16 + 1):
        other = base.copy()
        other[at:] += 10_000  # the same tokens before ``at``, others from it on
        keys, _ = h.keys_after(other, prior)
        assert keys == h.keys(other.tolist()), at
        assert keys[: at // 16] == prior.keys[: at // 16]
        assert at // 16 == 11 or keys[at // 16] != prior.keys[at // 16]


def test_uint32_ids_skip_the_range_scan_and_keep_their_keys() -> None:
    ids = np.arange(64, dtype=np.uint32)
    assert chunk_keys(ids, "m", chunk_size=16) == chunk_keys(list(range(64)), "m", chunk_size=16)
    big = np.array([2**32 - 1] * 16, dtype=np.uint32)
    assert chunk_keys(big, "m", chunk_size=16) == chunk_keys([2**32 - 1] * 16, "m", chunk_size=16)

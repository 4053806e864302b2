"""Once-and-final sampling decisions from a stable, well-mixed hash of the key.

Lifecycle subscribers track only a sample of blocks and chunks to bound their memory.
The decision must be (1) final per key: re-rolling on every appearance inflates the
effective rate and starts tracking mid-life; (2) memory-free, because L1 keys are
unbounded; (3) uniform over structured keys: ``hash(int) == int`` in CPython, so
``hash(k) % p < t`` samples the lowest ids, and salted ``hash(str)`` differs per process.

The key is absorbed 64 bits at a time from a fixed seed (mixing between words, so
structured keys such as ``(i << 64) | i`` do not cancel) and passed through the
MurmurHash3 ``fmix64`` finaliser (a bijection with full avalanche), so sequential or
low-entropy keys land uniformly; a key is
sampled when the mixed value falls below ``rate * 2**64``. The same key gets the same
decision in every process and every run.
"""

from __future__ import annotations

_M64 = (1 << 64) - 1
_C1 = 0xFF51AFD7ED558CCD
_C2 = 0xC4CEB9FE1A85EC53
_SEED = 0x2545F4914F6CDD1D  # fixed: decisions must be the same in every process
_INSTANCE_MIX = 0x9E3779B97F4A7C15  # spreads instance ids before combining with block ids


def mix64(key: int) -> int:
    """Stable 64-bit mix of a non-negative int of any width (128-bit chunk keys included)."""
    x = _SEED ^ (key & _M64)
    key >>= 64
    while key:  # absorb wider keys 64 bits at a time, mixing between words
        x = (x * _C1) & _M64
        x ^= (x >> 29) ^ (key & _M64)
        key >>= 64
    x ^= x >> 33
    x = (x * _C1) & _M64
    x ^= x >> 33
    x = (x * _C2) & _M64
    return x ^ (x >> 33)


class Sampler:
    """Deterministic per-key sampling at ``rate`` in (0, 1]."""

    __slots__ = ("rate", "threshold")

    def __init__(self, rate: float) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"sample rate must be in (0, 1], got {rate}")
        self.rate = rate
        self.threshold = 1 << 64 if rate >= 1.0 else int(rate * (1 << 64))

    def sampled(self, key: int) -> bool:
        return mix64(key) < self.threshold

    def sampled_block(self, instance_id: int, block_id: int) -> bool:
        """Decision for an engine block: the key is the pair, so instances sample independently."""
        return mix64(((instance_id * _INSTANCE_MIX) & _M64) ^ block_id) < self.threshold


__all__ = ["Sampler", "mix64"]

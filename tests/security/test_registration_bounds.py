"""A registration can never make a native copy address outside the engine's tensors.

Observed before, against a real daemon: a registration that named its layout
(``NL_X_TWO_NB_BS_NH_HS`` or ``NL_X_NB_TWO_BS_NH_HS``) with a K/V axis of 1 was accepted,
and the page table's V pages lay past the end of each shared tensor. One store crashed the
daemon with SIGSEGV; aimed block ids read another tenant's chunks out of L1 into the
attacker's memory, or overwrote them. Each such registration is now a typed refusal that
maps nothing, and the daemon keeps serving another tenant byte-exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcache.client import KVCacheClient, empty_shared, to_shared
from kvcache.errors import AccessDeniedError, LayoutError, UnknownInstanceError
from kvcache.layouts import KVFormat
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, make_kv_caches

TOKENS, BLOCKS = list(range(64)), list(range(16))
NL, NB, BS, NH, HS = 2, 16, 4, 2, 8


def _victim_cache(seed: int) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=NL, num_blocks=NB, block_size=BS,
                        num_heads=NH, head_size=HS, dtype=torch.float16, seed=seed)  # fmt: skip
    return to_shared(kv)


def _filled(shape: tuple[int, ...], count: int) -> list[torch.Tensor]:
    out = []
    for _ in range(count):
        t = empty_shared(shape, torch.float16)
        t.fill_(7.0)
        out.append(t)
    return out


# (named layout, the engine object an attacker hands over, extra register kwargs)
HOSTILE: dict[str, tuple[KVFormat, Callable[[], object], dict[str, object]]] = {
    "flash_attention_kv_axis_1": (
        KVFormat.NL_X_TWO_NB_BS_NH_HS, lambda: _filled((1, NB, BS, NH, HS), NL), {}),
    "flash_infer_kv_axis_1": (
        KVFormat.NL_X_NB_TWO_BS_NH_HS, lambda: _filled((NB, 1, BS, NH, HS), NL), {}),
    "cross_layer_kv_axis_1": (
        KVFormat.NB_NL_TWO_BS_NH_HS, lambda: _filled((NB, NL, 1, BS, NH, HS), 1)[0], {}),
    "sglang_mha_v_list_short": (
        KVFormat.TWO_X_NL_X_NBBS_NH_HS,
        lambda: [_filled((NB * BS, NH, HS), NL), _filled((NB * BS, NH, HS), NL - 1)],
        {"engine": "sglang", "block_size": BS}),
}  # fmt: skip


def test_a_layout_that_would_address_past_its_tensors_is_refused(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon()
    victim_kv = _victim_cache(seed=1)
    with KVCacheClient(d.endpoint, 1, "victim-model", timeout_s=5) as victim:
        victim.register_kv_caches(victim_kv)
        victim.store(TOKENS, BLOCKS)
        for case, (fmt, make, kwargs) in sorted(HOSTILE.items()):
            with KVCacheClient(d.endpoint, 2, "attacker-model", timeout_s=5) as attacker:
                with pytest.raises(LayoutError):
                    attacker.register_kv_caches(make(), fmt=fmt, **kwargs)  # type: ignore[arg-type]
                # Nothing was registered: a store has nothing to copy from.
                with pytest.raises((UnknownInstanceError, AccessDeniedError)):
                    attacker.store(TOKENS, [NB - 1] * 16)
            assert d.proc.poll() is None, f"the daemon died after {case}"
        assert victim.lookup(TOKENS) == len(TOKENS)
    # The victim's chunks are intact: a fresh engine of the victim gets its own bytes back.
    fresh = to_shared([torch.zeros_like(t) for t in victim_kv])
    with KVCacheClient(d.endpoint, 3, "victim-model", timeout_s=5) as reader:
        reader.register_kv_caches(fresh)
        assert reader.retrieve(TOKENS, BLOCKS) == len(TOKENS)
    assert caches_equal(fresh, victim_kv)

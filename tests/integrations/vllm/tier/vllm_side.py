"""Runs inside vLLM's venv, driven by ``test_manager.py``: ``KVCacheTier`` under vLLM 0.32's own
``TieringOffloadingSpec``, ``TieringOffloadingManager`` and ``SecondaryTierFactory``.

Everything on the vLLM side is vLLM's: the spec builds the real CPU primary tier over a real
``SharedOffloadRegion`` (a ``/dev/shm`` file) and loads the tier through the factory from its
``secondary_tiers`` entry. What vLLM's GPU worker would do (copy a block into a primary row,
read a promoted row back) is done here on the rows, as vLLM's own tiering tests do. The daemon
is real (started by the test). Each check prints ``ok NAME``; a failure exits non-zero.

Modes: ``unit ENDPOINT`` (the tier's contract, one process), ``kill ENDPOINT PID`` (the daemon
stopped, then killed, under a load), ``store|load|miss ENDPOINT ENGINE SALT SEED`` (one
instance of two sharing a daemon, each its own process).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvcache.errors import ConfigError
from kvcache.integrations.vllm.tier import KVCacheTier

ROW = 8192  # bytes of one primary chunk (two pages)
CHUNKS = 16
TIER = {"type": "KVCacheTier", "module_path": "kvcache.integrations.vllm.tier"}
CHECKS: list[str] = []


def ok(name: str) -> None:
    CHECKS.append(name)
    print("ok", name, flush=True)


def wait_for(pred: Callable[[], bool], what: str, timeout: float = 60.0, step: Any = None) -> None:
    """Polls ``pred`` (vLLM's lookup state has no event to wait on) until true, or fails;
    ``step``: an ``Instance`` whose step ends between two polls whose answers are not in."""
    deadline = time.monotonic() + timeout
    wake = threading.Event()
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        wake.wait(0.01)
        if step is not None and not step.tier._lookups._pending_results.empty():
            step.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def keys_of(label: str, n: int) -> list[bytes]:
    """Offload keys shaped as vLLM makes them: a 32-byte block hash and a group index."""
    return [make_offload_key(hashlib.sha256(f"{label}:{i}".encode()).digest(), 0) for i in range(n)]


def data_of(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-128, 128, (n, ROW), dtype=np.int8)


def spec(engine_id: str, tier: dict[str, Any], *, events: bool = False, model: str = "tiny/llama") -> Any:
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0",), group_id=0),),
        worker_kv_bytes_per_block=ROW,
        enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": CHUNKS * ROW, "secondary_tiers": [{**TIER, **tier}]},
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model, dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
            data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=False,
        ),
    )  # fmt: skip
    return TieringOffloadingSpec(config)


class Instance:
    """One vLLM instance's scheduler-side offloading: vLLM's manager with the tier behind it."""

    def __init__(self, endpoint: str, *, salt: str = "", connect: bool = True, **tier: Any) -> None:
        self.spec = spec(
            f"tier-test-{uuid.uuid4().hex[:12]}", {"endpoint": endpoint, "cache_salt": salt, **tier}
        )
        self.manager = self.spec.get_manager()
        self.tier: KVCacheTier = self.manager.secondary_tiers[0]
        assert isinstance(self.tier, KVCacheTier), type(self.tier)
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview())
        assert self.rows.shape == (CHUNKS, ROW), self.rows.shape
        if connect:
            assert self.tier.link.connected.wait(30), "the tier did not register"

    def step(self) -> None:
        for _ in range(2):  # the first may find this step's poll done already
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self) -> None:
        self.tier.drain_jobs()
        self.step()

    def request(self, keys: list[bytes], req_id: str | None = None) -> ReqContext:
        ctx = ReqContext(req_id=req_id or uuid.uuid4().hex)
        self.manager.on_new_request(ctx)
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, 16 * (i + 1))
        return ctx

    def store(self, ctx: ReqContext, keys: list[bytes], data: np.ndarray) -> None:
        """GPU -> primary (the rows written here, as vLLM's worker would), then the cascade."""
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == keys
        for row, key in zip(out.store_spec.chunk_ids, out.keys_to_store, strict=True):
            self.rows[int(row)] = data[keys.index(key)]
        self.manager.complete_store(keys, ctx, True)

    def scan(self, ctx: ReqContext, keys: list[bytes]) -> list[LookupResult]:
        """One scheduler pass over a prompt's chunks: RETRY and HIT_PENDING go on, MISS stops."""
        out = []
        for key in keys:
            result = self.manager.lookup(key, ctx)
            out.append(result)
            if result is LookupResult.MISS:
                break
        return out

    def asked(self, ctx: ReqContext, keys: list[bytes]) -> list[LookupResult]:
        """One scan, then the end of the step (vLLM's lookup results are taken in at a step's
        end, so a scan sees an answer only a step after it was asked)."""
        out = self.scan(ctx, keys)
        self.step()
        return out

    def resolve(self, ctx: ReqContext, keys: list[bytes]) -> list[LookupResult]:
        """Scan until vLLM has a final answer (promotions done); the last scan."""
        last: list[LookupResult] = []

        def settled() -> bool:
            nonlocal last
            last = self.scan(ctx, keys)
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in last):
                return True
            self.step()
            self.tier.drain_jobs()
            return False

        wait_for(settled, "lookups to settle")
        return last

    def read(self, ctx: ReqContext, keys: list[bytes]) -> np.ndarray:
        """primary -> GPU: the rows vLLM would load for ``keys``."""
        spec_ = self.manager.prepare_load(keys, ctx)
        got = self.rows[np.asarray(spec_.chunk_ids, dtype=np.int64)].copy()
        self.manager.complete_load(keys, ctx)
        return got

    def finish(self, ctx: ReqContext) -> None:
        self.manager.on_request_finished(ctx)

    def close(self) -> None:
        """vLLM's shutdown, which must unmap the region: a view the tier kept would leave it
        mapped (vLLM only logs that it could not close it)."""
        self.rows = np.empty(0, np.int8)
        self.manager.shutdown()
        with open("/proc/self/maps") as maps:
            assert f"vllm_offload_{self.spec.config.engine_id}" not in maps.read(), "region left mapped"


HIT, MISS = LookupResult.HIT, LookupResult.MISS


# -- unit: the tier's contract --------------------------------------------------------------
def check_factory(endpoint: str) -> None:
    inst = Instance(endpoint)
    assert SecondaryTierFactory.get_tier_class(TIER) is KVCacheTier
    assert inst.tier.tier_type == "KVCacheTier" and inst.tier.block_size_bytes == ROW
    assert inst.tier.model_name.startswith("vllm-tier:tiny/llama#"), inst.tier.model_name
    inst.close()
    refused = (
        ({"cache_sallt": "x"}, "unknown KVCacheTier keys"),
        ({"locality": "local"}, "locality"),
        ({"staging_chunks": 0}, "staging_chunks"),
    )
    for bad, match in refused:
        try:
            spec(f"bad-{uuid.uuid4().hex[:8]}", {"endpoint": endpoint, **bad}).get_manager()
        except ConfigError as err:
            assert match in str(err), err
        else:
            raise AssertionError(f"{bad} was accepted")
    tier = SecondaryTierFactory.create_secondary_tier(
        {**TIER, "endpoint": endpoint, "locality": "REMOTE"}, memoryview(np.zeros((4, ROW), np.int8)),
        spec(f"loc-{uuid.uuid4().hex[:8]}", {}),
    )  # fmt: skip
    assert isinstance(tier, KVCacheTier) and tier.locality is Locality.REMOTE
    tier.shutdown()
    bp = {"backpressure": {"backpressure_cls": "EMABackpressureDetector"}}  # vLLM's, as for its tiers
    tier = SecondaryTierFactory.create_secondary_tier(
        {**TIER, "endpoint": endpoint, **bp}, memoryview(np.zeros((4, ROW), np.int8)),
        spec(f"bp-{uuid.uuid4().hex[:8]}", {}),
    )  # fmt: skip
    assert type(tier.bp_detector).__name__ == "EMABackpressureDetector"
    tier.shutdown()
    ok("factory")


def check_round_trip(endpoint: str) -> None:
    """Stored through vLLM's cascade, the primary tier reset, promoted back byte for byte."""
    inst = Instance(endpoint)
    keys, data = keys_of("round-trip", 6), data_of(1, 6)
    ctx = inst.request(keys)
    assert inst.scan(ctx, keys) == [LookupResult.RETRY] * 6  # asked of the tier, not known yet
    inst.step()
    wait_for(lambda: inst.asked(ctx, keys)[0] is MISS, "the miss")
    inst.store(ctx, keys, data)
    inst.settle()
    assert not inst.manager.has_pending_work()
    assert all(inst.manager.primary_tier._policy.get(k).ref_cnt == 0 for k in keys)  # cascade released
    inst.finish(ctx)
    inst.manager.reset_cache()  # vLLM's CPU tier forgets; kvcache still holds them
    inst.rows[:] = 0  # and its rows: what comes back was loaded
    ctx = inst.request(keys)
    assert inst.resolve(ctx, keys) == [HIT] * 6
    assert np.array_equal(inst.read(ctx, keys), data)
    assert inst.manager.get_load_source(keys[0], ctx) == KVCacheTier.cache_hit_source
    inst.finish(ctx)
    # vLLM's reset with the cascade still in flight: drain_jobs must leave no job unreported
    # (vLLM asserts that), and what was stored is found in kvcache afterwards
    more, more_data = keys_of("round-trip-more", 4), data_of(6, 4)
    ctx = inst.request(more)
    inst.store(ctx, more, more_data)
    inst.finish(ctx)
    inst.manager.reset_cache()
    inst.rows[:] = 0
    ctx = inst.request(more)
    assert inst.resolve(ctx, more) == [HIT] * 4
    assert np.array_equal(inst.read(ctx, more), more_data)
    inst.finish(ctx)
    inst.close()
    ok("round_trip")


def check_evicted_come_back(endpoint: str) -> None:
    """A working set twice vLLM's CPU tier: what its LRU evicted is promoted back from kvcache,
    byte for byte, while the newest chunks are still served from the CPU tier itself."""
    inst = Instance(endpoint, staging_chunks=3)
    batches = [(keys_of(f"evict-{b}", 8), data_of(10 + b, 8)) for b in range(4)]  # 32 chunks, 16 rows
    for keys, data in batches:
        ctx = inst.request(keys)
        wait_for(lambda keys=keys, ctx=ctx: inst.asked(ctx, keys)[0] is MISS, "the miss")
        inst.store(ctx, keys, data)
        inst.settle()
        inst.finish(ctx)
    newest, _ = batches[-1]
    assert all(inst.manager.primary_tier.lookup(k, ReqContext(req_id="probe")) is HIT for k in newest)
    for keys, data in batches[:2]:  # evicted from the CPU tier
        assert inst.manager.primary_tier.lookup(keys[0], ReqContext(req_id="probe")) is MISS
        ctx = inst.request(keys)
        assert inst.resolve(ctx, keys) == [HIT] * 8
        assert np.array_equal(inst.read(ctx, keys), data)
        inst.finish(ctx)
    inst.close()
    ok("evicted_come_back")


def check_tier_jobs(endpoint: str) -> None:
    """vLLM's fs-tier scenarios on this tier: empty lookups, store/load into other chunks,
    jobs tracked apart, a load with a missing chunk, failed keys marked missed, events."""
    base = np.zeros((8, ROW), np.int8)
    tier = SecondaryTierFactory.create_secondary_tier(
        {**TIER, "endpoint": endpoint, "enable_kv_events": True, "locality": "LOCAL", "staging_chunks": 2},
        memoryview(base), spec(f"jobs-{uuid.uuid4().hex[:8]}", {}, events=True),
    )  # fmt: skip
    assert isinstance(tier, KVCacheTier) and tier.link.connected.wait(30)
    ctx = ReqContext(req_id="jobs")

    def job(job_id: int, keys: list[bytes], ids: list[int], load: bool = False) -> TransferJob:
        ids_ = np.array(ids, dtype=np.int64)
        return TransferJob(job_id=job_id, keys=keys, chunk_ids=ids_, is_promotion=load, req_context=ctx)

    def finished() -> dict[int, Any]:
        tier.drain_jobs()
        return {r.job_id: r for r in tier.get_finished_jobs()}

    def looked_up(keys: list[bytes]) -> list[LookupResult]:
        for k in keys:
            tier.lookup(k, ctx)
        end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
        tier.on_schedule_end(end)  # the step's asks go to the lookup thread
        wait_for(lambda: not tier._lookups._pending_results.empty(), "the daemon's answer")
        tier.on_schedule_end(end)  # and its answer is taken in
        return [tier.lookup(k, ctx) for k in keys]

    keys = keys_of("jobs", 5)
    assert looked_up(keys[:2]) == [MISS, MISS]
    tier.on_request_finished(ctx)
    base[:5] = data_of(2, 5)
    expected = base[:5].copy()
    tier.submit_store(job(1, keys[:3], [0, 1, 2]))  # three chunks in batches of two
    tier.submit_store(job(2, keys[3:5], [3, 4]))
    done = finished()
    assert set(done) == {1, 2} and all(r.success for r in done.values()), done
    assert done[1].transfer_bytes == 3 * ROW
    events = list(tier.take_events())
    assert [e.keys for e in events] == [keys[:3], keys[3:5]] and events[0].locality is Locality.LOCAL
    assert list(tier.take_events()) == []
    assert looked_up(keys) == [HIT] * 5
    tier.on_request_finished(ctx)
    base[:] = 0
    tier.submit_load(job(3, keys, [7, 6, 5, 4, 3], load=True))  # into other chunks, reversed
    r = finished()[3]
    assert r.success and r.transfer_bytes == 5 * ROW, r
    assert np.array_equal(base[[7, 6, 5, 4, 3]], expected)
    missing = keys_of("never-stored", 1)
    base[:] = 0
    tier.submit_load(job(4, [keys[0], keys[1], missing[0], keys[2]], [0, 1, 2, 3], load=True))
    r = finished()[4]
    assert not r.success and list(r.successful_keys) == keys[:2], r
    assert np.array_equal(base[:2], expected[:2]) and not base[2:].any()  # nothing after the gap
    assert looked_up(missing) == [MISS]
    tier.on_request_finished(ctx)
    # a key looked up as held, then lost to the load, is a miss from then on (no livelock)
    assert looked_up([keys[4]]) == [HIT]
    tier.submit_load(job(5, [missing[0], keys[4]], [0, 1], load=True))
    r = finished()[5]
    assert not r.success and r.successful_keys is None
    assert tier.lookup(keys[4], ctx) is MISS
    tier.on_request_finished(ctx)
    tier.shutdown()
    ok("tier_jobs")


def check_no_daemon(run_dir: str) -> None:
    """No daemon at the endpoint: vLLM's manager is built and serves from its CPU tier;
    lookups miss, the cascade fails as jobs, nothing waits on the daemon."""
    inst = Instance(f"ipc://{run_dir}/nobody.sock", connect=False, timeout_s=2.0)
    keys, data = keys_of("no-daemon", 3), data_of(3, 3)
    ctx = inst.request(keys)
    wait_for(lambda: inst.asked(ctx, keys)[0] is MISS, "the miss")
    inst.store(ctx, keys, data)
    inst.settle()
    assert not inst.manager.has_pending_work()
    assert inst.scan(ctx, keys) == [HIT] * 3 and np.array_equal(inst.read(ctx, keys), data)
    inst.finish(ctx)
    inst.close()
    ok("no_daemon")


def unit(endpoint: str, run_dir: str) -> None:
    check_factory(endpoint)
    check_round_trip(endpoint)
    check_evicted_come_back(endpoint)
    check_tier_jobs(endpoint)
    check_no_daemon(run_dir)


# -- kill: the daemon dies under a load -----------------------------------------------------
def kill(endpoint: str, pid: int) -> None:
    inst = Instance(endpoint, timeout_s=2.0)
    keys, data = keys_of("kill", 4), data_of(4, 4)
    ctx = inst.request(keys)
    inst.step()
    wait_for(lambda: inst.asked(ctx, keys)[0] is MISS, "the miss")
    inst.store(ctx, keys, data)
    inst.settle()
    inst.finish(ctx)
    inst.manager.reset_cache()
    ctx = inst.request(keys)
    inst.scan(ctx, keys)
    inst.step()  # the lookups go to the daemon
    wait_for(lambda: inst.scan(ctx, keys) == [LookupResult.HIT_PENDING] * 4, "promotions queued", step=inst)
    os.kill(pid, signal.SIGSTOP)  # the daemon hangs...
    inst.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))  # submit_load
    wait_for(lambda: inst.tier.has_pending_work(), "the load in flight")
    os.kill(pid, signal.SIGKILL)  # ...and dies with the load in flight
    inst.settle()
    assert not inst.manager.has_pending_work()
    assert inst.scan(ctx, keys) == [MISS], "a failed promotion must be a miss, not a hit"
    inst.finish(ctx)
    ok("load_failed")
    # the instance keeps serving, from its CPU tier
    more, more_data = keys_of("after-kill", 3), data_of(5, 3)
    ctx = inst.request(more)
    inst.store(ctx, more, more_data)
    inst.settle()
    assert not inst.manager.has_pending_work()
    assert inst.scan(ctx, more) == [HIT] * 3 and np.array_equal(inst.read(ctx, more), more_data)
    inst.finish(ctx)
    inst.close()
    ok("keeps_serving")


# -- two instances sharing one daemon (each its own process) --------------------------------
def share(mode: str, endpoint: str, salt: str, seed: int) -> None:
    inst = Instance(endpoint, salt=salt)
    keys, data = keys_of(f"shared-{seed}", 5), data_of(seed, 5)
    ctx = inst.request(keys)
    if mode == "store":
        inst.step()
        wait_for(lambda: inst.asked(ctx, keys)[0] is MISS, "the miss")
        inst.store(ctx, keys, data)
        inst.settle()
        assert not inst.manager.has_pending_work()
    elif mode == "load":
        assert inst.resolve(ctx, keys) == [HIT] * 5
        assert np.array_equal(inst.read(ctx, keys), data)
    else:
        assert inst.resolve(ctx, keys) == [MISS]
    inst.finish(ctx)
    inst.close()
    ok(f"share_{mode}")


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "unit":
        unit(argv[1], argv[2])
    elif mode == "kill":
        kill(argv[1], int(argv[2]))
    else:
        share(mode, argv[1], argv[2], int(argv[3]))
    print(f"passed {len(CHECKS)} checks", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Where a CUDA submit's host time goes: the parts of CudaTransferHandler.submit timed alone."""
import time
import numpy as np, torch
from kvcache.testing import make_kv_caches, ENGINE_OF
from kvcache.layouts import GPUKVFormat
from kvcache.context import GPUCacheContext
from kvcache.transfer import TransferJob, Direction
from kvcache.transfer.validate import check_job, check_start
fmt = GPUKVFormat.NL_X_TWO_NB_BS_NH_HS
caches = make_kv_caches(fmt, num_layers=32, num_blocks=1024, block_size=16, num_heads=8, head_size=128,
                        device="cuda", fill=False)
ctx = GPUCacheContext(caches, 256, fmt, ENGINE_OF[fmt], 16)
chunks = ctx.allocate_chunks(8, pin_memory=True)
ids = np.random.default_rng(0).choice(1024, 128, replace=False).astype(np.int64)
h = ctx.transfer
job = TransferJob(Direction.TO_CHUNKS, ids, tuple(chunks))
def med(f, n=300):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    return np.median(ts) * 1e6
for _ in range(20): h.wait([h.submit(job)])
print(f"submit total      {med(lambda: h.submit(job)):8.1f} us")
h.drain(); h.get_finished()
print(f"check_job         {med(lambda: (check_start(job), check_job(job, h.geometry))):8.1f} us")
print(f"is_pinned x8      {med(lambda: [c.is_pinned() for c in chunks]):8.1f} us")
s = h.stream
print(f"wait_stream       {med(lambda: s.wait_stream(torch.cuda.current_stream())):8.1f} us")
ev = torch.cuda.Event()
print(f"reused ev+wait    {med(lambda: (ev.record(torch.cuda.current_stream()), s.wait_event(ev))):8.1f} us")
print(f"2 events+record   {med(lambda: torch.cuda.Event(enable_timing=True).record(s) or torch.cuda.Event(enable_timing=True).record(s)):8.1f} us")
cj = check_job(job, h.geometry)
nat = h._native
def native():
    nat.copy(cj.block_ids, cj.chunk_ptrs, cj.blocks_per_chunk, cj.last_chunk_blocks, cj.skip_blocks,
             cj.to_chunks, s.cuda_stream)
print(f"native copy       {med(native):8.1f} us")
print(f"cuda_stream attr  {med(lambda: s.cuda_stream):8.1f} us")

"""Runs inside the vLLM venv: one warm in-process vLLM engine in one connector mode, serving
the ``python -m benchmarks.vllm`` commands it reads on stdin.

Separate from the benchmark because it is the only part that imports vLLM (lazily, so the
project's venv can import this module for its tests). ``make-model`` writes the random model
once; ``serve`` builds the engine, warms it up, answers ``Ready`` and then one reply per
command on ``--reply-fd``. Each command steps ``LLMEngine`` itself so that it can time each
step and the first token of every request, and times the connector's methods (``Calls``).

The model is a seeded random LLaMA with a word-level tokenizer over ``w0 .. w{vocab-1}``, so
prompts are exact token sequences (the approach of tests/integrations/vllm/vllm_driver.py,
with the size as a parameter).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.vllm_messages import (
    Calls,
    Command,
    Decode,
    DecodeResult,
    EngineSpec,
    Failed,
    ModelSpec,
    Quit,
    Ready,
    Reply,
    SharedPrefix,
    Ttft,
    TtftResult,
    Zeroed,
    ZeroKV,
)
from benchmarks.vllm_shared_driver import shared_prefix

TIMED = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "request_finished_all_groups", "start_load_kv",
         "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
         "get_block_ids_with_load_errors", "build_connector_worker_meta",
         "get_kv_connector_stats")  # fmt: skip
"""Every connector method vLLM calls while serving (the per-layer no-ops included); vLLM calls
``request_finished_all_groups`` instead of ``request_finished`` on a ``SupportsHMA`` connector."""


def make_model(path: Path, spec: ModelSpec, seed: int = 0) -> None:
    if (path / "model.safetensors").exists():
        return
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(spec.vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2",
                            pad_token="w0").save_pretrained(path)  # fmt: skip
    cfg = LlamaConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, max_position_embeddings=8192, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    std = 0.2 * (128 / spec.hidden) ** 0.5  # the test model's 0.2 at hidden 128, scaled with width
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    model.save_pretrained(path, safe_serialization=True)


def token_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


class ConnectorTimer:
    """Wraps the connector class's methods (before vLLM instantiates it) to add up calls and
    seconds per method; ``take`` returns and clears them. In-process engine: one thread."""

    def __init__(self) -> None:
        self._calls: dict[str, list[float]] = {}
        self._stats: dict[str, float] = {}

    def install(self, connector_class: str) -> None:
        """Wrap the methods of ``connector_class`` (``module:Class``)."""
        import importlib

        module, name = connector_class.split(":")
        cls = getattr(importlib.import_module(module), name)
        for method in TIMED:
            if hasattr(cls, method):  # ``request_finished_all_groups``: HMA connectors only
                setattr(cls, method, self._wrap(method, getattr(cls, method)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        acc = self._calls.setdefault(name, [0, 0.0])

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                acc[0] += 1
                acc[1] += time.perf_counter() - t0
            if name == "get_kv_connector_stats" and result is not None:
                for key, value in result.data.items():  # counters; size samples are lists
                    if isinstance(value, int | float):
                        self._stats[key] = self._stats.get(key, 0.0) + value
            return result

        return timed

    def take(self) -> Calls:
        out = {k: (int(v[0]), v[1]) for k, v in self._calls.items() if v[0]}
        for v in self._calls.values():
            v[0], v[1] = 0, 0.0
        return out

    def take_stats(self) -> dict[str, float]:
        out, self._stats = self._stats, {}
        return out


def _cpu() -> tuple[float, float, float, float]:
    """CPU seconds of this process and of the calling thread; the thread's involuntary switches;
    the process's minor page faults."""
    import resource

    return (time.process_time(), time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw,
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt)  # fmt: skip


def _zero_kv_caches(worker: Any) -> int:
    """Runs on the worker (``collective_rpc``): zero its KV cache tensors, return their bytes."""
    caches = worker.model_runner.kv_caches
    for t in caches:
        t.zero_()
    return sum(int(t.nbytes) for t in caches)


class Engine:
    """An in-process ``LLM`` and the commands run on it (see the module docstring)."""

    def __init__(self, spec: EngineSpec) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from vllm import LLM

        self.spec = spec
        self.timer = ConnectorTimer()
        kw: dict[str, Any] = {}
        if spec.connector is not None:
            self.timer.install(spec.connector_class)
            module, name = spec.connector_class.split(":")
            kw["kv_transfer_config"] = {
                "kv_connector": name, "kv_connector_module_path": module,
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": spec.connector,
            }  # fmt: skip
        t0 = time.perf_counter()
        self.llm = LLM(
            model=spec.model_dir, tokenizer=spec.model_dir, dtype="float32", enforce_eager=True,
            block_size=spec.block_size, max_model_len=spec.max_model_len,
            max_num_batched_tokens=spec.max_model_len, seed=0,
            kv_cache_memory_bytes=spec.kv_cache_mb << 20, enable_prefix_caching=True, **kw,
        )  # fmt: skip
        self._ids = 0
        self.cpu: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
        self.run([token_ids(random.Random(-1), 64, spec.model.vocab)], max_tokens=16)  # warm-up
        self.settle()
        sched = self.llm.llm_engine.vllm_config.scheduler_config
        import kvcache

        self.ready = Ready(time.perf_counter() - t0, torch.get_num_threads(), bool(sched.async_scheduling),
                           str(Path(kvcache.__file__).parent))  # fmt: skip
        self.timer.take()
        self.timer.take_stats()

    def add(self, prompts: list[list[int]], max_tokens: int, reqs: dict[str, dict[str, Any]]) -> list[str]:
        """Add the prompts (greedy, ``ignore_eos``); their outputs will land in ``reqs``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)  # fmt: skip
        ids = []
        for p in prompts:
            self._ids += 1
            ids.append(f"bench-{self._ids}")
            self.llm.llm_engine.add_request(ids[-1], TokensPrompt(prompt_token_ids=p), params)
            reqs[ids[-1]] = {"first": 0.0, "last": 0.0, "tokens": [], "cached": 0}
        return ids

    def step(self, reqs: dict[str, dict[str, Any]], steps: list[float]) -> None:
        """One engine step: its duration into ``steps``, its outputs into ``reqs``."""
        s = time.perf_counter()
        outs = self.llm.llm_engine.step()
        e = time.perf_counter()
        steps.append(e - s)
        for o in outs:
            r = reqs[o.request_id]
            new = list(o.outputs[0].token_ids) if o.outputs else []
            if new and not r["tokens"]:
                r["first"] = e
            if new:
                r["last"] = e
            r["tokens"] += new
            r["cached"] = o.num_cached_tokens or r["cached"]

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[float], dict[str, Any]]:
        """Add the prompts, step until every request is done. Returns the start time, each
        step's duration, and per request: first and last token times, token ids, cached tokens;
        ``self.cpu`` holds the CPU the run used."""
        reqs: dict[str, dict[str, Any]] = {}
        steps: list[float] = []
        t0 = time.perf_counter()
        self.add(prompts, max_tokens, reqs)
        cpu0 = _cpu()
        while self.llm.llm_engine.has_unfinished_requests():
            self.step(reqs, steps)
        self.cpu = tuple(b - a for a, b in zip(cpu0, _cpu(), strict=True))
        return t0, steps, reqs

    def settle(self, within_s: float = 60.0) -> None:
        """Step the idle engine until vLLM can reset its prefix cache: with asynchronous stores
        a finished request's blocks stay held until a step hears its stores are settled."""
        deadline = time.monotonic() + within_s
        while not self.llm.reset_prefix_cache():
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM still held KV blocks {within_s} s after the last request")
            self.llm.llm_engine.step()

    def decode(self, cmd: Decode) -> DecodeResult:
        rng = random.Random(cmd.seed)
        vocab = self.spec.model.vocab
        prompts = [token_ids(rng, cmd.prompt_tokens + 32 * i, vocab) for i in range(cmd.requests)]
        self.timer.take()
        self.timer.take_stats()
        t0, steps, reqs = self.run(prompts, cmd.max_tokens)
        calls, cpu = self.timer.take(), self.cpu
        s = time.perf_counter()
        self.settle()
        settle_s = time.perf_counter() - s
        first_all = max(r["first"] for r in reqs.values())
        last = max(r["last"] for r in reqs.values())
        generated = sum(len(r["tokens"]) for r in reqs.values())
        tokens = sorted(tuple(r["tokens"]) for r in reqs.values())
        return DecodeResult(
            generated=generated, seconds=last - t0, decode_tokens=generated - len(reqs),
            decode_seconds=last - first_all, step_s=steps, settle_s=settle_s,
            digest=hashlib.blake2b(repr(tokens).encode(), digest_size=8).hexdigest(), calls=calls,
            stats=self.timer.take_stats(), cpu_s=cpu[0], main_cpu_s=cpu[1], main_preempted=int(cpu[2]),
            page_faults=int(cpu[3]),
        )  # fmt: skip

    def zero_kv(self, cmd: ZeroKV) -> Zeroed:
        """See ``ZeroKV``; between requests only (nothing in flight, prefix cache reset)."""
        t0, faults = time.perf_counter(), _cpu()[3]
        nbytes = sum(self.llm.collective_rpc(_zero_kv_caches))
        return Zeroed(nbytes, time.perf_counter() - t0, int(_cpu()[3] - faults))

    def ttft(self, cmd: Ttft) -> TtftResult:
        rng = random.Random(cmd.seed)
        vocab = self.spec.model.vocab
        prefix = token_ids(rng, cmd.prefix_tokens, vocab)
        a = prefix + token_ids(rng, cmd.tail_tokens, vocab)
        b = prefix + token_ids(rng, cmd.tail_tokens, vocab)
        self.timer.take_stats()
        s = time.perf_counter()
        self.run([a], max_tokens=1)
        self.settle()
        store_s = time.perf_counter() - s
        reqs: dict[str, dict[str, Any]] = {}
        busy = self.add([token_ids(rng, 64, vocab) for _ in range(cmd.busy)], cmd.busy_tokens, reqs)
        while any(not reqs[i]["tokens"] for i in busy):  # the busy requests are decoding
            self.step(reqs, [])
        self.timer.take()
        steps: list[float] = []
        t0 = time.perf_counter()
        (rid,) = self.add([b], 1, reqs)
        while not reqs[rid]["tokens"]:
            self.step(reqs, steps)
        calls = self.timer.take()
        if busy:
            self.llm.llm_engine.abort_request(busy)
        while self.llm.llm_engine.has_unfinished_requests():
            self.step(reqs, [])
        self.settle()
        r = reqs[rid]
        return TtftResult(ttft_s=r["first"] - t0, cached_tokens=r["cached"], first_token=r["tokens"][0],
                          store_s=store_s, calls=calls, stats=self.timer.take_stats(),
                          step_s=steps)  # fmt: skip


def serve(spec: EngineSpec, reply_fd: int) -> int:
    """Answer ``Ready`` (or ``Failed``), then one reply per command until ``Quit`` or EOF."""
    encoder, decoder = msgspec.json.Encoder(), msgspec.json.Decoder(Command)
    with os.fdopen(reply_fd, "wb", buffering=0) as out:

        def reply(msg: Reply) -> None:
            out.write(encoder.encode(msg) + b"\n")

        try:
            engine = Engine(spec)
        except Exception as exc:
            reply(Failed(f"engine start: {type(exc).__name__}: {exc}"))
            raise
        reply(engine.ready)
        for n, line in enumerate(sys.stdin.buffer):
            cmd = decoder.decode(line)
            if isinstance(cmd, Quit):
                break
            try:
                with _profiled(spec, n):
                    if isinstance(cmd, ZeroKV):
                        reply(engine.zero_kv(cmd))
                    elif isinstance(cmd, SharedPrefix):
                        reply(shared_prefix(engine, cmd))
                    else:
                        reply(engine.decode(cmd) if isinstance(cmd, Decode) else engine.ttft(cmd))
            except Exception as exc:
                reply(Failed(f"{type(cmd).__name__}: {type(exc).__name__}: {exc}"))
                raise
    return 0


@contextmanager
def _profiled(spec: EngineSpec, n: int) -> Iterator[None]:
    if spec.profile_dir is None:
        yield
        return
    import cProfile

    with cProfile.Profile() as prof:
        yield
    prof.dump_stats(Path(spec.profile_dir) / f"{spec.name or 'engine'}-{n}.prof")


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """vLLM logs to stdout: keep it off any pipe the parent reads (replies use their own fd)."""
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_driver")
    sub = p.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-model", help="write the random model (once)")
    mk.add_argument("--dir", required=True)
    mk.add_argument("--spec", required=True, help="ModelSpec as JSON")
    sv = sub.add_parser("serve", help="one warm engine answering commands on stdin")
    sv.add_argument("--spec", required=True, help="EngineSpec as JSON")
    sv.add_argument("--reply-fd", type=int, required=True)
    a = p.parse_args(argv)
    with _stdout_to_stderr():
        if a.cmd == "make-model":
            make_model(Path(a.dir), msgspec.json.decode(a.spec, type=ModelSpec))
            return 0
        return serve(msgspec.json.decode(a.spec, type=EngineSpec), a.reply_fd)


if __name__ == "__main__":
    sys.exit(main())

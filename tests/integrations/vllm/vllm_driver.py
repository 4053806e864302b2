"""Runs inside the vLLM venv (``scripts/vllm_env.sh``), driven by ``test_vllm_e2e.py``.

Kept out of pytest's collection (no ``test_`` prefix) because it imports vLLM, which the
project's own venv does not have. Each ``run`` starts one in-process vLLM engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and writes what the test asserts on as JSON.

The model is a tiny random LLaMA written here (no download): seeded random weights saved as
``model.safetensors`` so that the output depends on every KV entry (dummy weights are too
small for a wrong cache to change the greedy tokens), and a word-level tokenizer whose
vocabulary is ``w0 .. w999`` so prompts are exact token sequences.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

VOCAB = 1000


def make_model(path: Path, seed: int = 0) -> None:
    """A 2-layer LLaMA (hidden 128, 4 heads, 2 KV heads: head dim 32) with a word tokenizer."""
    if (path / "model.safetensors").exists():
        return
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2", pad_token="w0"
    )
    fast.save_pretrained(path)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger than HF's init so the output depends strongly on context
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)


def prompts(seed: int, prefix_len: int, tails: int, tail_len: int) -> list[list[int]]:
    """``tails`` prompts sharing one ``prefix_len``-token prefix, ids in [3, VOCAB)."""
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, VOCAB) for _ in range(tail_len)] for _ in range(tails)]


def reset_prefix_cache(llm: Any, within_s: float = 60.0) -> None:
    """Empty vLLM's prefix cache. With asynchronous stores a finished request keeps its blocks
    until a step hears that its stores are done, and offline no step runs after ``generate``
    returns (vLLM refuses the reset while blocks are held): step the idle engine until the
    reset succeeds. A multiprocess engine core steps on its own."""
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    deadline = time.monotonic() + within_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM still held KV blocks {within_s} s after the last request finished")
        if in_process:
            llm.llm_engine.step()


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = Path(args.model)
    make_model(model)
    kw: dict[str, Any] = {}
    if args.endpoint:
        extra: dict[str, Any] = {"instance_id": args.instance_id, "timeout_s": args.timeout_s}
        if args.sync_stores:  # the connector's synchronous modes (default: asynchronous transfers)
            extra["async_stores"] = False
        if args.sync_loads:
            extra["async_loads"] = False
        if args.endpoint != "default":  # "default": the connector's own choice (the Unix socket)
            extra["endpoint"] = args.endpoint
        kw["kv_transfer_config"] = {
            "kv_connector": "KVCacheConnector",
            "kv_connector_module_path": "kvcache.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    if args.kv_events_endpoint:  # vLLM connects to a plain host:port; the consumer binds it
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=args.kv_events_endpoint,
            topic=args.kv_events_topic,
        )  # fmt: skip
    if args.within_s:  # a request left behind hangs generate(): fail instead, and say so
        watchdog = threading.Timer(args.within_s, _left_behind, (args.within_s,))
        watchdog.daemon = True
        watchdog.start()
    llm = LLM(
        model=str(model), tokenizer=str(model), dtype=args.dtype, enforce_eager=True,
        **({"block_size": args.block_size} if args.block_size else {}),
        max_model_len=args.max_model_len, max_num_batched_tokens=4096, seed=0,
        kv_cache_memory_bytes=args.kv_cache_bytes, enable_prefix_caching=True, **kw,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    out: dict[str, Any] = {"rounds": []}
    batch = prompts(args.seed, args.prefix_len, args.tails, args.tail_len)
    # Warm-up on an unrelated prompt, so that the first round's timing is not the first forward.
    warm = prompts(args.seed + 1000, 64, 1, 8)[0]
    llm.generate([TokensPrompt(prompt_token_ids=warm)], SamplingParams(max_tokens=2), use_tqdm=False)
    reset_prefix_cache(llm)
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        # One request first, alone: its time to first token is the prefill's.
        first = llm.generate(
            [TokensPrompt(prompt_token_ids=batch[0])],
            SamplingParams(temperature=0.0, max_tokens=1),
            use_tqdm=False,
        )
        ttft = time.perf_counter() - t0
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        out["rounds"].append({
            "ttft_s": ttft,
            "first_token": list(first[0].outputs[0].token_ids),
            "first_cached_tokens": first[0].num_cached_tokens,
            "outputs": [list(r.outputs[0].token_ids) for r in res],
            "num_cached_tokens": [r.num_cached_tokens for r in res],
        })  # fmt: skip
        reset_prefix_cache(llm)
    out["ttft"] = measure_ttft(llm, args) if args.ttft_reps else None
    return out


def _left_behind(within_s: float) -> None:
    print(f"vllm_driver: still running after {within_s} s: a request was left behind", flush=True)
    os._exit(3)


def measure_ttft(llm: Any, args: argparse.Namespace) -> dict[str, list[float]]:
    """Time to first token of fresh prompts, computed then (prefix cache reset) loaded.

    Interleaved pairs on new prompts each time, so that machine noise hits both sides alike.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    one = SamplingParams(temperature=0.0, max_tokens=1)
    res: dict[str, list[float]] = {"computed_s": [], "loaded_s": [], "cached_tokens": []}
    for rep in range(args.ttft_reps):
        prompt = TokensPrompt(prompt_token_ids=prompts(args.seed + 1 + rep, args.prefix_len, 1, 40)[0])
        for key in ("computed_s", "loaded_s"):
            t0 = time.perf_counter()
            r = llm.generate([prompt], one, use_tqdm=False)
            res[key].append(time.perf_counter() - t0)
            reset_prefix_cache(llm)
        res["cached_tokens"].append(r[0].num_cached_tokens)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--endpoint", default="")
    p.add_argument("--instance-id", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--tails", type=int, default=3)
    p.add_argument("--tail-len", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--ttft-reps", type=int, default=0)
    p.add_argument("--kv-events-endpoint", default="")
    p.add_argument("--kv-events-topic", default="vllm")
    p.add_argument("--sync-stores", action="store_true")
    p.add_argument("--sync-loads", action="store_true")
    p.add_argument("--timeout-s", type=float, default=30.0, help="the connector's timeout_s")
    p.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--dtype", default="float32", help="a real model's own dtype: auto")
    p.add_argument("--block-size", type=int, default=32, help="0: vLLM's choice (hybrid models align it)")
    p.add_argument("--within-s", type=float, default=0.0, help="exit 3 if the run lasts longer")
    args = p.parse_args(argv)
    result = run(args)
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

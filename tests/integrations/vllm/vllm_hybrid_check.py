"""A real hybrid model with and without kvcache (GPU only: ``scripts/gpu_check.sh``).

vLLM's CPU build turns its hybrid KV cache manager off for real models, so this is the one
check of a real sliding-window or Mamba model: a daemon, then ``vllm_driver.py`` twice, once
without the connector and once with it for two rounds (vLLM's prefix cache reset between
them, so round 2's prefix can only come from kvcache). Passes if all three runs give the same
greedy tokens and round 2 found its prefix in kvcache. Not collected by pytest.

``python vllm_hybrid_check.py --model DIR --out result.json`` (the vLLM venv's python)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvc-hybrid-gpu-") as tmp:
        run = Path(tmp) / "run"
        log = open(Path(tmp) / "daemon.log", "w")  # noqa: SIM115 (closed with the daemon)
        cmd = [sys.executable, "-m", "kvcache.server", "--l1-size-gb", "4", "--runtime-dir", str(run)]
        daemon = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            deadline = time.monotonic() + 120
            while "kvcache daemon ready" not in (Path(tmp) / "daemon.log").read_text():
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("daemon did not start: " + (Path(tmp) / "daemon.log").read_text())
                time.sleep(0.2)  # polling a log file: no event to wait on across processes
            env = dict(os.environ, KVCACHE_RUNTIME_DIR=str(run), HF_HUB_OFFLINE="1")
            common = ["--model", args.model, "--dtype", "auto", "--block-size", "0", "--kv-cache-bytes",
                      str(4 << 30), "--prefix-len", "2048", "--max-tokens", "16"]  # fmt: skip
            runs = {}
            for name, extra in (("plain", []), ("kvcache", ["--endpoint", "default", "--rounds", "2"])):
                out = Path(tmp) / f"{name}.json"
                cmd = [sys.executable, str(HERE / "vllm_driver.py"), *common, "--out", str(out), *extra]
                subprocess.run(cmd, check=True, env=env, cwd="/", timeout=900)
                runs[name] = json.loads(out.read_text())
        finally:
            daemon.terminate()
            daemon.wait(30)
            log.close()
    ref = runs["plain"]["rounds"][0]["outputs"]
    first, second = runs["kvcache"]["rounds"]
    result = {
        "same_tokens": first["outputs"] == ref and second["outputs"] == ref,
        "round2_first_cached_tokens": second["first_cached_tokens"],
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print({k: v for k, v in result.items() if k != "runs"})
    return 0 if result["same_tokens"] and second["first_cached_tokens"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

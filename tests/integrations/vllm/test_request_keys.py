"""Request features that change the KV (LoRA, images, prompt embeddings) change the keys too.

Observed before: a request without an adapter loaded an adapter's KV for the same tokens; two
prompts with the same placeholder tokens and different images shared keys; prompt embeddings
were stored under token ids 0,0,0... and served to a token prompt of zeros.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace as NS

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.integrations.vllm.request_keys import request_key_extra
from kvcache.layouts import KVFormat
from kvcache.protocol.errors import RemoteError
from kvcache.records import MAX_NAME
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches


def _req(**kw: object) -> NS:
    base: dict[str, object] = {"request_id": "r", "cache_salt": None, "prompt_embeds": None,
                               "lora_request": None, "mm_features": None}  # fmt: skip
    return NS(**{**base, **kw})


def _image(identifier: str, offset: int, length: int = 16) -> NS:
    return NS(identifier=identifier, mm_position=NS(offset=offset, length=length))


def test_plain_prompts_have_no_extra() -> None:
    assert request_key_extra(_req()) == ""


def test_lora_images_and_embeddings() -> None:
    lora = request_key_extra(_req(lora_request=NS(lora_name="sql", lora_path="/a/sql")))
    other = request_key_extra(_req(lora_request=NS(lora_name="sql", lora_path="/b/sql")))
    assert lora and other and lora != other  # a name re-pointed at another adapter: new keys
    cat, dog = (request_key_extra(_req(mm_features=[_image(h, 5)])) for h in ("cat", "dog"))
    assert cat and dog and cat != dog
    assert request_key_extra(_req(mm_features=[_image("cat", 6)])) != cat  # other position
    assert request_key_extra(_req(prompt_embeds=torch.zeros(4, 8))) is None  # not cacheable
    assert request_key_extra(_req(mm_features=[_image("", 5)])) is None  # no hash: not guessed


def test_a_request_the_daemon_would_not_take_by_its_names_is_not_cached() -> None:
    """The daemon refuses a request id or cache salt past ``MAX_NAME`` (it keeps such names):
    such a request is neither looked up nor stored, and never refuses a batch it rode in."""
    assert request_key_extra(_req(request_id="r" * MAX_NAME, cache_salt="s" * MAX_NAME)) == ""
    assert request_key_extra(_req(request_id="r" * (MAX_NAME + 1))) is None
    assert request_key_extra(_req(cache_salt="s" * (MAX_NAME + 1))) is None


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(["--chunk-size", "16", "--l1-size-gb", "0.1"])
    yield d
    d.stop()
    d.remove_runtime_dir()


def test_the_daemon_keys_chunks_by_the_extra(daemon: DaemonProcess) -> None:
    kv = to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=1, num_blocks=8,
                                  block_size=4, num_heads=2, head_size=8, dtype=torch.float16))  # fmt: skip
    tokens, blocks = list(range(32)), list(range(8))
    with KVCacheClient(daemon.endpoint, 1, "m", timeout_s=5) as c:
        c.register_kv_caches(kv)
        c.store(tokens, blocks, key_extra="lora=sql@/a")
        assert c.lookup(tokens) == 0  # the base model never gets the adapter's KV
        assert c.lookup(tokens, key_extra="lora=sql@/b") == 0
        assert c.lookup(tokens, key_extra="lora=sql@/a") == 32
        assert c.retrieve(tokens, blocks, key_extra="lora=sql@/a") == 32
        with pytest.raises(RemoteError, match=r"bad_request.*x1f"):  # no salt/extra pair can alias another
            c.lookup(tokens, cache_salt="\x1flora=sql@/a")

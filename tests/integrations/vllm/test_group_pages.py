"""The per-group page rules of a hybrid model (``group_pages.py``, ``group_plan.py``), alone.

No vLLM and no daemon: the rules are plain functions of token lists and block tables. The
scheduler harness (``test_sched_hybrid.py``) runs them under vLLM's real scheduler; here each
rule is pinned on its own, so a change to one says which.
"""

from __future__ import annotations

from typing import Any

from kvcache.integrations.vllm.group_pages import NULL_BLOCK, PageGroup, PageKeys, real_blocks
from kvcache.integrations.vllm.group_plan import MAX_TRIES, GroupPlanner
from kvcache.protocol import messages as m

BS, CHUNK = 16, 64
SWA = PageGroup(1, "swa", BS, reach=31)  # a 32-token window
MAMBA = PageGroup(2, "mamba", BS)
FULL = PageGroup(3, "full", BS)
TOKENS = list(range(1000, 1400))


def test_needed_blocks_per_kind() -> None:
    # Resuming at 128: the window reads tokens 97..127 (blocks 6, 7); the state is block 7's.
    assert SWA.needed(128, 0) == [6, 7]
    assert MAMBA.needed(128, 0) == [7]
    assert FULL.needed(128, 0) == list(range(8))
    # vLLM's own hit holds the blocks below it: never checked nor written.
    assert SWA.needed(128, 112) == [7]
    assert FULL.needed(128, 64) == [4, 5, 6, 7]
    assert SWA.needed(64, 0) == [2, 3] and SWA.needed(16, 0) == [0]


def test_a_window_block_no_boundary_reads_is_not_stored() -> None:
    # A 32-token window and 64-token chunks: blocks 0 and 4 end 32 tokens before a boundary.
    assert SWA.stored_blocks(0, 128, CHUNK) == [2, 3, 6, 7]
    assert FULL.stored_blocks(0, 128, CHUNK) == list(range(8))
    wide = PageGroup(1, "swa", BS, reach=127)
    assert wide.stored_blocks(0, 128, CHUNK) == list(range(8))


def test_keys_name_the_group_and_what_the_bytes_depend_on() -> None:
    keys = PageKeys(BS)

    def key(group: PageGroup, block: int, n: int, extra: str = "", tokens: list[int] = TOKENS) -> bytes:
        return PageKeys(BS).keys("r", tokens, extra, group, [block], n)

    # one group's page is never another's, even for the same tokens and block
    assert len({key(SWA, 3, 64), key(FULL, 3, 64), key(MAMBA, 3, 64)}) == 3
    assert key(SWA, 3, 64) != key(PageGroup(4, "swa", BS, reach=31), 3, 64)
    assert key(SWA, 3, 64) != key(PageGroup(1, "swa", BS, reach=63), 3, 64)
    # an attention block's bytes depend on the tokens up to its end, not on the boundary
    assert key(SWA, 3, 64) == key(SWA, 3, 128)
    changed = [*TOKENS[:64], 7, *TOKENS[65:]]
    assert key(SWA, 3, 64, tokens=changed) == key(SWA, 3, 64)
    assert key(SWA, 4, 128, tokens=changed) != key(SWA, 4, 128)
    # a state depends on the boundary it was taken at, and the request's key_extra
    assert key(MAMBA, 3, 64) != key(MAMBA, 3, 128)
    assert key(MAMBA, 3, 64, extra="lora=a@p") != key(MAMBA, 3, 64)
    assert len(keys.keys("r", TOKENS, "", SWA, [0, 1, 2], 64)) == 3 * m.PAGE_KEY_BYTES


def test_real_blocks_refuse_the_null_block() -> None:
    assert real_blocks([5, 6, 7], [1, 2]) == [6, 7]
    assert real_blocks([NULL_BLOCK, 6, 7], [0, 1]) is None
    assert real_blocks([5, 6], [2]) is None


class _Daemon:
    """Answers ``PageExists`` from a set of held keys, counting the calls."""

    def __init__(self, instance_id: int) -> None:
        self.instance_id = instance_id
        self.held: set[bytes] = set()
        self.calls = 0

    def page_exists(self, msg: m.PageExists) -> m.PageExistsResult:
        self.calls += 1
        keys = [msg.keys[i : i + 32] for i in range(0, len(msg.keys), 32)]
        n = 0
        while n < len(keys) and keys[n] in self.held:
            n += 1
        return m.PageExistsResult(hit_pages=n, l2_pages=0)


def _planner() -> tuple[GroupPlanner, dict[int, _Daemon]]:
    daemons = {1: _Daemon(11), 2: _Daemon(12)}
    clients: dict[int, Any] = dict(daemons)
    return GroupPlanner([SWA, MAMBA], clients, BS), daemons


def _hold(planner: GroupPlanner, daemons: dict[int, _Daemon], group: PageGroup, n: int) -> None:
    blocks = group.needed(n, 0)
    raw = planner.keys.keys("r", TOKENS, "", group, blocks, n)
    daemons[group.index].held |= {raw[i : i + 32] for i in range(0, len(raw), 32)}


def test_a_hit_is_the_longest_boundary_every_group_serves() -> None:
    planner, daemons = _planner()
    _hold(planner, daemons, SWA, 192)
    _hold(planner, daemons, MAMBA, 128)
    _hold(planner, daemons, SWA, 128)
    # 192: the window is held, the state is not; 128: both are
    assert planner.hit("r", TOKENS, "", "", 250, 0, CHUNK) == 128
    # nothing above vLLM's own hit
    assert planner.hit("r", TOKENS, "", "", 250, 128, CHUNK) == 0
    # the window alone is not a hit
    planner2, daemons2 = _planner()
    _hold(planner2, daemons2, SWA, 128)
    assert planner2.hit("r", TOKENS, "", "", 250, 0, CHUNK) == 0


def test_boundaries_tried_are_bounded() -> None:
    planner, daemons = _planner()
    _hold(planner, daemons, SWA, 64)
    _hold(planner, daemons, MAMBA, 64)
    tokens = list(range(5000))
    assert planner.hit("r", tokens, "", "", 64 * (MAX_TRIES + 3), 0, CHUNK) == 0
    assert daemons[1].calls <= MAX_TRIES


def test_stores_window_blocks_once_and_states_only_at_step_ends_on_a_boundary() -> None:
    planner, _ = _planner()
    tables = [[], list(range(100, 120)), list(range(200, 220))]
    # one step computes 0..96: window blocks 2, 3 (boundary 64); no state (the step ends at 96)
    ops = planner.stores("r", TOKENS, "", "", tables, 0, 96, CHUNK)
    assert [(op.group, op.block_ids) for op in ops] == [(1, [102, 103])]
    # the next ends on 128: blocks 6, 7 and the state in block 7
    ops = planner.stores("r", TOKENS, "", "", tables, 96, 32, CHUNK)
    assert [(op.group, op.block_ids) for op in ops] == [(1, [106, 107]), (2, [207])]
    # nothing twice
    assert planner.stores("r", TOKENS, "", "", tables, 128, 0, CHUNK) == []
    # async scheduling: the token the step feeds is not known yet, so no state is stored
    planner2, _ = _planner()
    ops = planner2.stores("r", TOKENS[:127], "", "", tables, 96, 32, CHUNK)
    assert [op.group for op in ops] == [1]


def test_stores_leave_out_null_blocks_and_loads_refuse_them() -> None:
    planner, _ = _planner()
    tables = [[], [NULL_BLOCK] * 3 + list(range(103, 120)), list(range(200, 220))]
    ops = planner.stores("r", TOKENS, "", "", tables, 0, 128, CHUNK)
    assert [(op.group, op.block_ids) for op in ops] == [(1, [103, 106, 107]), (2, [207])]
    # a needed block vLLM left null: the op names keys with no block ids (the load fails)
    tables = [[], [NULL_BLOCK] * 8, list(range(200, 220))]
    loads = planner.loads("r", TOKENS, "", "", tables, 0, 128)
    swa = next(op for op in loads if op.group == 1)
    assert swa.block_ids == [] and len(swa.keys) == 2 * m.PAGE_KEY_BYTES

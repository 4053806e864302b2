"""No module of the kvcache package or of the checkout's ``benchmarks/`` grows past 400 lines.

A module that long usually holds more than one job, and its reader has to hold all of them
at once (issue 21, item 6). The fix is a split by responsibility, each part with a docstring
that says why it stands alone, not a longer limit.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = (REPO / "kvcache", REPO / "benchmarks")
MAX_LINES = 400


def test_no_module_is_over_the_limit() -> None:
    sizes = {
        str(path.relative_to(REPO)): len(path.read_text().splitlines())
        for root in ROOTS
        for path in sorted(root.rglob("*.py"))
    }
    assert len(sizes) > 100  # the walk found the package
    long = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by responsibility): {long}"

"""The daemon's flags for what each tier keeps: admission to L2 and eviction from L1 / disk.

Their own module because they form one decision an operator makes together (which chunks are
worth a tier's bytes, and which leave it first), documented in docs/operator-guide.md, and so
``flags`` does not grow past what one reader holds.
"""

from __future__ import annotations

import argparse

from kvcache.config import ADMISSION_NAMES, EVICTION_NAMES, EngineConfig


def add_policy_args(group: argparse._ArgumentGroup, defaults: EngineConfig) -> None:
    """``--l1-eviction``, ``--l2-disk-eviction``, ``--l2-{disk,redis}-admission`` and
    ``--l2-admission-window`` (``EngineConfig``'s fields of the same names)."""
    for flag, default, what in (
        ("--l1-eviction", defaults.l1_eviction, "L1"),
        ("--l2-disk-eviction", defaults.l2_disk_eviction, "the disk tier"),
    ):
        group.add_argument(
            flag, choices=EVICTION_NAMES, default=default,
            help=f"which chunk leaves {what} first: lru, or s3fifo (one-hit chunks leave "
            "before reused ones; docs/operator-guide.md) (default %(default)s)",
        )  # fmt: skip
    for flag, default, what in (
        ("--l2-disk-admission", defaults.l2_disk_admission, "disk tier"),
        ("--l2-redis-admission", defaults.l2_redis_admission, "Redis tier"),
    ):
        group.add_argument(
            flag, choices=ADMISSION_NAMES, default=default,
            help=f"which stored chunks the {what} takes: always, second-hit (on a chunk's "
            "second store or hit), tinylfu (more frequent than what it would evict) "
            "(default %(default)s)",
        )  # fmt: skip
    group.add_argument(
        "--l2-admission-window", type=int, default=defaults.l2_admission_window, metavar="CHUNKS",
        help="distinct chunks an admission policy remembers (default %(default)s)",
    )  # fmt: skip


__all__ = ["add_policy_args"]

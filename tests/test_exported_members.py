"""The public surface: every name in ``kvcache.__all__`` resolves, and importing the
package does not drag in the daemon's or the observability side's dependencies."""

from __future__ import annotations

import subprocess
import sys

import kvcache


def test_all_names_resolve_and_are_sorted() -> None:
    assert list(kvcache.__all__) == sorted(kvcache.__all__)
    for name in kvcache.__all__:
        assert getattr(kvcache, name) is not None, name


def test_public_classes_report_the_package_as_module() -> None:
    assert kvcache.CacheContext.__module__ == "kvcache"
    assert repr(kvcache.KVFormat.NL_X_NB_BS_HS).startswith("<KVFormat")


def test_import_is_light() -> None:
    code = (
        "import sys, kvcache\n"
        "heavy = {'msgspec', 'zmq', 'prometheus_client', 'opentelemetry', 'redis'}\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_unknown_attribute_raises() -> None:
    try:
        kvcache.does_not_exist  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as err:
        assert "does_not_exist" in str(err)
    else:
        raise AssertionError("expected AttributeError")

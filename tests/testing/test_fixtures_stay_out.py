"""The Redis fixtures in ``kvcache.testing`` start real servers; they exist for tests and benches.

A product module that imported one would ship a process-spawning helper on the data path, so this
test reads every module's imports (syntax only, nothing is executed) and allows only the benches
and the testing package itself to name them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvcache

PACKAGE = Path(kvcache.__file__).parent
FIXTURES = ("kvcache.testing.redis_local", "kvcache.testing.redis_cluster_local")
ALLOWED = ("bench", "testing")


def _imported(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_product_code_never_imports_the_redis_fixtures() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in ALLOWED:
            continue
        imported = _imported(ast.parse(path.read_text(), str(path)))
        named = sorted(name for name in imported if name.startswith(FIXTURES))
        offenders += [f"{path.relative_to(PACKAGE)}: {name}" for name in named]
    assert not offenders


def test_the_fixtures_live_in_the_testing_package() -> None:
    assert all((PACKAGE / "testing" / f"{name.rsplit('.', 1)[1]}.py").is_file() for name in FIXTURES)
    assert not list((PACKAGE / "storage").rglob("*_local.py"))

"""The dependency rules of docs/architecture.md, read off every source file's imports: the client and the gateway
never reach into the router, `mii_async` loads `workers`/`kernels` only lazily, the workers know the router only
through the wire contracts, the kernels know nothing above them, and the engine's core imports no torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
# Source folder → the package it installs as (pyproject's package-dir).
TREES = {"mii_async": "mii_async", "workers": "mii_async.workers", "kernels": "mii_async.kernels"}


class Import(NamedTuple):
    module: str          # the importing module, dotted
    target: str          # the imported module (or the package of `from pkg import name`), dotted, absolute
    top_level: bool      # executed at import time (not inside a function)
    line: int


def _module_name(path: Path) -> tuple[str, bool]:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts.pop()
    parts[0] = TREES[parts[0]]
    return ".".join(parts), is_pkg


def _imports() -> list[Import]:
    found = []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            module, is_pkg = _module_name(path)
            package = module if is_pkg else module.rpartition(".")[0]
            tree_ast = ast.parse(path.read_text(), str(path))
            top = {id(n) for n in tree_ast.body}
            top |= {id(n) for stmt in tree_ast.body if isinstance(stmt, (ast.If, ast.Try))
                    for n in ast.walk(stmt)}
            for node in ast.walk(tree_ast):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = package.split(".")[: len(package.split(".")) - node.level + 1]
                        targets = [".".join(base + ([node.module] if node.module else []))]
                    else:
                        targets = [node.module or ""]
                else:
                    continue
                for target in targets:
                    found.append(Import(module, target, id(node) in top, node.lineno))
    return found


def _under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _violations(importer: tuple[str, ...], targets: tuple[str, ...], top_level_only: bool = False,
                exempt: tuple[str, ...] = ()) -> list[str]:
    return [f"{i.module}:{i.line} imports {i.target}" for i in _imports()
            if _under(i.module, *importer) and not _under(i.module, *exempt) and _under(i.target, *targets)
            and (i.top_level or not top_level_only)]


CLIENT = ("mii_async.api", "mii_async.async_client", "mii_async.client_connection", "mii_async.local_pipeline",
          "mii_async.outputs", "mii_async.params", "mii_async.gateway")


def test_the_scan_sees_the_imports_it_judges():
    """The rules below hold because the scan reads real imports, not because it reads none."""
    imports = _imports()
    assert any(i.module == "mii_async.router.encoder_pool" and i.target == "mii_async.text.prompts" for i in imports)
    assert any(i.module == "mii_async.workers.engine" and _under(i.target, "mii_async.workers.core")
               for i in imports)
    assert _violations(("mii_async.router",), ("mii_async.text",)), "the router does use the text layer"


def test_the_client_and_the_gateway_do_not_import_the_router():
    assert _violations(CLIENT, ("mii_async.router",)) == []


def test_mii_async_loads_workers_and_kernels_only_lazily():
    bad = _violations(("mii_async",), ("mii_async.workers", "mii_async.kernels"), top_level_only=True,
                      exempt=("mii_async.workers", "mii_async.kernels"))
    assert bad == []


def test_the_workers_know_the_router_only_through_the_wire():
    assert _violations(("mii_async.workers",), ("mii_async.router", "mii_async.gateway")) == []


def test_the_kernels_know_nothing_above_them():
    assert _violations(("mii_async.kernels",), ("mii_async",), exempt=()) == \
        _violations(("mii_async.kernels",), ("mii_async.kernels",))


def test_the_text_layer_sits_below_the_processes():
    assert _violations(("mii_async.text",), ("mii_async.router", "mii_async.gateway", "mii_async.workers",
                                             "mii_async.kernels", "mii_async.async_client")) == []


def test_the_engine_core_imports_no_torch():
    assert _violations(("mii_async.workers.core",), ("torch", "numpy", "cupy")) == []


def test_import_mii_async_pulls_in_neither_torch_nor_cupy():
    code = "import sys, mii_async; print(sorted(m for m in ('torch', 'cupy') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[]"]

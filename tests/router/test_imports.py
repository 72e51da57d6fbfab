"""The router's module graph, read off the source: no module imports another that imports it back (type-only
imports included), and the core and its parts hold no socket (no zmq, no transport)."""
from __future__ import annotations

import ast
from pathlib import Path

ROUTER = Path(__file__).resolve().parents[2] / "mii_async" / "router"
SOCKETLESS = ("core", "requests", "admission", "balancer", "deltas", "token_events")


def _imports() -> dict[str, set[str]]:
    """Router module → the absolute modules it imports (anywhere in the file)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(ROUTER.glob("*.py")):
        name = path.stem
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ["mii_async", "router"][: 3 - node.level] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                found.add(module)
                if not node.module:                       # `from . import x`: x is a module
                    found |= {f"{module}.{a.name}" for a in node.names}
        graph[name] = found
    return graph


def _router_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    prefix = "mii_async.router."
    return {m: {t[len(prefix):].split(".")[0] for t in targets if t.startswith(prefix)} & set(graph) - {m}
            for m, targets in graph.items()}


def test_the_scan_reads_the_imports():
    edges = _router_edges(_imports())
    assert "core" in edges["server"] and "requests" in edges["core"]


def test_router_modules_import_each_other_without_a_cycle():
    edges = _router_edges(_imports())
    state: dict[str, str] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for n in sorted(edges[m]):
            assert state.get(n) != "open", f"import cycle: {' -> '.join(path + [m, n])}"
            if n not in state:
                visit(n, path + [m])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [])


def test_the_core_holds_no_socket():
    graph = _imports()
    for m in SOCKETLESS:
        bad = {t for t in graph[m] if t == "zmq" or t.startswith("zmq.") or t == "mii_async.transport"}
        assert not bad, f"router.{m} imports {sorted(bad)}"

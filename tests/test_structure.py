"""The package's shape: no import cycle (TYPE_CHECKING imports included), no
hand-written module over 700 lines, and fg.Peer's public surface exactly
the collectives, start and close."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ferrogrpc as fg
from tests.helpers import ROOT

pytestmark = pytest.mark.timeout(60)

PACKAGE = ROOT / "ferrogrpc"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name.endswith("_pb2.py"):
            continue
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every package module ``name`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # ``from . import wire`` imports a module; ``from .wire import
            # decode`` imports from one.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        for target in targets:
            # The longest known module the target names.
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def test_no_import_cycle_inside_the_package() -> None:
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(name, path, known) for name, path in modules.items()}
    # The package's __init__ re-exports; it may import anything, and nothing
    # inside imports it.
    graph.pop("ferrogrpc")
    for deps in graph.values():
        assert "ferrogrpc" not in deps
    assert (
        "ferrogrpc.algorithms.ring" in graph["ferrogrpc.runtime.engine"]
    )  # the parser sees imports
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep) :], dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


# The layers, lowest first: a module may import its own room (its sub-package;
# for a module at the root, the root modules of its layer) and any room of a
# lower layer, never another room of its own layer or one above. Every
# module of the package is in exactly one room.
LAYERS: list[set[str]] = [
    {"v1"},  # the wire schema (generated from proto/)
    # shared names: errors, reduce ops, option types, the counter, the
    # lifecycle, the one-shot import hook
    {"errors", "ops", "options", "counter", "lifecycle", "import_hook"},
    {"transport"},  # gRPC streams, auth, the wire framing, integrity
    {"env"},  # the environment, read once
    # policy and watchdog; same-host plane; rendezvous; what a rank saw
    {"failure", "samehost", "control", "observe"},
    {"algorithms"},  # how one collective runs
    {"runtime"},  # the engine, the peer, the backend, joining
    {"elastic"},  # groups whose membership changes: epochs, the joiners' state
    {"wrappers"},  # DDP, FSDP, the torch process group
    {"startup"},  # init_backend: a fixed group or an elastic one
    {"", "cli", "testing"},  # the package's front: its __init__, the command, test helpers
]
LONGEST_CHAIN = 12
MAX_LINES = 700


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer_of() -> dict[str, int]:
    return {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def test_every_module_imports_only_its_room_and_lower_layers() -> None:
    layer = _layer_of()
    graph = _graph()
    unplaced = sorted({_room(m) for m in graph} - set(layer))
    assert not unplaced, f"rooms in no layer: {unplaced}"
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}

    def allowed(module: str, dep: str) -> bool:
        mine, theirs = _room(module), _room(dep)
        if layer[theirs] < layer[mine]:
            return True
        if mine in packages or theirs in packages:
            return mine == theirs  # inside one sub-package
        return layer[theirs] == layer[mine]  # root modules of one layer

    wrong = [
        f"{module} ({_room(module) or 'front'}, layer {layer[_room(module)]}) imports {dep} "
        f"({_room(dep) or 'front'}, layer {layer[_room(dep)]})"
        for module, deps in sorted(graph.items())
        for dep in sorted(deps)
        if not allowed(module, dep)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_longest_import_chain_is_short() -> None:
    graph = _graph()
    longest: dict[str, list[str]] = {}

    def chain(module: str) -> list[str]:
        if module not in longest:
            below = [chain(dep) for dep in graph[module]]
            longest[module] = [module, *max(below, key=len, default=[])]
        return longest[module]

    worst = max((chain(m) for m in graph), key=len)
    assert len(worst) <= LONGEST_CHAIN, " -> ".join(worst)


def test_rooms_have_a_size_a_reader_can_hold() -> None:
    modules = _modules()
    sizes = {name: len(p.read_text().splitlines()) for name, p in modules.items()}
    assert max(sizes.values()) <= MAX_LINES, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
    root = [p for p in PACKAGE.glob("*.py")]
    packages = [p for p in PACKAGE.iterdir() if (p / "__init__.py").is_file() and p.name != "v1"]
    assert len(root) <= 15, sorted(p.name for p in root)
    assert len(packages) >= 4, packages


def test_the_library_never_looks_at_main() -> None:
    offenders = [
        name
        for name, path in _modules().items()
        if 'sys.modules.get("__main__")' in path.read_text()
        or 'sys.modules["__main__"]' in path.read_text()
        or "__main__.__spec__" in path.read_text()
    ]
    assert not offenders, offenders


def test_the_programs_are_not_installed_as_packages(tmp_path: Path) -> None:
    # Outside the checkout, only ferrogrpc imports: client/ and server/ are
    # the programs' folders, never top-level packages of the install.
    code = (
        "import importlib.util\n"
        "assert importlib.util.find_spec('ferrogrpc') is not None\n"
        "print(importlib.util.find_spec('client'), importlib.util.find_spec('server'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None None", out.stdout


def test_peer_public_surface_is_the_collectives_start_and_close() -> None:
    public = {name for name in dir(fg.Peer) if not name.startswith("_")}
    assert public == {
        "start",
        "close",
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "broadcast",
        "barrier",
        "all_to_all_single",
        # point to point
        "send",
        "recv",
        "recv_any",
        # read-only identity, as on Backend
        "rank",
        "world_size",
        "address",
        "data_path",
    }, public


def test_the_architecture_doc_names_every_module() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = [
        str(path.relative_to(ROOT))
        for path in _modules().values()
        if str(path.relative_to(ROOT)) not in text
    ]
    assert not missing, missing

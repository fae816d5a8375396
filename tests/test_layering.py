"""pareprop's modules import only downward, in a fixed layer order, and never in a circle.

The order (lowest first; README "Layout" is the same map):

    engine -> distributed -> layers -> models -> convert -> catalog -> memory
    -> checkpoint, data, pretrained -> bench, trainer, evaluate -> pareprop (the public API)
    -> cli

A module may import its own layer or a lower one. Every import counts, including those inside
functions (which once hid two import circles); importing ``pareprop.a.b`` also runs the
package ``pareprop.a``'s ``__init__``, so it counts as an import of that package too (as Python
runs it). A function-local import of a pareprop module is refused outright: a function-local
import is only for an optional or heavy third-party module (matplotlib, FakeTensor, FSDP...).
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re
from typing import Dict, List, Set, Tuple

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "pareprop"

# Lowest first. A name stands for a module or a package (with every module inside it).
LAYERS: List[Tuple[str, ...]] = [
    # The core: imports nothing of pareprop above it (chunking: the contract a block's branches
    # split by; devices: the device names a run takes).
    ("pareprop.engine", "pareprop.chunking", "pareprop.devices"),
    # Built on the engine alone: testing engines against autograd, multi-process training and
    # sharding (distributed).
    ("pareprop.engine.testing", "pareprop.distributed"),
    ("pareprop.layers",),
    ("pareprop.models",),
    # Pretrained models rewired as reversible ones: the coupling, the precision guard, one
    # module per source family (each registers its named model, as pareprop.models does).
    ("pareprop.convert",),
    ("pareprop.catalog",),  # a name (pareprop's or timm's) -> a model, its inputs and facts
    ("pareprop.memory",),  # measuring and planning memory, the memory budget, drift
    # checkpoint: pareprop checkpoint directories; pretrained: published weights.
    # data: the data config, image and video data sets, COCO-format detection data.
    ("pareprop.checkpoint", "pareprop.data", "pareprop.pretrained"),
    # Detectors: torchvision's, on the models' trunks through feature pyramids; their COCO AP
    # and pictures.
    ("pareprop.detection",),
    ("pareprop.bench", "pareprop.trainer", "pareprop.evaluate", "pareprop.evaluate_detection"),
    ("pareprop",),  # __init__.py: the public API, re-exported
    ("pareprop.cli", "pareprop.__main__"),
]


def _module_names() -> Dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _module_names()

# Inside the engine package, one concern a module, in the order a reader meets them (lowest
# first): each imports only modules before it here; the package's __init__ (last) names the
# public surface.
ENGINE_ORDER: List[str] = [
    "pareprop.engine.chunk_cost",  # how many chunks a branch runs in, and what a chunk costs
    "pareprop.engine.block",  # ReversibleBlock, the skip scale
    "pareprop.engine.fallback",  # PaReprop's fallback to Reprop when it measures slower
    "pareprop.engine.sharding",  # what the engine asks of a sharded stack (BlockSharding)
    "pareprop.engine.replay",  # state captured in forward, replayed in recomputation
    "pareprop.engine.plan",  # what forward leaves for backward
    "pareprop.engine.forward",  # the coupling, every call of F and G checked
    "pareprop.engine.rebuild",  # recover and grads of one block, stored blocks
    "pareprop.engine.chunked",  # the same a chunk at a time, and the chunked forward
    "pareprop.engine.lanes",  # PaReprop's two lanes and the parameter aliases on them
    "pareprop.engine.backward",  # Reprop's and PaReprop's order of recover and grads
    "pareprop.engine.function",  # the autograd Function
    "pareprop.engine.graphs",  # a stack's training step captured as CUDA graphs
    "pareprop.engine.stack",  # ReversibleStack and the model-wide setters
    "pareprop.engine.testing",  # every engine against autograd: outputs and every gradient
    "pareprop.engine.compile",  # torch.compile of every block's branches
    "pareprop.engine.recompute",  # checkpointing the blocks that are not reversible
    "pareprop.engine",
]


# Inside the trainer package, the same rule: one job a module, in the order a run meets them.
TRAINER_ORDER: List[str] = [
    "pareprop.trainer.finetune",  # fine-tuning: conversion options, initial weights
    "pareprop.trainer.config",  # TrainConfig and its checks
    "pareprop.trainer.report",  # the run's messages and metrics.jsonl
    "pareprop.trainer.rundir",  # the run directory's contents, lock and saved config
    "pareprop.trainer.directory",  # which run directory a run writes, and claiming it
    "pareprop.trainer.setup",  # device, model and data, engine, loaders, optimizer
    "pareprop.trainer.state",  # the training state a checkpoint saves, and resuming it
    "pareprop.trainer.loop",  # a micro-batch, an optimizer step, an epoch, an evaluation
    "pareprop.trainer.detection",  # the same for a detector (--task detection)
    "pareprop.trainer.run",  # Trainer: the set-up steps in order, then the epochs; train
    "pareprop.trainer",
]


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _layer(name: str) -> int:
    best, index = "", None
    for i, names in enumerate(LAYERS):
        for prefix in names:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
                best, index = prefix, i
    assert index is not None, f"{name} is in no layer of tests/test_layering.py: place it"
    return index


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, node: ast.AST) -> List[str]:
    """The pareprop modules an import statement runs, as Python runs them."""
    if isinstance(node, ast.Import):
        named = [a.name for a in node.names]
    else:
        base = _resolve(module, node)
        # ``from pkg import name``: a submodule when ``pkg.name`` is one, else an attribute.
        named = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                 for a in node.names]
    out = []
    for name in named:
        if name != "pareprop" and not name.startswith("pareprop."):
            continue
        parts = name.split(".")
        while ".".join(parts) not in MODULES:  # ``import pareprop.x.attr`` -> pareprop.x
            parts.pop()
        # Each package on the way runs its __init__ -- except pareprop itself, which runs
        # before anything, and the packages that hold the importing module (already running).
        for i in range(2, len(parts) + 1):
            target = ".".join(parts[:i])
            if module == target or module.startswith(target + "."):
                continue
            if i < len(parts) or target != module:
                out.append(target)
        if name == "pareprop":
            out.append("pareprop")
    return list(dict.fromkeys(out))


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
    # Parsed once for the whole module: every check walks the same sources.
    return ast.parse(path.read_text(), str(path))


@functools.cache
def _imports() -> Tuple[Dict[str, Set[str]], List[str]]:
    """Import graph of pareprop's modules, and the function-local imports of pareprop."""
    graph: Dict[str, Set[str]] = {m: set() for m in MODULES}
    local: List[str] = []
    for module, path in MODULES.items():
        tree = _tree(path)
        in_function = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                in_function.update(id(n) for n in ast.walk(fn) if n is not fn)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = _targets(module, node)
            graph[module].update(targets)
            if targets and id(node) in in_function:
                local.append(f"{path.relative_to(SRC)}:{node.lineno} imports {targets[-1]}")
    return graph, local


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One circle through each strongly connected group of modules (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    groups: List[Set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    circles = []
    for group in groups:  # the shortest way back to the start, for a readable message
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        circle = None
        while frontier and circle is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & group):
                    if w == start:
                        circle = paths[v] + [start]
                        break
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if circle:
                    break
            frontier = nxt
        circles.append(circle or sorted(group))
    return circles


def _tangles(graph: Dict[str, Set[str]]) -> List[str]:
    out = []
    for circle in _cycles(graph):
        group = _group_of(graph, circle[0])
        out.append(" -> ".join(circle) + f"\n    ({len(group)} modules in this tangle: "
                   + ", ".join(sorted(group)) + ")")
    return out


def _group_of(graph: Dict[str, Set[str]], start: str) -> Set[str]:
    def reach(g: Dict[str, Set[str]]) -> Set[str]:
        seen, todo = {start}, [start]
        while todo:
            for w in g[todo.pop()]:
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    reverse: Dict[str, Set[str]] = {v: set() for v in graph}
    for v, ws in graph.items():
        for w in ws:
            reverse.setdefault(w, set()).add(v)
    return reach(graph) & reach(reverse)


def test_every_module_has_a_layer():
    for name in MODULES:
        _layer(name)


def test_no_import_circle():
    tangles = _tangles(_imports()[0])
    assert not tangles, "import circles among pareprop's modules:\n" + "\n".join(tangles)


def test_imports_only_go_down():
    graph, _ = _imports()
    upward = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
              for m in sorted(graph) for t in sorted(graph[m]) if _layer(t) > _layer(m)]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_function_local_import_of_pareprop():
    _, local = _imports()
    assert not local, (
        "function-local imports of pareprop modules (import at the top; a function-local "
        "import is for an optional or heavy third-party module only):\n" + "\n".join(local))


def _check_order(package: str, order: List[str], name: str) -> None:
    modules = sorted(m for m in MODULES if _unit(m) == package)
    assert modules == sorted(order), (
        f"place every module of {package} in {name} (tests/test_layering.py): "
        f"unplaced {sorted(set(modules) - set(order))}, "
        f"gone {sorted(set(order) - set(modules))}")
    graph, _ = _imports()
    rank = {m: i for i, m in enumerate(order)}
    upward = [f"{m} imports {t}" for m in order for t in sorted(graph[m])
              if t in rank and rank[t] >= rank[m]]
    assert not upward, (f"{package} modules importing their own or a later module of "
                        f"{name}:\n" + "\n".join(upward))


def test_engine_modules_keep_their_order():
    _check_order("pareprop.engine", ENGINE_ORDER, "ENGINE_ORDER")


def test_trainer_modules_keep_their_order():
    _check_order("pareprop.trainer", TRAINER_ORDER, "TRAINER_ORDER")


def _unit(name: str) -> str:
    # A top-level module or package: pareprop.bench.measure -> pareprop.bench.
    return ".".join(name.split(".")[:2])


def test_no_import_of_another_packages_private_names():
    # ``from pareprop.layers._config import make_config`` in models/, or a ``_name`` of another
    # package: what a package keeps private is for its own modules.
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(module, node)
                named = [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            else:
                continue
            for name in named:
                parts = name.split(".")
                if parts[0] != "pareprop" or _unit(name) == _unit(module):
                    continue
                if any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} imports {name}")
    assert not found, "imports of another package's private names:\n" + "\n".join(found)


def _engine_private_attributes() -> Set[str]:
    # ``self._name = ...`` inside pareprop.engine: the state its objects keep to themselves.
    names = set()
    for module, path in MODULES.items():
        if _unit(module) != "pareprop.engine":
            continue
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                names.add(node.attr)
    return names


def test_no_reach_into_the_engines_private_attributes():
    # ``stack._sharding = ...`` in fsdp.py, ``block._skip_scale_value`` in coupling.py: what
    # another package needs of a stack or a block is public (stack.sharding, stack.probe,
    # skip_scale_value, debug_reconstruction(None)).
    private = _engine_private_attributes()
    assert "_debug_tolerance" in private  # the scan sees the stack's private state
    found = []
    for module, path in MODULES.items():
        if _unit(module) == "pareprop.engine":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{path.relative_to(SRC)}:{node.lineno} reaches {node.attr}")
    assert not found, ("private attributes of the engine's objects used outside "
                       "pareprop.engine:\n" + "\n".join(found))


def test_the_guard_sees_a_circle_and_an_upward_import():
    graph = {"pareprop.engine": {"pareprop.memory.budget"},
             "pareprop.memory.budget": {"pareprop.engine"}}
    assert _cycles(graph) == [["pareprop.engine", "pareprop.memory.budget", "pareprop.engine"]]
    assert _layer("pareprop.memory.budget") > _layer("pareprop.engine")
    assert _layer("pareprop.memory.plan") == _layer("pareprop.memory.budget")
    tree = ast.parse("from pareprop.memory.saved import storage_key")
    assert _targets("pareprop.checkpoint", tree.body[0]) == [
        "pareprop.memory", "pareprop.memory.saved"]
    tree = ast.parse("from pareprop.models import vit")
    assert _targets("pareprop.models._registry", tree.body[0]) == ["pareprop.models.vit"]


# -- the shape of the house: few modules at the top, short functions, narrow engine calls --

TOP_MODULES_AT_MOST = 8  # besides __init__ and __main__; every other module lives in a package
FUNCTION_LINES_AT_MOST = 80  # a function's body, its docstring left out
ENGINE_PARAMETERS_AT_MOST = 8


def test_few_modules_at_the_top():
    top = sorted(m for m, path in MODULES.items()
                 if m.count(".") == 1 and path.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= TOP_MODULES_AT_MOST, (
        f"{len(top)} modules at the top of pareprop (at most {TOP_MODULES_AT_MOST}): "
        f"{', '.join(top)}; put a new module in the package of its concern")


def _functions() -> List[Tuple[str, ast.FunctionDef]]:
    out = []
    for module, path in MODULES.items():
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((module, node))
    return out


def _body_lines(fn: ast.FunctionDef) -> int:
    body = fn.body
    first = body[0]
    has_doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
               and isinstance(first.value.value, str))
    start = first.end_lineno + 1 if has_doc and len(body) > 1 else first.lineno
    return fn.end_lineno - start + 1


def _parameters(fn: ast.FunctionDef) -> int:
    a = fn.args
    return (len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
            + (a.vararg is not None) + (a.kwarg is not None))


def test_no_long_function():
    long = [f"{m}.{fn.name} (line {fn.lineno}): {_body_lines(fn)} lines"
            for m, fn in _functions() if _body_lines(fn) > FUNCTION_LINES_AT_MOST]
    assert not long, (f"functions over {FUNCTION_LINES_AT_MOST} lines (docstring left out); "
                      "split them into steps:\n" + "\n".join(long))


def test_no_wide_engine_function():
    wide = [f"{m}.{fn.name} (line {fn.lineno}): {_parameters(fn)} parameters"
            for m, fn in _functions()
            if _unit(m) == "pareprop.engine" and _parameters(fn) > ENGINE_PARAMETERS_AT_MOST]
    assert not wide, (f"engine functions with more than {ENGINE_PARAMETERS_AT_MOST} parameters; "
                      "group what travels together:\n" + "\n".join(wide))


def test_the_shape_checks_see_a_long_and_a_wide_function():
    tree = ast.parse("def f(a, b, c, d, e, f, g, h, i):\n    '''doc'''\n"
                     + "    x = 1\n" * (FUNCTION_LINES_AT_MOST + 1))
    fn = tree.body[0]
    assert _body_lines(fn) == FUNCTION_LINES_AT_MOST + 1
    assert _parameters(fn) == ENGINE_PARAMETERS_AT_MOST + 1


ROOT = SRC.parent
# How the project was made is not what its code and docs say: no issue numbers, no sessions.
_HISTORY = re.compile(r"\bissues? \d+|\bsessions? \d+|\bthis session\b", re.IGNORECASE)


def test_no_history_in_code_and_docs():
    paths = [*PACKAGE.rglob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md",
             ROOT / "BENCHMARKS.md"]
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}"
             for p in paths for i, line in enumerate(p.read_text().splitlines(), 1)
             if _HISTORY.search(line)]
    assert not found, ("issue numbers or session talk (say why, not how the work went; dates "
                       "and commits are fine):\n" + "\n".join(found))
    assert _HISTORY.search("Until issue 38 the count") and not _HISTORY.search("issue_31")

"""tandem's packages import one way: each imports only from the floors below it and its own,
and no two modules import each other, however indirectly (the module graph is read from every
import statement, lazy ones in functions included)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Bottom to top. Packages on one floor do not import each other.
FLOORS = [
    {"tandem_core"},
    {"workers", "diffusion_plugin"},
    {"gateway"},
    {"tandem_tools"},
]
FLOOR = {pkg: i for i, floor in enumerate(FLOORS) for pkg in floor}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, here: str | None = None) -> set[str]:
    """The tandem modules ``path`` imports (``from pkg import mod`` counts as ``pkg.mod`` when
    ``pkg/mod`` is a module; otherwise as ``pkg``)."""
    here = here or module_name(path)
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = here.split(".")[: len(here.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parent + ([base] if base else []))
            names = [f"{base}.{a.name}" if resolve(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in FLOOR}
    return {resolve(n) or n for n in found}


def resolve(name: str) -> str | None:
    """The module file a dotted name refers to (the name itself), or None if it is not one."""
    path = ROOT.joinpath(*name.split("."))
    return name if path.with_suffix(".py").exists() or (path / "__init__.py").exists() else None


def graph() -> dict[str, set[str]]:
    files = [p for pkg in FLOOR for p in (ROOT / pkg).rglob("*.py")]
    assert len(files) > 40, "the packages were not found"
    return {module_name(p): imports_of(p) - {module_name(p)} for p in files}


def wrong_arrows(g: dict[str, set[str]]) -> list[str]:
    wrong = []
    for mod, deps in sorted(g.items()):
        pkg = mod.split(".")[0]
        for dep in sorted(deps):
            other = dep.split(".")[0]
            if other != pkg and FLOOR[other] >= FLOOR[pkg]:
                wrong.append(f"{mod} -> {dep} ({other} is not below {pkg})")
    return wrong


def cycles_of(g: dict[str, set[str]]) -> list[str]:
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(g.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for mod in sorted(g):
        if mod not in state:
            visit(mod, [mod])
    return cycles


def test_every_import_points_down_or_sideways_within_its_package():
    wrong = wrong_arrows(graph())
    assert not wrong, "imports that point up or across:\n" + "\n".join(wrong)


def test_no_import_cycles():
    cycles = cycles_of(graph())
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("module", ["step/runner", "step/rows", "family", "batcher/memory", "batcher/scheduler"])
def test_the_step_reaches_a_model_family_only_through_the_family_interface(module):
    """``diffusion_plugin.family.Family`` is the boundary: the runner, the row state and the
    planners import no family module (``families.ADAPTERS`` picks the implementation)."""
    deps = imports_of(ROOT / "diffusion_plugin" / f"{module}.py")
    assert not {d for d in deps if d.startswith("diffusion_plugin.families")}, sorted(deps)


# The diffusion engine's folders are the stages a request passes through; a stage imports only
# the stages below it (the engine, its args and the family protocol sit at the top level).
STAGE_BELOW = {"batcher": set(), "step": {"batcher"}, "api": {"batcher", "step"},
               "families": {"batcher", "step"}}


def test_the_diffusion_engine_is_laid_out_by_stage():
    top = {p.stem for p in (ROOT / "diffusion_plugin").glob("*.py")}
    assert top == {"__init__", "engine", "engine_args", "family"}, f"modules outside a stage's folder: {top}"
    wrong = []
    for mod, deps in graph().items():
        parts = mod.split(".")
        if parts[0] != "diffusion_plugin" or len(parts) < 3 or parts[1] not in STAGE_BELOW:
            continue
        for dep in deps:
            d = dep.split(".")
            if d[0] == "diffusion_plugin" and len(d) > 2 and d[1] in STAGE_BELOW and d[1] != parts[1] \
                    and d[1] not in STAGE_BELOW[parts[1]]:
                wrong.append(f"{mod} -> {dep}")
    assert not wrong, "a stage imports one above or beside it:\n" + "\n".join(sorted(wrong))


# The gateway's folders are the stages a request passes through, bottom to top; a stage imports
# only the stages below it. The composition's top (config, processes) sits at the package's root.
GATEWAY_STAGES = ["observability", "request", "admission", "routing", "fleet", "serving", "batches", "http"]
GATEWAY_TOP = {"__init__", "config", "processes"}
HTTP_LIBS = {"fastapi", "starlette", "uvicorn"}


def gateway_stage_arrows(g: dict[str, set[str]]) -> list[str]:
    wrong = []
    for mod, deps in g.items():
        parts = mod.split(".")
        if parts[0] != "gateway" or len(parts) < 3:
            continue
        for dep in deps:
            d = dep.split(".")
            if d[0] != "gateway" or d[1] == parts[1]:
                continue
            if len(d) < 3 or d[1] not in GATEWAY_STAGES:
                wrong.append(f"{mod} -> {dep} (the top of the gateway)")
            elif GATEWAY_STAGES.index(d[1]) > GATEWAY_STAGES.index(parts[1]):
                wrong.append(f"{mod} -> {dep} ({d[1]} is above {parts[1]})")
    return sorted(wrong)


def external_imports(path: Path) -> set[str]:
    """The top-level packages outside tandem that ``path`` imports (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_gateway_is_laid_out_by_stage():
    top = {p.stem for p in (ROOT / "gateway").glob("*.py")}
    assert top == GATEWAY_TOP, f"modules outside a stage's folder: {top - GATEWAY_TOP}"
    folders = {p.name for p in (ROOT / "gateway").iterdir() if (p / "__init__.py").exists()}
    assert folders == set(GATEWAY_STAGES), folders
    wrong = gateway_stage_arrows(graph())
    assert not wrong, "a gateway stage imports one above it:\n" + "\n".join(wrong)


def test_only_the_http_stage_imports_the_web_framework():
    """Everything below ``gateway/http/`` serves a request's record with no HTTP object (a batch
    line is served as a route's request is); ``processes`` (the top) starts the server."""
    wrong = {str(p.relative_to(ROOT)): sorted(external_imports(p) & HTTP_LIBS)
             for p in (ROOT / "gateway").rglob("*.py")
             if p.parent.name != "http" and p.stem not in GATEWAY_TOP and external_imports(p) & HTTP_LIBS}
    assert not wrong, wrong


@pytest.mark.parametrize(("module", "planted"), [
    ("gateway.request.envelope", "gateway.routing.router"),  # the request record reaching up to routing
    ("gateway.observability.metrics", "gateway.batches.store"),
    ("gateway.routing.router", "gateway.processes"),
])
def test_the_stage_rule_fails_on_a_planted_upward_import(module, planted):
    g = graph()
    g[module] = g[module] | {planted}
    assert any(w.startswith(f"{module} -> {planted}") for w in gateway_stage_arrows(g)), planted


def test_gateway_holds_no_tool():
    names = {p.stem for p in (ROOT / "gateway").rglob("*.py")}
    assert not names & {"bench", "bench_diffusion", "loadgen", "vllm_cli_shim", "cli"}, names


@pytest.mark.parametrize("bad", ["from gateway.http.app import build_app", "import tandem_tools.bench.main",
                                 "from diffusion_plugin.step import runner", "from workers import tiny_models"])
def test_the_checks_catch_a_wrong_arrow_and_a_cycle(tmp_path, bad):
    """The checks above can fail: a module of tandem_core or workers with a wrong import is
    reported, and so is a cycle (parsed from a file outside the tree, placed in the graph)."""
    probe = tmp_path / "probe.py"
    probe.write_text(bad + "\n")
    g = graph()
    g["tandem_core._probe"] = imports_of(probe, "tandem_core._probe")
    assert any(w.startswith("tandem_core._probe -> ") for w in wrong_arrows(g)), bad
    g = graph()
    g["workers.actor"] = g["workers.actor"] | {"workers._probe"}
    g["workers._probe"] = {"workers.actor"}
    assert any("workers._probe" in c for c in cycles_of(g))


RUNTIME = ("tandem_core", "workers", "diffusion_plugin", "gateway")  # what serves (tandem_tools: tools)
MAX_LINES = 400


def test_no_runtime_module_is_over_400_lines():
    big = {str(p.relative_to(ROOT)): n for pkg in RUNTIME for p in (ROOT / pkg).rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"runtime modules over {MAX_LINES} lines (split them by job): {big}"


def test_a_replica_state_is_assigned_only_by_its_state_machine():
    """``Replica.move_to`` (gateway/routing/replicas.py) is the one place a replica's state changes."""
    offenders = []
    for pkg in RUNTIME:
        for p in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text(), str(p))):
                targets = node.targets if isinstance(node, ast.Assign) else (
                    [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else [])
                for t in targets:
                    for sub in ast.walk(t):
                        if isinstance(sub, ast.Attribute) and sub.attr in ("state", "_state"):
                            where = f"{p.relative_to(ROOT)}:{node.lineno}"
                            if not (p.name == "replicas.py" and sub.attr == "_state"):
                                offenders.append(where)
    # Other objects have a `.state` too (Starlette's request.state...): only assignments of a
    # ReplicaState value count.
    offenders = [o for o in offenders if "ReplicaState" in _line(o)]
    assert not offenders, offenders


def _line(where: str) -> str:
    path, line = where.rsplit(":", 1)
    return (ROOT / path).read_text().splitlines()[int(line) - 1]


def test_tandem_tools_holds_the_product_apart_from_the_benchmarks():
    """The ``tandem`` command's own modules at the top of tandem_tools/; every benchmark and
    measuring tool in tandem_tools/bench/."""
    top = {p.stem for p in (ROOT / "tandem_tools").glob("*.py")}
    assert top == {"__init__", "cli", "config_doc", "run_batch", "serve_model", "vllm_cli_shim"}, top

"""The layout's rules (docs/architecture.md): no import cycle among the project's modules, imports inside
functions counted; imports only run down the layers (core < config < engines < store < run < stages < studies <
perf < api < cli < flows); the library never imports the Prefect wiring; no module imports another's private names;
at most five modules at the top of pipeline/, and every folder says what lives in it."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# a module's layer is its first path part below pipeline/ (or flows); imports may stay in a layer or go down
LAYERS = ["core", "config", "engines", "store", "run", "stages", "studies", "perf", "api", "cli", "flows"]


def _modules() -> dict[str, Path]:
    files = [*(REPO / "pipeline").rglob("*.py"), *(REPO / "flows").glob("*.py")]
    return {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p for p in files}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(imported project module, names taken from it), for every import of the file, inside functions too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing package
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in modules:
                    out.append((sub, []))
                elif base in modules:
                    out.append((base, [a.name]))
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {d for d, _ in _imports(m, p, modules) if d != m} for m, p in modules.items()}


def _layer(module: str) -> int:
    parts = module.split(".")
    if parts[0] == "flows":
        return LAYERS.index("flows")
    return LAYERS.index(parts[1]) if len(parts) > 1 else 0  # `pipeline` itself: a docstring and a version


def test_no_import_cycle_counting_imports_inside_functions():
    graph = _graph()
    # the graph is real: a top-level, a function-level and a relative import are all seen
    assert "flows.iterate" in graph["flows.serve"] and "pipeline.store" in graph["pipeline.run"]
    assert "pipeline.stages.parallel" in graph["pipeline.stages.train.stage"]
    assert "pipeline.engines.generation.base" in graph["pipeline.engines.generation.hf"]
    cycles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_imports_only_run_down_the_layers():
    up = sorted(f"{m} -> {d}" for m, ds in _graph().items() for d in ds if _layer(d) > _layer(m))
    assert up == []


def test_the_library_never_imports_the_wiring():
    assert sorted(f"{m} -> {d}" for m, ds in _graph().items() if m.startswith("pipeline")
                  for d in ds if d.startswith("flows")) == []


def test_no_module_imports_another_modules_private_names():
    modules = _modules()
    private = sorted(f"{m}: {d}.{n}" for m, p in modules.items() for d, names in _imports(m, p, modules)
                     for n in names if n.startswith("_") and not n.startswith("__"))
    assert private == []


def test_a_handful_of_modules_at_the_top_and_every_folder_says_what_it_holds():
    top = sorted(p.name for p in (REPO / "pipeline").glob("*.py"))
    assert len(top) <= 5, top
    folders = [p for p in (REPO / "pipeline").iterdir() if p.is_dir() and (p / "__init__.py").is_file()]
    assert {p.name for p in folders} >= {"core", "engines", "stages", "store", "studies", "perf"}
    silent = [p.name for p in folders if not ast.get_docstring(ast.parse((p / "__init__.py").read_text()))]
    assert silent == []


def test_the_design_travels_with_the_code():
    assert (REPO / "docs" / "design.md").is_file()
    files = [p for p in REPO.rglob("*") if p.suffix in (".py", ".md", ".yaml", ".sh") and ".venv" not in p.parts
             and ".git" not in p.parts and p != Path(__file__).resolve()]
    outside = sorted(str(p.relative_to(REPO)) for p in files
                     if "../shared" in p.read_text(errors="replace") or "DESIGN.md" in p.read_text(errors="replace"))
    assert outside == []


def test_architecture_names_every_file_of_the_layout():
    text = (REPO / "docs" / "architecture.md").read_text()
    files = [p.relative_to(REPO).as_posix()
             for p in [*(REPO / "pipeline").rglob("*.py"), *(REPO / "flows").glob("*.py")]
             if p.name != "__init__.py" or p.parent.name in ("stages", "store", "generation", "sandbox", "benchmarks")]
    # a file is named by its path, or by its name in a row that names its folder's first file by path
    missing = [f for f in files if f not in text and not (f.rsplit("/", 1)[0] + "/" in text
                                                          and f"`{f.rsplit('/', 1)[-1]}`" in text)]
    assert missing == []

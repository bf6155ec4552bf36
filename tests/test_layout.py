"""The layout's rules (docs/architecture.md): no import cycle among the project's modules, imports inside
functions counted; imports only run down the layers (core < config < engines < store < run < stages < studies <
perf < api < cli < flows); the library never imports the Prefect wiring; no module imports another's private names;
at most five modules at the top of pipeline/, and every folder says what lives in it; a value that lives beyond a few
lines is not named by one or two letters."""

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


# ---- names a newcomer reads ---------------------------------------------------------------------------------------

# a short name may live this many lines (first binding to last use) before it must be a word
SHORT_NAME_SPAN = 5
# short names that are words, or conventions every reader knows (and `e` or `ex` of an `except ... as e` clause,
# which Python unbinds at the clause's end)
SHORT_WORDS = {"_", "ok"}
EXCEPT_NAMES = {"e", "ex"}
# short names kept on purpose, module -> (names, why): maths that follows a paper's (or the field's) notation keeps
# its symbols, and an interface keeps the name its callers pass by keyword
KEPT_SHORT_NAMES = {
    "pipeline/core/curation.py": ({"m", "n", "t", "k"}, "SPOGW's m workflows a query, n-member groups, t kept at "
                                  "each end (the glossary's m, n, t); C(c, k) of the unranking"),
    "pipeline/core/grpo.py": ({"m", "w"}, "the loss's symbols beside its formula: m the KL mask, w the sequence "
                              "weights"),
    "pipeline/core/headroom.py": ({"d", "q"}, "d and q index the [design, query, run] arrays, as in the maths of the "
                                  "oracle and its budget"),
    "pipeline/engines/executors.py": ({"n"}, "an executor call's sample count: OpenAI's `n`, which `complete(..., n=)` "
                                      "takes by keyword from the sandbox's llm() calls"),
    "pipeline/engines/cache.py": ({"n"}, "the cached executor's `complete(..., n=)`, the executors' interface"),
    "pipeline/cli.py": ({"n", "lr", "L"}, "a CLI option's name: a typer command's parameter is its option "
                        "(`bench rollout --n`, `bench train-parity --lr`; `sample`'s L, `--l`, the paper's L of "
                        "Mean@L beside `api.sample(config, L)`)"),
    "pipeline/api.py": ({"L"}, "the public `sample(config, L, ...)` of docs/api.md: the paper's L (Mean@L, "
                        "workflows per query), which callers may pass by keyword"),
    "pipeline/perf/train_parity.py": ({"lr"}, "`run(..., lr=)`, the keyword of `pipeline bench train-parity --lr` "
                                      "and of its test, and the report's `lr`"),
    "pipeline/studies/smc.py": ({"t", "i", "k", "L"}, "BayesFlow's Algorithm 1 in the module doc's symbols: step t, "
                                "particle i, look-ahead rollout k; run_plain's L workflows a query (Mean@L), the name "
                                "pipeline.api.sample takes it by"),
}
_NEW_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef,
               ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _bound(target: ast.AST) -> list[ast.Name]:
    if isinstance(target, ast.Name):
        return [target]
    if isinstance(target, ast.Tuple | ast.List):
        return [n for element in target.elts for n in _bound(element)]
    return _bound(target.value) if isinstance(target, ast.Starred) else []


def _own_nodes(node: ast.AST):
    """The nodes of a function's own scope: nested functions, classes, lambdas and comprehensions left out
    (a nested function's decorators and defaults are evaluated in this scope and stay)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _NEW_SCOPES):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield from (d for d in [*child.decorator_list, *child.args.defaults, *child.args.kw_defaults] if d)
            continue
        yield child
        yield from _own_nodes(child)


def _rebinds(scope: ast.AST, name: str) -> bool:
    """Whether a nested scope has a `name` of its own (a parameter, a comprehension's target, an assignment)."""
    if isinstance(scope, ast.ClassDef):
        return False
    if isinstance(scope, ast.Lambda | ast.FunctionDef | ast.AsyncFunctionDef):
        arguments = scope.args
        if any(arg.arg == name for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                                           arguments.vararg, arguments.kwarg] if arg is not None):
            return True
        targets = [] if isinstance(scope, ast.Lambda) else list(ast.walk(scope))
    else:
        targets = [node for generator in scope.generators for node in ast.walk(generator.target)]
    return any(isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store) for node in targets)


def _uses(fn: ast.AST, name: str) -> list[int]:
    """The lines where `name` of `fn`'s scope occurs: in nested scopes too, unless they have a `name` of their own."""
    lines = []
    for child in ast.iter_child_nodes(fn):
        if isinstance(child, _NEW_SCOPES) and _rebinds(child, name):
            continue
        if isinstance(child, ast.Name) and child.id == name:
            lines.append(child.lineno)
        lines += _uses(child, name)
    return lines


def _long_lived_short_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[str, int, int]]:
    """(name, first line, span) of each name of one or two characters that the function binds (a parameter, an
    assignment, a for or with target, an except clause other than `e`/`ex`) and that lives more than
    SHORT_NAME_SPAN lines from its first binding to its last use (in nested functions too)."""
    arguments = fn.args
    bindings: dict[str, list[int]] = {}
    for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]:
        if arg is not None:
            bindings.setdefault(arg.arg, []).append(arg.lineno)
    for node in _own_nodes(fn):
        if isinstance(node, ast.Assign):
            names = [n for target in node.targets for n in _bound(target)]
        elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.NamedExpr | ast.For | ast.AsyncFor):
            names = _bound(node.target)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            names = _bound(node.optional_vars)
        elif isinstance(node, ast.ExceptHandler) and node.name and node.name not in EXCEPT_NAMES:
            bindings.setdefault(node.name, []).append(node.lineno)
            names = []
        else:
            names = []
        for name in names:
            bindings.setdefault(name.id, []).append(name.lineno)
    found = []
    for name, lines in bindings.items():
        if len(name) <= 2 and name not in SHORT_WORDS:
            span = max([*lines, *_uses(fn, name)]) - min(lines)
            if span > SHORT_NAME_SPAN:
                found.append((name, min(lines), span))
    return found


def _short_names_by_file() -> dict[str, list[str]]:
    flagged: dict[str, list[str]] = {}
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        file = path.relative_to(REPO).as_posix()
        allowed = KEPT_SHORT_NAMES.get(file, (set(), ""))[0]
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                flagged.setdefault(file, [])
                flagged[file] += [f"{file}:{line} {fn.name}: {name} lives {span} lines"
                                  for name, line, span in _long_lived_short_names(fn) if name not in allowed]
    return {file: names for file, names in flagged.items() if names}


def test_the_checker_sees_short_names_that_live_long():
    source = ("def f(items, n):\n    g = lambda x: x\n    y = 0\n    for i in items:\n        y += i\n\n\n\n"
              "    return y, n, g, [x for x in items]\n")
    found = {name for name, _, _ in _long_lived_short_names(ast.parse(source).body[0])}
    assert found == {"y", "n", "g"}  # i lives 1 line; the lambda's and the comprehension's x are their own
    brief = "def f(rows):\n    try:\n        pass\n    except OSError as e:\n\n\n\n\n\n        raise e\n"
    assert _long_lived_short_names(ast.parse(brief).body[0]) == []


def test_names_that_live_beyond_a_few_lines_are_words():
    assert [name for names in _short_names_by_file().values() for name in names] == []

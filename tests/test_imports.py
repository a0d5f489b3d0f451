"""Dependencies point one way. Reads every import with ``ast`` (nothing is imported), at
module level and inside functions alike:

* layers — ``dfvg_hw.spec`` (the contract) ← ``dfvg_hw`` (the RTL generator) ← ``boards`` ←
  ``dfvg_hw.build`` (the top build layer); ``dfvg_hw.spec`` ← ``sim`` (which may use the RTL,
  for the rtl devices) ← ``dfvg_host``. A layer imports only the layers below it and itself:

  ==============  ===============================================================
  layer           may import from the project
  ==============  ===============================================================
  dfvg_hw.spec    dfvg_hw.spec (and ``dfvg_hw/__init__.py``, which every import of
                  ``dfvg_hw.spec`` runs, keeps to the same rule)
  dfvg_hw         dfvg_hw.spec, dfvg_hw
  boards          dfvg_hw.spec, dfvg_hw, boards
  dfvg_hw.build   dfvg_hw.spec, dfvg_hw, boards
  sim             dfvg_hw.spec, dfvg_hw, sim
  dfvg_host       dfvg_hw.spec, sim, dfvg_host (the RTL only through sim's devices)
  benchmarks/,    anything in the packages
  scripts/
  ==============  ===============================================================

* third-party — ``dfvg_hw.spec`` imports the standard library and numpy only;
  ``dfvg_hw``, ``boards`` and ``sim`` import no torch, transformers, tokenizers or
  safetensors (the host's model stack);
* no import cycles between modules (the module graph is a DAG);
* no private cross-module imports (``from m import _name``, or ``m._name`` through an
  imported module) in the packages, benchmarks/ and scripts/; tests may look inside;
* benchmarks/ and scripts/ import no test module (``tests/*.py``) and do not put tests/
  on ``sys.path`` or load a file from it; what they share with the tests lives in a
  package (``dfvg_host.fixtures``).

Each failure lists ``file:line: the import — the rule it breaks``.
"""

from __future__ import annotations

import ast
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dfvg_hw", "boards", "sim", "dfvg_host")
TOOLS = ("benchmarks", "scripts")
ML_STACK = {"torch", "transformers", "tokenizers", "safetensors"}
SPEC_THIRD_PARTY = {"numpy"}

ALLOWED = {
    "dfvg_hw.spec": {"dfvg_hw.spec"},
    "dfvg_hw": {"dfvg_hw.spec", "dfvg_hw"},
    "boards": {"dfvg_hw.spec", "dfvg_hw", "boards"},
    "dfvg_hw.build": {"dfvg_hw.spec", "dfvg_hw", "boards", "dfvg_hw.build"},
    "sim": {"dfvg_hw.spec", "dfvg_hw", "sim"},
    "dfvg_host": {"dfvg_hw.spec", "sim", "dfvg_host"},
}


def layer(module: str) -> str | None:
    """The layer of a project module, ``tools`` for benchmarks/ and scripts/, else None."""
    if module == "dfvg_hw" or module == "dfvg_hw.spec" or module.startswith("dfvg_hw.spec."):
        return "dfvg_hw.spec"
    if module == "dfvg_hw.build":
        return "dfvg_hw.build"
    top = module.split(".")[0]
    if top in PACKAGES:
        return top
    return "tools" if top in TOOLS else None


@dataclass(frozen=True)
class Import:
    """One imported module (or name) of one file."""
    file: str            # relative to the repository root
    line: int
    text: str            # the import statement
    module: str          # the module it loads (a project module resolved to its file's module)
    name: str | None     # for ``from module import name`` when name is not itself a module

    def where(self) -> str:
        return f"{self.file}:{self.line}: `{self.text}`"


@dataclass
class Source:
    module: str
    path: Path
    rel: str             # the path relative to the repository root
    tree: ast.Module


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def load_sources(root: Path = ROOT) -> dict[str, Source]:
    files = [p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")]
    files += [p for tool in TOOLS for p in (root / tool).glob("*.py")]
    sources = {}
    for path in sorted(files):
        if "__pycache__" in path.parts:
            continue
        name = module_name(path, root)
        with warnings.catch_warnings():      # a file's own invalid escapes are not our concern
            warnings.simplefilter("ignore")
            tree = ast.parse(path.read_text(), filename=str(path))
        sources[name] = Source(name, path, path.relative_to(root).as_posix(), tree)
    return sources


def resolve(sources: dict[str, Source], name: str) -> str:
    """A dotted name's longest prefix that is a project module (else the name itself)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in sources:
            return candidate
    return name


def imports_of(src: Source, sources: dict[str, Source]) -> list[Import]:
    out = []
    is_package = src.path.name == "__init__.py"
    for node in ast.walk(src.tree):
        text = ast.unparse(node) if isinstance(node, (ast.Import, ast.ImportFrom)) else ""
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Import(src.rel, node.lineno, text, resolve(sources, alias.name), None))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = src.module.split(".")
                if not is_package:
                    package = package[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in sources:
                    out.append(Import(src.rel, node.lineno, text, full, None))
                else:
                    out.append(Import(src.rel, node.lineno, text, resolve(sources, base), alias.name))
    return sorted(out, key=lambda i: i.line)


def private_attribute_uses(src: Source, sources: dict[str, Source]) -> list[tuple[int, str, str]]:
    """(line, module, name) for every ``module._name`` through an imported project module."""
    bound: dict[str, str] = {}
    for node in ast.walk(src.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in sources:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    found = []
    for node in ast.walk(src.tree):
        if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in bound:
            continue
        dotted = ".".join([bound[value.id], *reversed(chain)])
        if dotted in sources and dotted != src.module:
            found.append((node.lineno, dotted, node.attr))
    return found


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def names_of_test_modules(root: Path = ROOT) -> set[str]:
    """Module names a file of tests/ would be imported under (conftest, test_x, helpers)."""
    return {p.stem for p in (root / "tests").rglob("*.py")} | {"tests"}


@pytest.fixture(scope="module")
def project():
    sources = load_sources()
    return sources, {m: imports_of(s, sources) for m, s in sources.items()}


def fail_with(problems: list[str], rule: str) -> None:
    problems = list(dict.fromkeys(problems))          # one line per import statement and rule
    if problems:
        message = f"{len(problems)} import(s) break the rule: {rule}\n" + "\n".join(problems)
        print(message)
        pytest.fail(message, pytrace=False)


# -- the checks -------------------------------------------------------------------------

def layer_violations(sources, imports) -> list[str]:
    problems = []
    for module, found in imports.items():
        own = layer(module)
        if own == "tools":
            continue
        for imp in found:
            target = layer(imp.module)
            if target is None or target == "tools" or imp.module == module:
                continue
            if target not in ALLOWED[own]:
                problems.append(f"{imp.where()} — {own} imports {imp.module} ({target}); "
                                f"{own} may import {', '.join(sorted(ALLOWED[own]))}")
    return problems


def third_party_violations(sources, imports) -> list[str]:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    problems = []
    for module, found in imports.items():
        own = layer(module)
        for imp in found:
            top = imp.module.split(".")[0]
            if layer(imp.module) is not None or top in stdlib:
                continue
            if own == "dfvg_hw.spec" and top not in SPEC_THIRD_PARTY:
                problems.append(f"{imp.where()} — dfvg_hw.spec imports {top}; it imports the "
                                f"standard library and {', '.join(sorted(SPEC_THIRD_PARTY))} only")
            elif own in ("dfvg_hw.spec", "dfvg_hw", "boards", "dfvg_hw.build", "sim") and top in ML_STACK:
                problems.append(f"{imp.where()} — {own} imports {top}; the model stack "
                                f"({', '.join(sorted(ML_STACK))}) belongs to dfvg_host")
    return problems


def cycles(imports) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing
    itself (Tarjan)."""
    graph = {m: sorted({i.module for i in found if i.module in imports}) for m, found in imports.items()}
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                components.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return components


def cycle_violations(sources, imports) -> list[str]:
    problems = []
    for component in cycles(imports):
        members = set(component)
        edges = [f"  {imp.where()} ({m} → {imp.module})"
                 for m in component for imp in imports[m]
                 if imp.module in members and (imp.module != m or len(members) == 1)]
        problems.append(f"cycle between {', '.join(component)}:\n" + "\n".join(dict.fromkeys(edges)))
    return problems


def private_violations(sources, imports) -> list[str]:
    problems = []
    for module, found in imports.items():
        for imp in found:
            if imp.module in sources and imp.module != module:
                name = imp.name if imp.name is not None else imp.module.rsplit(".", 1)[-1]
                if is_private(name):
                    problems.append(f"{imp.where()} — private name {name!r} of {imp.module}; make "
                                    "it public (or move it to a module both use)")
        src = sources[module]
        for line, target, name in private_attribute_uses(src, sources):
            problems.append(f"{src.rel}:{line}: `{target}.{name}` — private name {name!r} of {target}")
    return problems


def tool_violations(sources, imports, tests: set[str]) -> list[str]:
    problems = []
    for module, found in imports.items():
        if layer(module) != "tools":
            continue
        for imp in found:
            if imp.module.split(".")[0] in tests:
                problems.append(f"{imp.where()} — {module} imports the test module {imp.module}; "
                                "move what it shares with the tests into a package")
        src = sources[module]
        for node in ast.walk(src.tree):
            if not isinstance(node, (ast.Call, ast.Assign, ast.AugAssign)):
                continue
            text = ast.unparse(node)
            touches_path = "sys.path" in text or "PYTHONPATH" in text
            loads_file = isinstance(node, ast.Call) and any(
                f in text.split("(")[0] for f in ("spec_from_file_location", "run_path", "SourceFileLoader"))
            if not (touches_path or loads_file):
                continue
            strings = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            if any(s.strip("/").split("/")[0] == "tests" or "conftest" in s or Path(s).stem in tests
                   for s in strings):
                problems.append(f"{src.rel}:{node.lineno}: `{text}` — reaches into tests/ "
                                f"({'sys.path' if touches_path else 'loads a test file'})")
    return problems


def test_layers_import_only_the_layers_below(project):
    fail_with(layer_violations(*project), "each layer imports only the layers below it")


def test_contract_and_hardware_keep_out_of_the_model_stack(project):
    fail_with(third_party_violations(*project),
              "dfvg_hw.spec: stdlib + numpy only; dfvg_hw, boards, sim: no torch/transformers")


def test_no_import_cycles(project):
    fail_with(cycle_violations(*project), "the module graph is a DAG")


def test_no_private_cross_module_imports(project):
    fail_with(private_violations(*project), "no private names imported from another module")


def test_benchmarks_and_scripts_do_not_reach_into_tests(project):
    fail_with(tool_violations(*project, names_of_test_modules()),
              "benchmarks/ and scripts/ import no test module and keep tests/ off sys.path")


# -- the checker itself, on a made-up tree --------------------------------------------------

def test_the_checks_catch_each_kind_of_violation(tmp_path):
    files = {
        "dfvg_hw/__init__.py": "",
        "dfvg_hw/spec/__init__.py": "",
        "dfvg_hw/spec/config.py": "import amaranth\nfrom dfvg_hw import engine\n",
        "dfvg_hw/engine.py": "import torch\nfrom boards import board\n",
        "boards/__init__.py": "",
        "boards/board.py": "from dfvg_hw.build import main\n",
        "dfvg_hw/build.py": "from boards import board\n",
        "sim/__init__.py": "",
        "sim/device.py": "from dfvg_host import driver\n_RW = 1\n",
        "dfvg_host/__init__.py": "",
        "dfvg_host/driver.py": "from sim.device import _RW\nimport sim.device as d\nd._RW\n",
        "dfvg_host/a.py": "def f():\n    from . import b\n",
        "dfvg_host/b.py": "from dfvg_host.a import f\n",
        "benchmarks/bench.py": ("import sys\nsys.path.insert(0, 'tests')\nfrom conftest import x\n"
                                "from dfvg_host.driver import _RW\n"),
        "tests/conftest.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    sources = load_sources(tmp_path)
    imports = {m: imports_of(s, sources) for m, s in sources.items()}
    layers = "\n".join(layer_violations(sources, imports))
    third = "\n".join(third_party_violations(sources, imports))
    found_cycles = cycles(imports)
    private = "\n".join(private_violations(sources, imports))
    tools = "\n".join(tool_violations(sources, imports, names_of_test_modules(tmp_path)))
    assert "dfvg_hw/spec/config.py:2" in layers and "dfvg_hw/engine.py:2" in layers
    assert "boards/board.py:1" in layers and "sim/device.py:1" in layers
    assert "dfvg_hw/build.py" not in layers
    assert "dfvg_hw/spec/config.py:1" in third and "dfvg_hw/engine.py:1" in third
    assert ["dfvg_host.a", "dfvg_host.b"] in found_cycles
    assert ["boards.board", "dfvg_hw.build"] in found_cycles
    assert "dfvg_host/driver.py:1" in private and "dfvg_host/driver.py:3" in private
    assert "benchmarks/bench.py:4" in private
    assert "benchmarks/bench.py:2" in tools and "benchmarks/bench.py:3" in tools

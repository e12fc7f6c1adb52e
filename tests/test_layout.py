"""The repository's layout holds: imports run one way between the layers of `serve_app/`, the
API families never import each other, `actors/` never imports the service, no module imports
itself round a circle (lazy imports included), no file carries a family prefix, the ingress
never imports torch, and the built wheel carries and imports every package.

The rules are the README's repository map, as data; a change that breaks one names the import.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.fresh_python import run_python

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "serve_app")

# Top to bottom: a module may import its own group and anything in a lower layer. Groups of
# one layer are independent (never import each other) unless the layer says `shared`.
LAYERS: list[tuple[str, list[list[str]], bool]] = [
    (
        "entry points",
        [
            [
                "serve_app.app", "serve_app.cli", "serve_app.server", "serve_app.ingress",
                "serve_app.server_info", "serve_app.placement", "serve_app.ray_env",
                "serve_app.replicas",
                "serve_app.openapi.public", "serve_app.openapi.__main__",
            ]
        ],
        True,
    ),
    (
        "API families",
        [
            ["serve_app.openai"],
            ["serve_app.generations"],
            ["serve_app.responses"],
            ["serve_app.batch"],
        ],
        False,
    ),
    ("the resource layer", [["serve_app.resources"]], False),
    ("deployments", [["serve_app.workers"]], False),
    ("protocol", [["serve_app.protocol"]], False),
    (
        "services",
        [["serve_app.ops"], ["serve_app.backpressure"], ["serve_app.config"]],
        False,
    ),
    ("grammar", [["serve_app.grammar"]], False),
    ("access", [["serve_app.access"]], False),
    # The OpenAPI documents of the admin port and the reply models (the public document,
    # which reads every family's models, is an entry point).
    ("documents", [["serve_app.openapi"]], False),
    (
        "leaf packages",
        [
            ["serve_app.checkpoints"],
            ["serve_app.parsers"],
            ["serve_app.store"],
            # A client of any server over HTTP: it imports nothing of the service.
            ["serve_app.conformance"],
        ],
        False,
    ),
    (
        "leaf modules",
        [
            ["serve_app.errors"],
            ["serve_app.outcomes"],
            ["serve_app.metrics"],
            ["serve_app.named_actors"],
            ["serve_app.ports"],
            ["serve_app.served_by"],
        ],
        False,
    ),
]  # fmt: skip
# File-name prefixes of the flat layout: a module's package says what it belongs to.
FAMILY_PREFIXES = (
    "generation_",
    "generations_",
    "openai_",
    "store_",
    "batch_",
    "tool_",
    "grammar_",
)
# The modules the ingress replica loads to build the app's routes and admit requests.
INGRESS_MODULES = (
    "serve_app.ingress",
    "serve_app.openai.routes",
    "serve_app.generations.routes",
    "serve_app.responses.routes",
)


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    lazy: bool  # inside a function or under TYPE_CHECKING


def module_files() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = module_files()


def _targets(module: str, node: ast.Import | ast.ImportFrom, is_package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    yield base
    yield from (f"{base}.{alias.name}" for alias in node.names)


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    found: dict[tuple[str, bool], Import] = {}

    def walk(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                for name in _targets(module, child, path.name == "__init__.py"):
                    target = _resolve(name)
                    if target is not None and target != module:
                        found.setdefault((target, lazy), Import(module, target, child.lineno, lazy))
            elif (
                isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
                or isinstance(child, ast.If)
                and "TYPE_CHECKING" in ast.unparse(child.test)
            ):
                walk(child, True)
            else:
                walk(child, lazy)

    walk(tree, False)
    return list(found.values())


ALL_IMPORTS = [imp for module in MODULES for imp in imports_of(module)]


def place(module: str) -> tuple[int, int] | None:
    """(layer, group) of a serve_app module: its longest matching prefix."""
    best: tuple[int, int, int] | None = None
    for layer, (_, groups, _) in enumerate(LAYERS):
        for group, prefixes in enumerate(groups):
            for prefix in prefixes:
                matches = module == prefix or module.startswith(prefix + ".")
                if matches and (best is None or len(prefix) > best[2]):
                    best = (layer, group, len(prefix))
    return None if best is None else best[:2]


def test_every_service_module_has_a_layer():
    unplaced = [m for m in MODULES if m.startswith("serve_app.") and place(m) is None]
    assert not unplaced, f"add these to LAYERS (and the README's map): {unplaced}"


def test_imports_run_one_way_down_the_layers():
    wrong = []
    for imp in ALL_IMPORTS:
        if not (imp.source.startswith("serve_app.") and imp.target.startswith("serve_app.")):
            continue
        (src_layer, src_group), (dst_layer, dst_group) = place(imp.source), place(imp.target)
        name, _, shared = LAYERS[src_layer]
        if dst_layer < src_layer:
            wrong.append(f"{imp.source}:{imp.line} imports {imp.target} from a higher layer")
        elif dst_layer == src_layer and dst_group != src_group and not shared:
            wrong.append(f"{imp.source}:{imp.line} imports its sibling {imp.target} ({name})")
    assert not wrong, "\n".join(wrong)


def test_the_engine_never_imports_the_service_or_serve():
    wrong = [
        f"{imp.source}:{imp.line} imports {imp.target}"
        for imp in ALL_IMPORTS
        if imp.source.startswith("actors") and imp.target.startswith("serve_app")
    ]
    for module, path in MODULES.items():
        if module.startswith("actors"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    names = [getattr(node, "module", None) or ""] + [a.name for a in node.names]
                    if any(n == "ray.serve" or n.startswith("ray.serve.") for n in names):
                        wrong.append(f"{module}:{node.lineno} imports ray.serve")
    assert not wrong, "\n".join(wrong)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def test_no_import_cycles_lazy_imports_included():
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in ALL_IMPORTS:
        # A package's __init__ is not a cycle with its own modules' imports of each other.
        if not imp.target.startswith(imp.source + "."):
            edges[imp.source].add(imp.target)
    assert _cycles(edges) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_carries_a_family_prefix():
    wrong = []
    for module, path in MODULES.items():
        package, _, name = module.rpartition(".")
        if path.name == "__init__.py":
            continue
        prefixed = module.startswith("serve_app.") and name.startswith(FAMILY_PREFIXES)
        if prefixed or name.startswith(package.rpartition(".")[2] + "_"):
            wrong.append(str(path.relative_to(ROOT)))
    assert not wrong


def test_every_source_folder_is_a_package():
    folders = {
        p.parent for package in PACKAGES for p in (ROOT / package).rglob("*.py")
    }  # fmt: skip
    missing = [str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists()]
    assert not missing, f"folders without __init__.py are left out of the wheel: {missing}"


def test_the_ingress_imports_neither_torch_nor_xgrammar():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in INGRESS_MODULES)
        + "print(sorted(m for m in ('torch', 'xgrammar', 'transformers') if m in sys.modules))"
    )
    assert run_python(code) == "[]"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the checkout's files (a build writes beside them)."""
    source = tmp_path_factory.mktemp("source")
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split("\n")  # fmt: skip
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(source)],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    (built,) = out.glob("serve_app-*.whl")
    return built


def test_the_wheel_carries_and_imports_every_package(wheel, tmp_path):
    packages = sorted(m for m, p in MODULES.items() if p.name == "__init__.py")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    for package in packages:
        assert package.replace(".", "/") + "/__init__.py" in names, package
    assert any(n.startswith("serve_app/checkpoints/corpus/") and n.endswith(".txt") for n in names)
    assert any(n.startswith("serve_app/checkpoints/") and n.endswith(".jinja") for n in names)
    site = tmp_path / "site"
    code = (
        "import importlib, sys\n"
        f"site = {str(site)!r}\n"
        f"for name in {packages!r}:\n"
        "    module = importlib.import_module(name)\n"
        "    assert module.__file__.startswith(site), (name, module.__file__)\n"
        "print('ok')\n"
    )
    # Only the wheel's files on the path (and the installed dependencies), not the checkout.
    out = subprocess.run(
        [sys.executable, "-P", "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")

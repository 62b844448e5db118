"""The import rules of docs/architecture.md: layers, no cycles, losses free of the package."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "nemo_disco"

#: docs/architecture.md's table: a module (or a package's modules) and its layer.
LAYERS = {
    **dict.fromkeys(
        ["losses", "batch", "stats", "files", "metrics", "ranks", "distributed", "rewards", "families", "registry"], 0
    ),
    **dict.fromkeys(["config", "parts", "generators", "weights", "watchdog"], 1),
    **dict.fromkeys(["data", "models", "policy", "generation", "checkpoint", "update"], 2),
    "rollouts": 3,
    **dict.fromkeys(["algorithm", "evaluation", "convert", "prepare", "tiny", "plan"], 4),
    "cli": 5,
    "hooks": 0,
}


def _module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path = PACKAGE) -> set[str]:
    """Modules of the package that ``path`` imports, anywhere in the file (function-level imports too)."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("nemo_disco")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if not module.startswith("nemo_disco"):
                continue
            out.add(module)
            # `from nemo_disco import rollouts` names a module, not a symbol of the package.
            out |= {f"{module}.{a.name}" for a in node.names if _is_module(f"{module}.{a.name}", root)}
    return out - {name}


def _is_module(dotted: str, root: Path = PACKAGE) -> bool:
    rel = Path(*dotted.split(".")[1:])
    return (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file()


def _graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    graph = {_module_name(p, package): _imports(p, package) for p in sorted(package.rglob("*.py"))}
    # The top-level package itself (``from nemo_disco import x``) is not a dependency: its __init__ imports nothing.
    return {m: {d for d in deps if d in graph and d != "nemo_disco"} for m, deps in graph.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_module_has_a_layer():
    assert [m for m in _graph() if m != "nemo_disco" and _layer(m) is None] == []


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
        for m, deps in graph.items()
        for d in sorted(deps)
        if _layer(m) is not None and _layer(d) is not None and _layer(d) > _layer(m)
    ]


def test_no_module_imports_a_higher_layer():
    assert _upward(_graph()) == []


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(graph[m]):
            # A package's __init__ re-exports its modules: importing the package from one of them is not a cycle.
            if m.startswith(d + "."):
                continue
            if state.get(d) == 1:
                return [*path, m, d]
            if d not in state and (found := visit(d, [*path, m])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [])):
            return found
    return None


def test_the_imports_form_no_cycle():
    assert _cycle(_graph()) is None


def test_losses_import_nothing_of_the_package():
    # The losses package's modules import one another only.
    graph = _graph()
    modules = [m for m in graph if m == "nemo_disco.losses" or m.startswith("nemo_disco.losses.")]
    assert "nemo_disco.losses.base" in modules
    assert {m: {d for d in graph[m] if not d.startswith("nemo_disco.losses.")} for m in modules} == dict.fromkeys(
        modules, set()
    )


def test_the_model_families_import_nothing_of_the_package():
    # config.py and plan.py, torch-free, read the registry: it stays free of torch and of the rest of the package.
    assert _graph()["nemo_disco.families"] == set()


def test_the_config_schema_imports_no_loss():
    # config.py composes the sections; the losses' parameter models meet it in parts.py, which imports both.
    graph = _graph()
    assert {d for d in graph["nemo_disco.config"] if d.startswith("nemo_disco.losses")} == set()
    assert "nemo_disco.losses" in graph["nemo_disco.parts"] and "nemo_disco.config" in graph["nemo_disco.parts"]


#: Packages of one layer that import nothing of each other (docs/architecture.md, "The engines are siblings").
SIBLINGS = [("policy", "generation")]


def _between_siblings(graph: dict[str, set[str]], siblings: list[tuple[str, str]] = SIBLINGS) -> list[str]:
    def package(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else None

    return [
        f"{m} imports {d}"
        for m, deps in graph.items()
        for d in sorted(deps)
        for a, b in siblings
        if {package(m), package(d)} == {a, b}
    ]


def test_the_policy_and_the_generator_import_nothing_of_each_other():
    graph = _graph()
    assert any(m.startswith("nemo_disco.policy.") for m in graph)
    assert any(m.startswith("nemo_disco.generation.") for m in graph)
    assert _between_siblings(graph) == []


def test_the_sibling_check_sees_an_import_either_way(tmp_path):
    pkg = tmp_path / "nemo_disco"
    for sub in ("policy", "generation"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "policy" / "hf.py").write_text("from nemo_disco.generation import kv\n")
    (pkg / "generation" / "kv.py").write_text("")
    (pkg / "generation" / "hf.py").write_text("def f():\n    import nemo_disco.policy.hf\n")
    assert _between_siblings(_graph(pkg)) == [
        "nemo_disco.generation.hf imports nemo_disco.policy.hf",
        "nemo_disco.policy.hf imports nemo_disco.generation",
        "nemo_disco.policy.hf imports nemo_disco.generation.kv",
    ]


def test_the_checks_catch_each_violation(tmp_path):
    # A package whose low module imports a high one, in a cycle: both checks must see it.
    pkg = tmp_path / "nemo_disco"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "losses.py").write_text("def f():\n    from nemo_disco import cli\n")
    (pkg / "cli.py").write_text("from nemo_disco.losses import f\n")
    graph = _graph(pkg)
    assert graph["nemo_disco.losses"] == {"nemo_disco.cli"}
    assert _upward(graph) == ["nemo_disco.losses (layer 0) imports nemo_disco.cli (layer 5)"]
    assert _cycle(graph) == ["nemo_disco.cli", "nemo_disco.losses", "nemo_disco.cli"]


def _test_file(module: Path, root: Path = PACKAGE) -> str:
    """``nemo_disco/a/b.py`` -> ``test_a_b.py``: the name of the test file that must exist for a module."""
    return "test_" + "_".join(module.relative_to(root).with_suffix("").parts) + ".py"


def _untested(root: Path = PACKAGE, tests: Path = PACKAGE.parent / "tests") -> list[str]:
    have = {p.name for p in tests.glob("*/test_*.py")}
    modules = sorted(p for p in root.rglob("*.py") if p.name != "__init__.py")
    return [
        f"{m.relative_to(root.parent)} (no tests/<suite>/{_test_file(m, root)})"
        for m in modules
        if _test_file(m, root) not in have
    ]


def test_every_module_has_a_test_file_named_after_it():
    # docs/architecture.md: nemo_disco/<package>/<module>.py is tested in tests/<suite>/test_<package>_<module>.py
    assert _untested() == []


def test_the_mirror_check_sees_a_module_without_tests(tmp_path):
    (tmp_path / "nemo_disco" / "policy").mkdir(parents=True)
    for name in ("__init__.py", "batch.py", "policy/__init__.py", "policy/hf.py"):
        (tmp_path / "nemo_disco" / name).write_text("")
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_batch.py").write_text("")
    assert _untested(tmp_path / "nemo_disco", tmp_path / "tests") == [
        "nemo_disco/policy/hf.py (no tests/<suite>/test_policy_hf.py)"
    ]

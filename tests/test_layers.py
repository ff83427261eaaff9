"""The package's architecture, checked: subpackages in layers, a lower layer never importing a higher one (imports
inside functions included), no cycle between modules, `core` free of Hydra and OmegaConf, the loop free of both, no
loss family (or model) dispatched by its name or module outside config/ and core/, no module past its size."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import accutrain

PACKAGE = Path(accutrain.__file__).parent
# Bottom to top. "leaf" is the shared modules at the top of the package (errors, signals, seeding, dist).
LAYERS = ["leaf", "core", "config", "store", "models", "data", "parallel", "report", "trackers", "train", "runtime", "cli"]
LEAVES = {"__init__", "__main__", "errors", "signals", "seeding", "dist"}
MAX_LINES = 270  # with room to spare below 300


def modules() -> dict[str, Path]:
    return {".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts): path
            for path in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path) -> list[tuple[str, int]]:
    """The accutrain modules a file imports, with the line (a `from accutrain.x import y` names accutrain.x.y when y
    is a module)."""
    names = set(modules())
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "accutrain":
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.append((child if child in names else node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "accutrain"]
    return found


def layer(module: str) -> str:
    parts = module.split(".")[1:]
    return "leaf" if not parts or parts[0] in LEAVES or parts[0] == "__version__" else parts[0]


def test_every_subpackage_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    leaves = {p.stem for p in PACKAGE.glob("*.py")}
    assert packages == set(LAYERS) - {"leaf"}
    assert leaves <= LEAVES, f"a module at the top of the package that is not a shared leaf: {leaves - LEAVES}"


# The package's face: `accutrain.run` and `accutrain.compose` reach the public API (cli/api.py) when called.
PUBLIC = {("accutrain.__init__", "accutrain.cli.api")}


def test_a_lower_layer_never_imports_a_higher_one():
    upward = [f"{module} ({layer(module)}) imports {target} ({layer(target)}), line {line}"
              for module, path in modules().items() if not module.endswith("__main__")
              for target, line in imports(path)
              if LAYERS.index(layer(target)) > LAYERS.index(layer(module)) and (module, target) not in PUBLIC]
    assert not upward, "\n".join(upward)


def test_no_import_cycle_between_modules():
    names = modules()
    graph = {m: {t for t, _ in imports(p) if t in names and t != m} for m, p in names.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in graph.get(node, ()):
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " → ".join(path[path.index(target):] + [target])
                                     if target in path else f"import cycle through {target}")
            if target not in state:
                visit(target, path + [target])
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_core_imports_neither_hydra_nor_omegaconf():
    """The guarantee's arithmetic is torch only: importing accutrain.core loads no config library."""
    code = ("import sys, pkgutil, importlib, accutrain.core as core\n"
            "for m in pkgutil.iter_modules(core.__path__): importlib.import_module('accutrain.core.' + m.name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", loaded


def test_only_the_command_line_and_the_config_import_hydra_or_omegaconf():
    """Below cli/ and config/ every layer receives the typed run (accutrain.config.typed), never a DictConfig."""
    found = []
    for module, path in modules().items():
        if layer(module) in ("cli", "config"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{module} imports {n}, line {node.lineno}" for n in names if n.split(".")[0] in
                      ("hydra", "omegaconf")]
    assert not found, "\n".join(found)


def test_importing_the_loop_loads_neither_hydra_nor_omegaconf():
    """The loop (and so the build, the loss protocol, the step) runs without Hydra or OmegaConf loaded: the config it
    reads is typed."""
    code = ("import sys, accutrain.train.loop\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", loaded


def test_a_run_that_does_not_shard_never_loads_distributed_checkpoint():
    """PyTorch's distributed checkpoint and state dicts (DCP, DTensor: ~0.8 s of every process's start) are FSDP's:
    the launch, the session, the loop and the strategies load them only when a sharded run asks."""
    code = ("import sys, accutrain.runtime.launch, accutrain.runtime.session, accutrain.train.loop, "
            "accutrain.parallel.strategy\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", loaded


# A `_target_` compared by name, or by module prefix: what only the config's registries (accutrain.config.families,
# model_traits) and the families' own specs in core/ may do.
DISPATCH = re.compile(r"""\.target\s*[!=]=|\.target\.(?:endswith|startswith)\(|startswith\(["']accutrain\.|"""
                      r"""_target_["']\]?\)?\s*[!=]=|_target_["']\)?\.(?:endswith|startswith)\(""")


def test_no_family_is_dispatched_by_name_outside_the_config_and_core():
    found = [f"{module}:{number}: {line.strip()}" for module, path in modules().items()
             if layer(module) not in ("config", "core")
             for number, line in enumerate(path.read_text().splitlines(), 1) if DISPATCH.search(line)]
    assert not found, "\n".join(found)


def test_the_dispatch_pattern_finds_what_it_forbids():
    for line in ('cfg.loss.target.endswith(".contrastive")', 'c.model.target == "accutrain.models.mlp"',
                 'target.startswith("accutrain.core.")', 'node["_target_"] == "x"', 'node.get("_target_").endswith("y")'):
        assert DISPATCH.search(line), line


def test_no_module_is_long():
    long = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"

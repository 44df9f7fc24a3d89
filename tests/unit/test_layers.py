"""The package layers point one way: launch → adapters → runtime → comm → the shared base.

Every ``import`` in the installed package, the ones inside functions included, is parsed from
the source; a module may import from its own layer or a lower one only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from support.paths import ROOT

SOURCES = {"mover_plugin": ROOT / "mover_plugin", "mover_plugin.launch": ROOT / "launch",
           "mover_plugin.patches": ROOT / "patches"}
"""Each installed package and the folder it is installed from (see setup.py)."""

LAYERS = (
    ("launch", ("mover_plugin.launch", "mover_plugin.gpu_check",
                "mover_plugin.testing.template_run")),
    ("adapters", ("mover_plugin.megatron", "mover_plugin.deepspeed")),
    ("runtime", ("mover_plugin.runtime",)),
    ("comm", ("mover_plugin.comm",)),
)
"""From the top down; any other module of the package is in the shared base below them."""


def layer_of(module: str) -> int:
    """0 for the top layer (launch) ... len(LAYERS) for the shared base."""
    for index, (_, packages) in enumerate(LAYERS):
        if any(module == package or module.startswith(package + ".") for package in packages):
            return index
    return len(LAYERS)


def layer_name(module: str) -> str:
    index = layer_of(module)
    return LAYERS[index][0] if index < len(LAYERS) else "base"


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a ``mover_plugin`` module in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # ``from mover_plugin import comm`` imports the subpackage comm
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names
                      if node.module == "mover_plugin"]
    return [(line, name) for line, name in found if name.split(".")[0] == "mover_plugin"]


def upward_imports(importer: str, source: str) -> list[str]:
    """Each import in ``source`` (the module ``importer``) of a higher layer than its own."""
    own = layer_of(importer)
    return [f"{importer}:{line} imports {module} ({layer_name(importer)} → "
            f"{layer_name(module)})"
            for line, module in imported_modules(source) if layer_of(module) < own]


def package_modules() -> dict[str, Path]:
    modules = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


def test_the_checker_finds_an_upward_import_and_accepts_a_downward_one():
    source = ("from mover_plugin.comm import raise_alarm\n"
              "def late():\n    from mover_plugin.launch.config import LaunchConfig\n")
    assert upward_imports("mover_plugin.runtime.example", source) == [
        "mover_plugin.runtime.example:3 imports mover_plugin.launch.config (runtime → launch)"]
    assert upward_imports("mover_plugin.launch.example", source) == []
    assert upward_imports("mover_plugin.contract",
                          "from mover_plugin import comm\n") == [
        "mover_plugin.contract:1 imports mover_plugin.comm (base → comm)"]


@pytest.mark.parametrize("module, layer", [
    ("mover_plugin.launch.controller", "launch"), ("mover_plugin.megatron.standby", "adapters"),
    ("mover_plugin.deepspeed", "adapters"), ("mover_plugin.runtime.control", "runtime"),
    ("mover_plugin.comm.world", "comm"), ("mover_plugin.contract", "base"),
    ("mover_plugin.patches.registry", "base"), ("mover_plugin.communication", "base"),
])
def test_each_package_has_its_layer(module, layer):
    assert layer_name(module) == layer


def test_no_module_of_the_package_imports_a_higher_layer():
    modules = package_modules()
    assert "mover_plugin.launch.controller" in modules and "mover_plugin.comm.world" in modules
    problems = [problem for name, path in modules.items()
                for problem in upward_imports(name, path.read_text())]
    assert problems == []

"""The public front door: one list of names, each importable, typed keyword options that fail loudly."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ckptfix

INIT = Path(ckptfix.__file__)


def test_every_public_name_imports_and_the_type_checker_sees_the_same_names() -> None:
    for name in ckptfix.__all__:
        assert getattr(ckptfix, name) is not None
    tree = ast.parse(INIT.read_text())
    typed = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        for stmt in node.body
        if isinstance(stmt, ast.ImportFrom)
        for alias in stmt.names
    }
    assert typed == set(ckptfix.__all__) - {"__version__"} == set(ckptfix._EXPORTS)


def test_import_ckptfix_does_not_import_torch() -> None:
    code = "import sys, ckptfix; ckptfix.__all__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_misspelled_option_names_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"'strip_prefix' \(did you mean 'strip_prefixes'\?\); valid options: to, "):
        ckptfix.convert_file(tmp_path / "a.pt", tmp_path / "b.pt", strip_prefix=["module."])  # type: ignore[call-arg]


def test_options_are_checked_once_before_any_file_is_opened(tmp_path: Path) -> None:
    with pytest.raises(ckptfix.UsageError, match=r"to='plain': unknown layout; choose one of single, dp, ddp"):
        ckptfix.convert_file(tmp_path / "missing.pt", tmp_path / "b.pt", to="plain")  # type: ignore[arg-type]
    with pytest.raises(ckptfix.UsageError, match=r"dtype='int8': not a floating-point dtype"):
        ckptfix.ConvertOptions(dtype="int8")


# Layers, top first: a module may import its own layer and those below it, never one above.
LAYERS = [
    "ckptfix.cli",
    "ckptfix.conversion.files",
    "ckptfix.conversion.plan",  # the route, decided above the streams it picks among
    "ckptfix.stream",
    "ckptfix.formats",
    "ckptfix.transforms",
    "ckptfix.signature",
    "ckptfix.errors",
]


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("ckptfix.")}


@pytest.mark.parametrize("index", range(1, len(LAYERS)))
def test_layers_import_only_downwards(index: int) -> None:
    layer, above = LAYERS[index], LAYERS[:index]
    root = INIT.parent
    rel = layer.removeprefix("ckptfix.").replace(".", "/")
    files = sorted((root / rel).rglob("*.py")) if (root / rel).is_dir() else [root / f"{rel}.py"]
    for path in files:
        for name in _imports(path):
            assert not name.startswith(tuple(above)), f"{path.relative_to(root)} imports {name}, a layer above it"


# Floors inside ckptfix.formats, top first: each entry a module or a package; a module sits on the floor of its
# longest entry, so hf.index (an index's shards, which the output checks need) and deepspeed.files
# (file names and a lone rank file's refusal, which opaque entries give) sit below the folder formats. A module
# may import its own floor and those below it, never one above.
FORMATS_FLOORS = [
    ["ckptfix.formats.registry", "ckptfix.formats.writers"],
    ["ckptfix.formats.dcp", "ckptfix.formats.deepspeed", "ckptfix.formats.fsdp", "ckptfix.formats.megatron",
     "ckptfix.formats.hf", "ckptfix.formats.rankfile", "ckptfix.formats.torchio.opener"],
    ["ckptfix.formats.opened", "ckptfix.formats.files"],
    ["ckptfix.formats.torchio"],
    ["ckptfix.formats.torchzip", "ckptfix.formats.legacy", "ckptfix.formats.safetensors"],
    ["ckptfix.formats.pickles"],
    ["ckptfix.formats.output", "ckptfix.formats.paths"],
    ["ckptfix.formats.safety", "ckptfix.formats.hf.index"],
    ["ckptfix.formats.dtypes", "ckptfix.formats.records", "ckptfix.formats.raw", "ckptfix.formats.strict_json",
     "ckptfix.formats.safety.depth", "ckptfix.formats.deepspeed.files", "ckptfix.formats.copyable"],
]  # fmt: skip


def _floor(module: str) -> int | None:
    """The index in FORMATS_FLOORS of ``module``'s floor; None outside them."""
    found = [(len(entry), i) for i, floor in enumerate(FORMATS_FLOORS) for entry in floor
             if module == entry or module.startswith(entry + ".")]  # fmt: skip
    return max(found)[1] if found else None


def _modules(path: Path) -> set[str]:
    """The ckptfix modules ``path`` imports, inside functions too; ``from pkg import mod`` counts as ``pkg.mod``."""
    root = INIT.parent.parent
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (root / sub.replace(".", "/")).is_dir() or (root / f"{sub.replace('.', '/')}.py").is_file()
                found.add(sub if is_module else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("ckptfix.")}


@pytest.mark.parametrize("index", range(1, len(FORMATS_FLOORS)))
def test_formats_floors_import_only_downwards(index: int) -> None:
    root = INIT.parent
    for path in sorted((root / "formats").rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        if _floor(module) != index:
            continue
        for name in _modules(path):
            floor = _floor(name)
            assert floor is None or floor >= index, f"{path.relative_to(root)} imports {name}, a floor above it"


def test_formats_imports_only_the_layers_below_it() -> None:
    below = ("ckptfix.formats", "ckptfix.transforms", "ckptfix.errors", "ckptfix.notes", "ckptfix.signature",
             "ckptfix.torchcompat", "ckptfix.units")  # fmt: skip
    root = INIT.parent
    for path in sorted((root / "formats").rglob("*.py")):
        for name in _modules(path):
            assert name.startswith(below), f"{path.relative_to(root)} imports {name}"


def test_every_exported_function_stays_a_function_once_every_module_is_imported() -> None:
    # A module named like a function it exports (ckptfix/diff.py and diff()) replaced the function on import.
    import importlib
    import pkgutil

    for info in pkgutil.walk_packages(ckptfix.__path__, "ckptfix."):
        if not info.name.startswith(("ckptfix.cli", "ckptfix.trainer", "ckptfix.demo", "ckptfix.__main__")):
            importlib.import_module(info.name)
    for name in ("diff", "merge", "sanitize", "load", "save", "convert", "convert_file", "load_into", "check"):
        assert callable(getattr(ckptfix, name)), name

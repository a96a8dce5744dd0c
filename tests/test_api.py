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
    with pytest.raises(ckptfix.OutputError, match=r"to='plain': unknown layout; choose one of single, dp, ddp"):
        ckptfix.convert_file(tmp_path / "missing.pt", tmp_path / "b.pt", to="plain")  # type: ignore[arg-type]
    with pytest.raises(ckptfix.OutputError, match=r"dtype='int8': not a floating-point dtype"):
        ckptfix.ConvertOptions(dtype="int8")

"""The README's two contributor commands are the ones CI runs, word for word."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    """The command lines of the README's "Contributing" section's ```bash blocks."""
    section = (ROOT / "README.md").read_text().split("## Contributing", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash[^\n]*\n(.*?)```", section, re.S)
    return [line for block in blocks for line in block.splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readme_commands_verbatim() -> None:
    commands = readme_commands()
    assert len(commands) == 2
    assert "pip install torch==2.13.0" in commands[0]
    assert commands[0].index("torch==2.13.0") < commands[0].index("pip install -e")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in commands:
        assert command in ci


def test_ci_runs_the_slow_tier_after_the_readme_tests() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    fast, slow = ".venv/bin/python -m pytest -q", ".venv/bin/python -m pytest -q -m slow"
    assert slow in ci and ci.index(fast) < ci.index(slow)


@pytest.mark.parametrize(("extra", "modules"), [("frameworks", "transformers|accelerate|lightning[^\"]*|timm"),
                                                ("deepspeed", "deepspeed")])  # fmt: skip
def test_ci_runs_every_test_that_needs_an_extra_after_installing_it(extra: str, modules: str) -> None:
    """A test that skips without an optional library runs in CI once the extra that installs it is in: the files
    that ask for it are named on the pytest line after that install (the README's test command ran them skipped)."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    install = next(i for i, line in enumerate(ci) if f"'.[{extra}]'" in line)
    run = next(line for line in ci[install:] if line.startswith(".venv/bin/python -m pytest -q tests/"))
    named = set(run.split()[4:])
    needs = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
             if re.search(rf'(find_spec|importorskip)\(\s*"({modules})"', p.read_text())}  # fmt: skip
    assert needs and needs <= named, sorted(needs - named)


def test_ci_installs_the_built_wheel_without_extras_and_uses_it() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    smoke = (ROOT / ".ci" / "smoke_install.sh").read_text()
    assert "bash .ci/smoke_install.sh" in ci
    assert "--wheel --sdist" in smoke and 'pip" install -q "$WHEEL"' in smoke  # the wheel alone, no [extras]
    for command in ("convert", "--no-fast", "merge", "inspect", "validate"):
        assert f"$C {command}" in smoke or f" {command}" in smoke


def test_every_skip_for_a_missing_library_says_how_to_install_it() -> None:
    """pytest's -ra summary lists why each test skipped: one that needs an optional library names the command that
    installs it (tests/extras.py), so a contributor whose run skipped tests knows how to run them."""
    calls = (
        r'importorskip\(\s*"([\w.]+)"([^\n]*)|skipif\(\s*importlib\.util\.find_spec\("([\w.]+)"\) is None,\s*([^\n]*)'
    )
    # installed with ckptfix itself or its dev extra, and imported at the top of the files that ask: never skipped
    always = {"numpy", "safetensors.torch"}
    bare, seen = [], 0
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for m in re.finditer(calls, path.read_text()):
            seen += 1
            module, rest = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            if module not in always and "reason=needs(" not in rest:
                bare.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert seen > 20 and not bare, bare  # a pattern that finds nothing would pass
    from tests.extras import DEEPSPEED, FRAMEWORKS

    ci = (ROOT / ".ci" / "run").read_text()
    for command in (FRAMEWORKS, DEEPSPEED):  # the commands CI runs, in a contributor's active venv
        assert command.replace("pip install", ".venv/bin/pip install") in ci, command

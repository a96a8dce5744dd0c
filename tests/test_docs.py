"""Every command in README.md and docs/*.md runs, against a copy of fixtures/, and exits as the page says.

How a page marks its examples (the parser below is the whole convention):

- ```bash blocks: each line is a command (``\\`` continues it; lines starting with ``#`` are comments).
- ```console blocks: lines starting with ``$ `` are commands; the lines after one are its output, and each of
  them that holds no ``…`` must appear in what the command printed.
- ```python blocks run as scripts; ```python file=NAME is written to NAME instead, for a later command to run.
- A trailing ``# slow: <why>`` runs the command in the slow tier only (``-m slow``, as CI does).
- A trailing ``# exit N`` expects exit code N (default 0). A trailing ``# not run by tests: <why>``, or a fence
  info string ``no-test <why>`` (```bash no-test the contributor set-up), marks what cannot run here (pip, GPUs,
  the contributor commands, long benchmarks); the reason is required.

Each page runs in order in its own temporary folder holding a copy of ``fixtures/`` (so pages name
``fixtures/…``, and later commands use earlier outputs), with ``ckptfix``, ``python`` and ``torchrun`` meaning
this checkout under the running interpreter.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
# The fewest runnable examples all pages hold together: a parser that silently finds nothing fails here.
MIN_RUN = 120

FENCE = re.compile(r"^```(\S*)(.*)$")
SLOW = re.compile(r"#\s*slow:\s*(\S.*)$")
NOT_RUN = re.compile(r"#\s*not run by tests:\s*(\S.*)$")
EXIT = re.compile(r"#\s*exit\s+(\d+)\s*$")
ISSUE = re.compile(r"\bissues?\s+#?\d+|(?<![\w&/#])#\d+\b", re.IGNORECASE)


@dataclass
class Step:
    page: str
    line: int
    kind: str  # "sh", "python" or "file"
    text: str
    expect_rc: int = 0
    output: list[str] = field(default_factory=list)
    skip: str = ""  # why it does not run here; empty when it runs
    slow: str = ""  # why it runs in the slow tier only
    name: str = ""  # for "file": where to write it


def parse(path: Path) -> list[Step]:
    steps: list[Step] = []
    lines = path.read_text().splitlines()
    rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, info = m.group(1), m.group(2).split()
        start = i + 1
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        # ```bash no-test <why>: the whole block is shown, not run
        no_test = " ".join(info[info.index("no-test") + 1 :]) or "?" if "no-test" in info else ""
        if lang == "python":
            files = [w.split("=", 1)[1] for w in info if w.startswith("file=")]
            kind, name = ("file", files[0]) if files else ("python", "")
            steps.append(Step(rel, start, kind, "\n".join(body) + "\n", skip=no_test, name=name))
        elif lang in ("bash", "console"):
            steps.extend(_commands(rel, start, body, console=lang == "console", block_skip=no_test))
    return steps


def _commands(page: str, start: int, body: list[str], *, console: bool, block_skip: str) -> list[Step]:
    steps: list[Step] = []
    j = 0
    while j < len(body):
        raw = body[j]
        number = start + j + 1
        j += 1
        if console:
            if not raw.startswith("$ "):
                if steps and raw.strip():
                    steps[-1].output.append(raw.rstrip())
                continue
            raw = raw[2:]
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        while raw.endswith("\\") and j < len(body):
            raw = raw[:-1] + " " + body[j].lstrip().removeprefix("$ ")
            j += 1
        step = Step(page, number, "sh", raw)
        if (m := NOT_RUN.search(raw)) is not None:
            step.skip = m.group(1)
        elif block_skip:
            step.skip = block_skip
        if (m := SLOW.search(raw)) is not None:
            step.slow = m.group(1)
        if (m := EXIT.search(raw)) is not None:
            step.expect_rc = int(m.group(1))
        steps.append(step)
    return steps


def _shims(folder: Path) -> None:
    """``ckptfix``, ``python`` and ``torchrun`` as this checkout under this interpreter."""
    folder.mkdir()
    for name, tail in (
        ("python", ""),
        ("python3", ""),
        ("ckptfix", " -m ckptfix"),
        ("torchrun", " -m torch.distributed.run"),
    ):
        shim = folder / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}"{tail} "$@"\n')
        shim.chmod(0o755)


SHELL = re.compile(r"[|&;<>$`*?]|\(|\)")


def _run(step: Step, cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run one example; ``ckptfix`` lines and Python blocks in this process (torch is imported once), the rest
    (pipes, ``python``, ``torchrun``) in bash."""
    words = shlex.split(step.text, comments=True) if step.kind == "sh" else []
    if step.kind == "python":
        return _python(step.text, cwd)
    into = None
    if len(words) > 3 and words[-2] == ">":  # ckptfix … > FILE: stdout into FILE
        words, into = words[:-2], words[-1]
    # `ckptfix train` sets torch's threads and seeds: a process of its own keeps them out of the test run
    if words[:1] == ["ckptfix"] and words[1:2] != ["train"] and not SHELL.search(" ".join(words[1:])):
        answer = _ckptfix(words[1:], cwd, into)
        if answer is not None:
            return answer
    done = subprocess.run(["bash", "-c", step.text], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def _ckptfix(args: list[str], cwd: Path, into: str | None) -> tuple[int, str] | None:
    """The command in this process; None when it raised (``--debug``): a process then says what a user sees."""
    from click.testing import CliRunner

    from ckptfix.cli import cli

    saved = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(cli, args, prog_name="ckptfix")
    finally:
        os.chdir(saved)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return None
    if into is not None:
        (cwd / into).write_text(result.stdout)
        return result.exit_code, result.stderr
    return result.exit_code, result.output


def _python(source: str, cwd: Path) -> tuple[int, str]:
    out = io.StringIO()
    saved = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(compile(source, "<docs>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        return code, out.getvalue()
    except Exception:
        return 1, out.getvalue() + traceback.format_exc()
    finally:
        os.chdir(saved)
    return 0, out.getvalue()


def run_page(path: Path, tmp: Path, *, slow: bool = False) -> int:
    work = tmp / "work"
    work.mkdir()
    shutil.copytree(ROOT / "fixtures", work / "fixtures")
    _shims(tmp / "bin")
    env = dict(os.environ)
    env["PATH"] = f"{tmp / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    ran = 0
    for step in parse(path):
        if step.skip or (step.slow and not slow):
            continue
        if step.kind == "file":
            (work / step.name).write_text(step.text)
            continue
        rc, printed = _run(step, work, env)
        where = f"{step.page}:{step.line}: {step.text.strip()[:200]}"
        assert rc == step.expect_rc, f"{where}\nexit {rc}, not {step.expect_rc}:\n{printed}"
        _check_output(step.output, printed, where=where)
        ran += 1
    return ran


def _check_output(output: list[str], printed: str, *, where: str) -> None:
    """Shown JSON (a ``--json`` example, written compactly where that reads better) equals what was printed, as
    data; other shown lines each appear in what was printed, except those that elide with ``…``."""
    try:
        want = json.loads("\n".join(output)) if output else None
    except json.JSONDecodeError:
        want = None
    if want is not None:
        assert json.loads(printed) == want, f"{where}\nthe page's JSON differs from what it printed:\n{printed}"
        return
    shown = {line.strip() for line in printed.splitlines()}
    for expected in output:
        if "…" not in expected:
            assert expected.strip() in shown, f"{where}\nthe page shows {expected.strip()!r}; it printed:\n{printed}"


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_page_commands_run(page: Path, tmp_path: Path) -> None:
    runnable = [s for s in parse(page) if not s.skip and not s.slow and s.kind != "file"]
    assert run_page(page, tmp_path) == len(runnable)


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if any(s.slow and not s.skip for s in parse(p))], ids=page_id)
def test_page_commands_run_with_the_slow_ones(page: Path, tmp_path: Path) -> None:
    runnable = [s for s in parse(page) if not s.skip and s.kind != "file"]
    assert run_page(page, tmp_path, slow=True) == len(runnable)


def test_docs_run_enough_and_say_why_the_rest_does_not() -> None:
    steps = [s for page in PAGES for s in parse(page)]
    ran = [s for s in steps if not s.skip and s.kind != "file"]
    assert len(ran) >= MIN_RUN, f"only {len(ran)} runnable examples found"
    for step in steps:
        assert not step.skip or len(step.skip) > 3, f"{step.page}:{step.line}: say why it is not run"
    # every command is ckptfix, python or torchrun, or marked: a typo'd tool name cannot pass as a shell builtin
    tools = {"ckptfix", "python", "torchrun", "ls", "ln", "cat", "test"}
    for step in ran:
        if step.kind == "sh":
            first = step.text.split()[0]
            assert first in tools or "=" in first, f"{step.page}:{step.line}: {first} is not a known tool"


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_no_issue_numbers(page: Path) -> None:
    found = [m.group(0) for m in ISSUE.finditer(page.read_text())]
    assert not found, f"{page_id(page)} cites issue numbers: {found}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    found = set()
    prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # a `# comment` in a block is no heading
    for heading in re.findall(r"^#+ (.+)$", prose, re.M):
        found.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return found


def test_docs_links_resolve() -> None:
    """Relative links between pages point at files and headings that exist (docs/json.md is written alongside)."""
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#:\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            resolved = (page.parent / target).resolve() if target else page
            if resolved == (ROOT / "docs" / "json.md").resolve() and not resolved.exists():
                continue
            assert resolved.exists(), f"{page_id(page)} links to {target}, which does not exist"
            if anchor and resolved.suffix == ".md":
                assert anchor in _anchors(resolved), f"{page_id(page)} links to {target}#{anchor}: no such heading"


def test_parser_reads_the_conventions(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nckptfix a \\\n  b  # exit 2\n# comment\npip install x  # not run by tests: network\n```\n"
        "```console\n$ ckptfix c\nout line\n```\n```bash no-test it would delete everything\nrm -rf /\n```\n"
        "```python file=s.py\nprint(1)\n```\n```\n$ not a command\n```\n```text\n$ nor this\n```\n"
    )
    steps = parse(page)
    assert [(s.kind, s.text.split()[0] if s.kind == "sh" else s.name, s.expect_rc, bool(s.skip)) for s in steps] == [
        ("sh", "ckptfix", 2, False),
        ("sh", "pip", 0, True),
        ("sh", "ckptfix", 0, False),
        ("sh", "rm", 0, True),
        ("file", "s.py", 0, False),
    ]
    assert steps[2].output == ["out line"]
    assert "b" in steps[0].text.split()


def test_api_page_names_every_public_name() -> None:
    import ckptfix

    text = (ROOT / "docs" / "api.md").read_text()
    missing = [name for name in ckptfix.__all__ if f"`{name}" not in text]
    assert not missing, f"docs/api.md does not mention {missing}"


def test_cli_page_names_every_command_and_option() -> None:
    import click

    from ckptfix.cli import cli

    text = (ROOT / "docs" / "cli.md").read_text()
    context = click.Context(cli)
    for name in cli.list_commands(context):
        command = cli.get_command(context, name)
        assert command is not None and f"## {name}" in text, f"docs/cli.md has no section for {name}"
        for param in command.params:
            for flag in (*param.opts, *param.secondary_opts):
                if flag.startswith("--") and flag != "--help":
                    assert f"`{flag}" in text, f"docs/cli.md does not name {name} {flag}"

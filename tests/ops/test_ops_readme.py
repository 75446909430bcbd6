"""The README's code blocks and the examples, run as a user would: from the
repository root, as pasted (a block that is not meant to run says why in a
``<!-- not run: ... -->`` line above it), and the examples with the command
lines their docstrings give. The docs stand on their own: nothing points
outside the repository."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- not run: [^>]*-->\n)?```(\w*)\n(.*?)```", re.S)
RUN_TIMEOUT = 120.0


def blocks() -> list[tuple[bool, str, str]]:
    """(meant to run, language, text) of every fenced block of the README."""
    return [(m.group(1) is None, m.group(2), m.group(3))
            for m in BLOCK.finditer(README.read_text())]


def runnable(lang: str) -> list[str]:
    return [text for run, language, text in blocks() if run and language == lang]


def venv() -> Path:
    python = ROOT / ".venv" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{python} does not exist: run deploy/setup.sh first (as the README says)")
    return python


def test_every_block_runs_or_says_why() -> None:
    found = blocks()
    assert found
    for run, lang, text in found:
        if run:
            assert lang in ("python", "sh"), f"a ```{lang} block that nothing runs:\n{text}"
    assert len(runnable("python")) >= 2 and len(runnable("sh")) >= 1


@pytest.mark.parametrize("index", range(len(runnable("python"))))
def test_readme_python_block(index: int) -> None:
    python = venv()
    proc = subprocess.run([str(python), "-"], input=runnable("python")[index], cwd=ROOT,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("index", range(len(runnable("sh"))))
def test_readme_shell_block(index: int) -> None:
    """In a network namespace of its own, so the block's fixed ports (7700,
    9464, ...) cannot meet another test's; ``wait`` after it, as the shell
    the user pasted it into would still be there for the daemons' exit."""
    venv()
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a network namespace for the block's fixed ports needs root and `ip`")
    ns = f"p2preadme{os.getpid()}{index}"
    if subprocess.run(["ip", "netns", "add", ns], capture_output=True, check=False,
                      timeout=10).returncode != 0:
        pytest.skip("cannot create a network namespace")
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, timeout=10)
        script = runnable("sh")[index] + "\nwait\n"
        proc = subprocess.run(["ip", "netns", "exec", ns, "bash", "-e", "-c", script], cwd=ROOT,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False, timeout=10)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    if "landed:" in script:
        assert "landed: True" in proc.stdout, proc.stdout


def test_readme_demo() -> None:
    """The first block's demo (its setup.sh half installs system packages)."""
    venv()
    proc = subprocess.run([".venv/bin/p2pxfer", "demo"], cwd=ROOT, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "yes" in proc.stdout, proc.stdout


def example_lines() -> list[str]:
    """Every command line the examples' docstrings give."""
    lines = []
    for path in sorted((ROOT / "examples").glob("*.py")):
        doc = path.read_text().split('"""')[1]
        lines += [ln.strip() for ln in doc.splitlines()
                  if f"examples/{path.name}" in ln and "python" in ln]
    return lines


def test_examples_say_how_to_run_them() -> None:
    lines = example_lines()
    assert lines
    for line in lines:
        assert line.startswith(".venv/bin/python examples/"), line
    readme = README.read_text()
    assert ".venv/bin/python examples/" in readme


@pytest.mark.parametrize("path", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_example_runs_as_documented(path: str) -> None:
    """Each example's command line marked ``# tiny`` (the quick one), as
    written, from the repository root."""
    venv()
    tiny = [ln for ln in example_lines() if f"examples/{path}" in ln and "# tiny" in ln]
    assert tiny, f"examples/{path}: no command line marked '# tiny' in its docstring"
    argv = tiny[0].split("#", 1)[0].split()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, check=False, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]


def test_docs_stand_on_their_own() -> None:
    """No page, docstring or config points outside the repository."""
    texts = [README, *(ROOT / "docs").glob("*.md"), *(ROOT / "proto").glob("*.md"),
             *(ROOT / "src").rglob("*.py"), *(ROOT / "examples").glob("*.py"),
             *(ROOT / "deploy").rglob("*.toml")]
    outside = re.compile(r"\.\./shared|/work/|FABRIC-NOTES|\.\./\.\./")
    for path in texts:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not outside.search(line), f"{path.relative_to(ROOT)}:{n}: {line}"
            for target in re.findall(r"\((\.\./[^)#\s]+)", line):  # relative markdown links
                assert (path.parent / target).resolve().is_relative_to(ROOT), (path, line)
                assert (path.parent / target).resolve().exists(), (path, line)


def test_example_without_the_project_says_how_to_run_it() -> None:
    """``python examples/...`` with a python that lacks the project (here:
    without site-packages) says to use the virtualenv, not a traceback."""
    proc = subprocess.run([sys.executable, "-S", "examples/prefill_decode.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert ".venv/bin/python examples/prefill_decode.py" in proc.stderr, proc.stderr

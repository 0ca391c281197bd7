"""Every shell script the project ships parses (`bash -n`), the CI entry first: a broken
`.ci/run` fails CI after 0 s with nothing run, and no other test would notice."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = [ROOT / ".ci" / "run", ROOT / ".ci" / "test-tools",
           *sorted((ROOT / "deploy").glob("*.sh"))]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_parses(script: Path) -> None:
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, f"{script.relative_to(ROOT)} does not parse: {done.stderr}"


def test_ci_entry_calls_the_readme_test_command() -> None:
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "make test" in lines
    assert "make test" in (ROOT / "README.md").read_text()

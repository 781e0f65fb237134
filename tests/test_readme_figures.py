"""README.md's measured figures are bench/RESULTS.md's: ``scripts/readme_figures.py`` checks
it (the tests import no script, so the check runs as its command)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(ROOT / "scripts" / "readme_figures.py"), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_the_readme_shows_the_figures_of_results() -> None:
    done = check()
    assert done.returncode == 0, done.stderr


def test_a_readme_figure_that_results_does_not_have_fails_the_check(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    figure = "| 47"  # a figure of the LiteLLM row, typed differently here
    assert figure in readme
    edited = tmp_path / "README.md"
    edited.write_text(readme.replace(figure, "| 50", 1))
    done = check("--readme", str(edited))
    assert done.returncode == 1
    assert "not bench/RESULTS.md's" in done.stderr
    assert check("--readme", str(edited), "--write").returncode == 0
    assert edited.read_text() == readme  # rewritten from RESULTS

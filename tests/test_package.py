"""The wheel: built from the checkout, it carries the shipped files, and installed (not
editable) it finds its defaults inside itself, from any folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

SHIPPED = [
    "server/configs/default.toml",
    "server/configs/gpu-example.toml",
    "server/configs/vllm-classifier-example.toml",
    "semcache/policies/default.toml",
    "semcache/semantic/data/verifier/verifier.npz",
    "semcache/semantic/data/verifier/verifier.json",
    "backends/local/data/classifier/sentiment-head.json",
    "backends/local/data/sentiment/sentiment.jsonl",
    "backends/launch/shim/sitecustomize.py",
    "server/dashboard/templates/overview.html",
    "server/dashboard/static/dashboard.js",
    "server/dashboard/static/uplot/uPlot.iife.min.js",
    "server/dashboard/static/uplot/LICENSE",
    "server/cli/__init__.py",
    "server/cli/__main__.py",
    "server/apidoc/docs/index.html",
    "server/apidoc/docs/swagger-ui-bundle.js",
    "server/apidoc/docs/LICENSE",
]


def _source_copy(dest: Path) -> Path:
    """The checkout's files (tracked or not ignored) copied, links kept: setuptools builds
    in place and would otherwise pack stale files from an old ``build/`` folder."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO_ROOT / name
        if not source.is_symlink() and not source.is_file():
            continue  # deleted, not yet committed
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = _source_copy(tmp_path_factory.mktemp("source"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
        ],
        check=True,
        timeout=300,
    )
    (found,) = out.glob("semcache-*.whl")
    return found


def test_the_wheel_carries_the_shipped_files(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in SHIPPED if name not in names]
    assert not missing, missing
    assert not [
        n for n in names if n.startswith(("tests/", "bench/", "data/", "policies/", "harness/"))
    ]
    assert "foundation/sse.py" in names  # the bottom layer ships with the three above it
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "semcache = server.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.slow
def test_the_installed_wheel_finds_its_defaults_inside_itself(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    for name in ("SEMCACHE_CONFIG", "SEMCACHE_POLICY"):
        env.pop(name, None)

    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, *args],
            cwd=elsewhere,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    code = """
import server
from backends.local.classifier import DEFAULT_EXAMPLES, DEFAULT_HEAD
from semcache.policy import DEFAULT_POLICY
from semcache.semantic.pair_verifier import DEFAULT_VERIFIER_DIR, load_verifier
from server.config import DEFAULT_CONFIG
load_verifier()
for path in (server.__file__, DEFAULT_CONFIG, DEFAULT_POLICY, DEFAULT_VERIFIER_DIR,
             DEFAULT_HEAD, DEFAULT_EXAMPLES):
    assert path.exists() if hasattr(path, "exists") else True, path
    print(path)
"""
    for line in run("-c", code).splitlines():
        assert line.startswith(str(site)), line
    assert run("-m", "server.cli", "config", "check").startswith(
        f"{site}/server/configs/default.toml: OK"
    )
    assert run("-m", "server.cli", "policy", "check").startswith(
        f"{site}/semcache/policies/default.toml: OK"
    )

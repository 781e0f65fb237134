"""Every command of the README and docs/ is run by the suite, so none can drift from the code.

This module runs, or checks against what runs them, those that need no gateway: `semcache`
commands are parsed by the CLI's own parser (a form with placeholders names only commands
and options that exist), the local ones run, `backends scale`'s pool is one of the shipped
config; `make serve` runs dry; `python -c` runs; test paths and options exist. The commands
that need a gateway (curl, the Python examples, `semcache usage`/`cache purge`/`keys`) are
run by ``tests/server/test_doc_commands_live.py`` against `semcache serve`. A command of a
kind neither knows fails here: say how the suite runs it.

Checked by text only (what they name exists, or the test that runs them says it does):
`make` targets other than `serve` (the target exists); `scripts/*.sh` (the action and
options are cases of the script) and `python scripts/*.py` (the options are the script's,
a test of its own runs it); `podman` and `podman-compose` (tests/deploy/test_image.py, opt-in,
runs the image so); `kubectl` (no cluster: the kustomization or Secret example exists and
tests/deploy/test_k8s.py validates it offline); `helm` (the operator's own install, a
prerequisite: its resource is the one deploy/k8s applies); `kill -HUP` (SIGHUP is sent by
tests/server/test_signals.py); `redis-cli` (harness/redis_cluster.py uses its options);
`pip install` (the package or extra is the project's); `export` (the variables are read);
`claude`; and the `semcache` commands of ``RUN_ELSEWHERE``.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from backends.config import VllmBackendConfig
from backends.launch.scale import pool_of
from server.cli import build_parser, main
from server.cli.options import ENVIRONMENT, OTHER_ENVIRONMENT
from server.config import DEFAULT_CONFIG, load_config
from tests.support.doc_commands import (
    REPO,
    DocCommand,
    calls_gateway,
    doc_commands,
    is_synopsis,
    live,
    parses,
    semcache_args,
)

COMMANDS = doc_commands()

RUN_HERE = {("config", "check"), ("policy", "check"), ("--help",)}
"""`semcache` commands this module runs as written."""

RUN_ELSEWHERE = {
    ("serve",): "every slow test's gateway is `semcache serve` (harness/gateway.py "
    "GatewayProcess); tests/server/test_serve_cli.py runs the embedded default",
    ("backends", "up"): "starts the config's vLLM servers: the launcher's tests "
    "(tests/backends/launch/) and `semcache serve` with launch=True",
    ("backends", "scale"): "starts a vLLM server: tests/backends/test_live_pools_vllm.py "
    "runs `backends scale tiny/prefill +1/-1`; here its pool is checked against the config",
    ("calibrate",): "tests/server/test_cli.py (--pairs) and test_cli_calibrate_mixed.py "
    "(--stream --sources, with --limit) run it",
    ("train-verifier",): "rewrites the shipped verifier: its training runs in "
    "tests/semcache/tuning/, the command's errors in tests/server/test_cli.py",
    ("train-classifier",): "rewrites the shipped head: its training (train_head) runs in "
    "tests/backends/test_classifier.py",
}
"""`semcache` commands not run here as written, and the tests that run them."""


def command_path(args: list[str]) -> tuple[argparse.ArgumentParser, list[str], list[str]]:
    """The subparser ``args`` name, the command words and the words after them."""
    parser = build_parser()
    path: list[str] = []
    rest = list(args)
    while rest:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or rest[0] not in subs[0].choices:
            break
        path.append(rest[0])
        parser = subs[0].choices[rest.pop(0)]
    return parser, path, rest


def check_semcache(cmd: DocCommand) -> None:
    args = semcache_args(cmd)
    parser, path, rest = command_path(args)
    assert path or args[0] in ("--help", "COMMAND"), f"no such command: {args}"
    for word in rest:
        option = word.split("=", 1)[0]
        if option.startswith("--"):
            assert option in parser._option_string_actions, f"`semcache {' '.join(path)}` "
            f"has no option {option}"
    if is_synopsis(args):
        return  # a form to fill in: its commands and options exist
    if not parses(args):
        assert not rest, f"`semcache` refuses {args}"
        return  # a command named in a sentence (`semcache cache purge`): it exists
    key = tuple(path) or tuple(args[:1])
    if calls_gateway(args):
        assert live(cmd)  # run by tests/server/test_doc_commands_live.py
    elif key in RUN_HERE:
        if args != ["--help"]:
            assert main(args) == 0, args
    else:
        assert key[:2] in RUN_ELSEWHERE or key[:1] in RUN_ELSEWHERE, f"how is {args} run?"
        if key == ("backends", "scale"):
            config = load_config(DEFAULT_CONFIG)
            vllm = [b for b in config.backends if isinstance(b, VllmBackendConfig)]
            pool_of(vllm, args[2])  # a backend and role of the shipped config


def check_make(cmd: DocCommand) -> None:
    """The target is the Makefile's; `make serve` (dry: its recipe starts no other make,
    which even a dry run would) hands `semcache serve` options it takes."""
    words = cmd.words
    targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M)
    assert words[1] in targets, words[1]
    if words[1] != "serve":
        return  # `make test` is what CI runs; the others' recipes are one command each
    dry = subprocess.run(
        ["make", "-n", *words[1:]], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert dry.returncode == 0, dry.stderr
    (serve,) = [line for line in dry.stdout.splitlines() if "semcache serve" in line]
    args = shlex.split(serve.split("semcache ", 1)[1])
    assert parses(args), serve
    for option, value in (w.split("=", 1) for w in words[2:]):
        assert f"--{option.lower()} {value}" in serve


def check_python(cmd: DocCommand, tmp_path: Path) -> None:
    if cmd.python:
        assert live(cmd)  # run by tests/server/test_doc_commands_live.py
        return
    words = cmd.words
    if words[1] == "-c":
        run = subprocess.run([sys.executable, *words[1:]], capture_output=True, timeout=60)
        assert run.returncode == 0, run.stderr
    elif words[2] == "pytest":
        check_pytest(cmd)
    elif words[1].startswith("scripts/"):
        check_python_script(words[1:])
    elif words[2] == "bench.readme_figures":
        readme = tmp_path / "README.md"
        shutil.copy(REPO / "README.md", readme)
        argv = [sys.executable, "-m", *words[2:], "--readme", str(readme)]
        assert subprocess.run(argv, cwd=REPO, timeout=60).returncode == 0
        assert readme.read_text() == (REPO / "README.md").read_text()  # figures up to date
    else:
        pytest.fail(f"how is {cmd} run?")


def check_python_script(words: list[str]) -> None:
    """The script exists, takes the options given and is run by a test of its own
    (``scripts/readme_figures.py``: tests/test_readme_figures.py runs its ``--check``)."""
    script = REPO / words[0]
    source = script.read_text()
    for option in (w.split("=", 1)[0] for w in words[1:] if w.startswith("--")):
        assert f'add_argument("{option}"' in source, option
    stem = script.stem
    assert any(stem in p.read_text() for p in (REPO / "tests").rglob(f"test_{stem}*.py")), stem


def check_pytest(cmd: DocCommand) -> None:
    """The suite runs these paths (`make test` runs every test)."""
    paths = [w for w in cmd.words if w.startswith("tests/")]
    assert paths and all((REPO / p).exists() for p in paths), paths
    assert "-m" not in cmd.words or "slow" in cmd.words


def check_schemathesis(cmd: DocCommand) -> None:
    """The CLI takes every option and check named (tests/server/apidoc/test_fuzz.py runs
    the fuzzer itself on every route)."""
    help_text = subprocess.run(
        [str(REPO / ".venv" / "bin" / "schemathesis"), "run", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    words = cmd.words
    for i, word in enumerate(words):
        if word.startswith("-"):
            assert re.search(rf"(^|[ ,]){re.escape(word)}[ ,]", help_text, re.M), word
        if words[i - 1] == "--checks":
            for check in word.split(","):
                assert check in help_text, check
    assert (REPO / "tests/server/apidoc/test_fuzz.py").exists()


def check_script(cmd: DocCommand) -> None:
    """The script exists and takes the action and options given."""
    words = cmd.words[1:] if cmd.words[0] == "sudo" else cmd.words
    script = REPO / words[0]
    source = script.read_text()
    if script.name == "cluster.sh":  # it hands its arguments to harness/cluster/
        source += "".join(p.read_text() for p in sorted((REPO / "harness/cluster").glob("*.py")))
    if words[1].startswith("--"):  # options only: each a case of the script's parser
        assert all(re.search(rf"^\s*{re.escape(w)}\)", source, re.M) for w in words[1:]), words
        return
    assert re.search(rf"^\s*{re.escape(words[1])}\b[^)]*\)", source, re.M), words[1]
    for option in words[2:]:
        assert f'"{option}"' in source, option


def check_pip(cmd: DocCommand) -> None:
    words = cmd.words
    if "--dry-run" in words:  # an extra resolved, not installed: the extra is the project's
        extra = words[-1].split("[", 1)[1].rstrip("]")
        pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
        assert extra in pyproject["project"]["optional-dependencies"], extra
    elif words[2:] == ["."]:  # the wheel, built and installed by tests/test_package.py
        assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
        assert '"install"' in (REPO / "tests" / "test_package.py").read_text()
    else:  # what scripts/install.sh installs
        assert " ".join(words[2:]) in (REPO / "scripts" / "install.sh").read_text()


CLAUDE_CODE = {"ANTHROPIC_BASE_URL", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_MODEL"}
"""Claude Code's variables (its settings docs) that docs/anthropic.md sets: the gateway's
URL, a token of the gateway, a model the gateway serves."""

IMAGE_ONLY = {"SEMCACHE_API_TOKEN"}
"""Read by the image's config (deploy/config/), not by the CLI."""


def check_export(cmd: DocCommand) -> None:
    """Sets the variables the commands after it read."""
    known = {e.variable for e in ENVIRONMENT} | {v for v, _ in OTHER_ENVIRONMENT} | IMAGE_ONLY
    for word in cmd.words[1:]:
        if "=" not in word:
            continue  # the rest of a $(...) value
        name, value = word.split("=", 1)
        if name.startswith("ANTHROPIC_"):
            assert name in CLAUDE_CODE or name.startswith("ANTHROPIC_DEFAULT_"), name
            if name.endswith("MODEL"):
                config = load_config(DEFAULT_CONFIG)
                assert value in {m.id for m in config.models}, value
            continue
        assert name in known, word
        if name in IMAGE_ONLY:
            assert name in "".join(p.read_text() for p in (REPO / "deploy").rglob("*.toml"))


def check_claude(cmd: DocCommand) -> None:
    """Claude Code (npm, interactive) is not run: the API it speaks is, by the anthropic SDK
    in tests/server/anthropic/ and against `semcache serve` in test_serve_cli.py."""
    assert cmd.words == ["claude"]
    assert "anthropic.Anthropic(" in (REPO / "tests/server/test_serve_cli.py").read_text()


IMAGE_TEST = REPO / "tests" / "deploy" / "test_image.py"


def check_container(cmd: DocCommand) -> None:
    """podman and podman-compose run the image as these docs do in tests/deploy/test_image.py
    (opt-in: `make image-test`)."""
    source = IMAGE_TEST.read_text()
    assert f'"{cmd.words[0]}"' in source or f"`{cmd.words[0]}" in source, cmd.words[0]
    verb = next(w for w in cmd.words[1:] if not w.startswith("-") and "/" not in w)
    assert verb in source, verb


K8S = REPO / "deploy" / "k8s"


def check_kubectl(cmd: DocCommand) -> None:
    """Not run (no cluster here): ``apply -k DIR`` names a kustomization whose manifests
    tests/deploy/test_k8s.py validates offline; ``create secret`` makes the Secret of the
    example it validates too."""
    words = cmd.words
    test = (REPO / "tests" / "deploy" / "test_k8s.py").read_text()
    if words[1:3] == ["apply", "-k"]:
        assert (REPO / words[3] / "kustomization.yaml").exists(), words[3]
        assert words[3] in test, words[3]
    else:
        assert words[1:3] == ["create", "secret"], words
        assert "kind: Secret" in (K8S / "secret.example.yaml").read_text()
        assert "secret.example.yaml" in test


def check_helm(cmd: DocCommand) -> None:
    """Not run: the operator's own install, a prerequisite of deploy/k8s (the docs name it
    so); its custom resource is the one the base applies."""
    words = cmd.words
    assert words[1] == "install" and words[2] == "valkey-operator", words
    assert "kind: ValkeyCluster" in (K8S / "valkey.yaml").read_text()
    assert "valkey.yaml" in (K8S / "kustomization.yaml").read_text()


def check_kill(cmd: DocCommand) -> None:
    """`kill -HUP <pid>` reloads the policy: sent to the real process by
    tests/server/test_signals.py."""
    assert cmd.words[1] == "-HUP"
    assert "SIGHUP" in (REPO / "tests" / "server" / "test_signals.py").read_text()


def check_curl(cmd: DocCommand) -> None:
    if live(cmd):
        return  # run by tests/server/test_doc_commands_live.py
    if "localhost:8080" in cmd.text:  # the image's port: tests/deploy/test_image.py
        path = re.search(r"localhost:8080/v1/([\w/]+)", cmd.text)
        assert path is not None, cmd.text
        sdk_call = {"models": "models.list()"}.get(path.group(1), f"/v1/{path.group(1)}")
        assert sdk_call in IMAGE_TEST.read_text(), cmd.text
        return
    # the namespaced cluster's load balancer (docs/deploy.md): tests/server/test_cluster.py
    # runs the same request through `scripts/cluster.sh up`'s cluster
    assert "http://10.77.0.10:8080/" in cmd.text
    assert "/v1/chat/completions" in (REPO / "tests" / "server" / "test_cluster.py").read_text()


def check_redis_cli(cmd: DocCommand) -> None:
    """The shared tier's Redis Cluster: harness/redis_cluster.py creates one the same way."""
    source = (REPO / "harness" / "redis_cluster.py").read_text()
    assert all(w in source for w in cmd.words[1:] if w.startswith("--"))


def check_xdg_open(cmd: DocCommand) -> None:
    assert live(cmd)  # the page is fetched by tests/server/test_doc_commands_live.py


CHECKS: dict[str, Callable[[DocCommand], None]] = {
    "semcache": check_semcache,
    "make": check_make,
    "pytest": check_pytest,
    "schemathesis": check_schemathesis,
    "scripts/cluster.sh": check_script,
    "scripts/nginx.sh": check_script,
    "scripts/image.sh": check_script,
    "scripts/podman.sh": check_script,
    "podman": check_container,
    "podman-compose": check_container,
    "claude": check_claude,
    "pip": check_pip,
    "export": check_export,
    "kubectl": check_kubectl,
    "helm": check_helm,
    "kill": check_kill,
    "curl": check_curl,
    "redis-cli": check_redis_cli,
    "xdg-open": check_xdg_open,
}


def test_the_docs_show_commands_of_each_kind() -> None:
    """The extraction finds what the docs show (a broken extractor would check nothing)."""
    programs = {cmd.program for cmd in COMMANDS}
    assert {"semcache", "curl", "python", "make", "podman", "kubectl", "helm"} <= programs
    assert any(cmd.words[:2] == ["python", "scripts/readme_figures.py"] for cmd in COMMANDS)
    assert sum(live(cmd) for cmd in COMMANDS) >= 12


@pytest.mark.parametrize("cmd", COMMANDS, ids=str)
def test_every_command_of_the_docs_is_run_by_the_suite(cmd: DocCommand, tmp_path: Path) -> None:
    if cmd.program == "python":
        check_python(cmd, tmp_path)
        return
    check = CHECKS.get(cmd.program)
    assert check is not None, f"{cmd}: a command the suite does not run; add how it is run"
    check(cmd)

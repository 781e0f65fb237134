"""Bad content rules fail ``semcache policy check`` and stop ``semcache serve`` before it
starts anything, with the file, the field and what was expected."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.ports import free_port

CLI = [sys.executable, "-m", "server.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('[defaults.dlp.prompt]\nCREDIT_CRAD = "block"\n', "defaults.dlp.prompt.CREDIT_CRAD"),
        (
            "[guard.detectors.EMPLOYEE_ID]\npatterns = ['EMP-(\\d{6}']\n",
            "guard.detectors.EMPLOYEE_ID.patterns[0]: invalid regex",
        ),
    ],
)
def test_check_and_serve_refuse_bad_rules(tmp_path: Path, text: str, field: str) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    checked = run("policy", "check", str(bad))
    assert checked.returncode == 2 and str(bad) in checked.stderr and field in checked.stderr
    served = run("serve", "--no-launch", "--policy", str(bad), "--port", str(free_port()))
    assert served.returncode == 2
    assert "invalid policy, not starting" in served.stderr and field in served.stderr


def test_serve_refuses_a_guardrail_model_the_config_lacks(tmp_path: Path) -> None:
    policy = tmp_path / "p.toml"
    policy.write_text(
        '[routes.chat.guardrails]\nmodel = "llama-guard"\n'
        "prompt = { unsafe = { threshold = 0.5 } }\n"
    )
    assert run("policy", "check", str(policy)).returncode == 0  # the file alone is valid
    config = tmp_path / "gw.toml"
    config.write_text(
        f'data_dir = "{tmp_path / "data"}"\npolicy = "{policy}"\n'
        '[[models]]\nid = "m"\nbackend = "b"\ntask = "chat"\n'
        '[[backends]]\nkind = "vllm"\nname = "b"\nserved_model = "m"\n'
        '[[backends.servers]]\nurl = "http://127.0.0.1:9"\n'
    )
    served = run("serve", "--no-launch", "--config", str(config), "--port", str(free_port()))
    assert served.returncode == 2
    assert "guardrails.model: no model 'llama-guard'" in served.stderr

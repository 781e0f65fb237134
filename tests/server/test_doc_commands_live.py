"""The README's and docs' commands that need a gateway, run as written against `semcache serve`
on the embedded default: its config's models, aliases, batches and open authentication, the
shipped policy, its chat backend the session's tiny vLLM (SmolLM2 is `make serve`'s).

Run in each file's order: curl (streams included; a batch's `request_id` is carried to the
poll that follows), the Python examples (the OpenAI SDK, files and batches), `semcache
usage`, `cache purge` and `keys` (a key scoped to the model the docs name), the pages
`xdg-open` opens. The docs' address (http://127.0.0.1:8080) is the gateway's here, and the
admin token they give (`--token T`) is its admin token. The other commands are run or
checked by tests/test_doc_commands.py. Here too: the shipped prices make hits save money
(the dashboard's "USD saved"), and the batch example stops at the policy's max_tokens.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import orjson
import pytest

from backends.config import VllmBackendConfig, VllmServer
from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess, write_config_toml
from harness.vllm_process import TINY_MODEL_NAME
from server.config import DEFAULT_CONFIG, load_config
from tests.support.doc_commands import DOC_TOKEN, GATEWAY, DocCommand, doc_commands, live

pytestmark = pytest.mark.slow

LIVE = [cmd for cmd in doc_commands() if live(cmd)]
FILES = sorted({cmd.file for cmd in LIVE})
REQUEST_ID = "3f0c…"
"""The docs' elided batch id: the one the command before it answered."""


@pytest.fixture(scope="module")
def docs_gateway(
    data_dir: Path, tiny_vllm: VllmProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("docs")
    shipped = load_config(DEFAULT_CONFIG)
    tiny = {
        "served_model": TINY_MODEL_NAME,
        "model_path": str(data_dir / "models" / TINY_MODEL_NAME),
        "servers": [VllmServer(url=tiny_vllm.url)],
    }
    backends = [
        VllmBackendConfig(name=b.name, **tiny) if isinstance(b, VllmBackendConfig) else b
        for b in shipped.backends
    ]
    config = msgspec.structs.replace(shipped, data_dir=str(tmp / "data"), backends=backends)
    gateway = GatewayProcess(
        write_config_toml(config, tmp / "gateway.toml"), env={"SEMCACHE_ADMIN_TOKEN": DOC_TOKEN}
    )
    try:
        yield gateway.start()
    finally:
        gateway.stop()


def batch_line() -> bytes:
    """The batch input line docs/openai-batches.md shows in its example's comment."""
    (example,) = [c for c in LIVE if c.file == "docs/openai-batches.md" and c.python]
    lines = example.text.split("# batch.jsonl, one request a line:\n", 1)[1].splitlines()
    text = "".join(line[2:] for line in lines[:2])
    return orjson.dumps(orjson.loads(text)) + b"\n"


def run_shell(cmd: DocCommand, gw: GatewayProcess, state: dict[str, str], cwd: Path) -> str:
    text = cmd.text.replace(GATEWAY, gw.url).replace("| less", "| cat")
    for placeholder, value in state.items():
        text = text.replace(placeholder, value)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # `semcache`
        "SEMCACHE_URL": gw.url,
        "SEMCACHE_ADMIN_TOKEN": DOC_TOKEN,
    }
    done = subprocess.run(
        ["bash", "-c", text], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{cmd}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def check_answer(cmd: DocCommand, out: str, state: dict[str, str]) -> None:
    """A JSON answer or an event stream, and no error in it."""
    if cmd.program == "semcache":
        assert "semcache:" not in out, out
        return
    if out.startswith("data:"):
        assert out.rstrip().endswith("data: [DONE]") and '"errors"' not in out, out
        return
    answer = orjson.loads(out)
    assert answer.get("success", True) is True and "error" not in answer, out
    found = re.search(r'"request_id":\s*"([^"]+)"', out)
    if found and "queueRequest" in cmd.text:
        state[REQUEST_ID] = found.group(1)


def run_python(code: str, gw: GatewayProcess, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code.replace(GATEWAY, gw.url)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{code}\n{done.stderr}"
    return done.stdout


@pytest.mark.parametrize("doc", FILES)
def test_the_commands_of_a_doc_run_as_written(
    doc: str, docs_gateway: GatewayProcess, tmp_path: Path
) -> None:
    (tmp_path / "batch.jsonl").write_bytes(batch_line())
    state: dict[str, str] = {}
    commands = [cmd for cmd in LIVE if cmd.file == doc]
    python = "\n".join(cmd.text for cmd in commands if cmd.python)  # one session per file
    if python:
        out = run_python(python, docs_gateway, tmp_path)
        if doc == "docs/openai-batches.md":
            (line,) = [line for line in out.splitlines() if line.strip()]
            answer = orjson.loads(line)["response"]
            usage = answer["body"]["usage"]
            assert answer["status_code"] == 200
            assert (usage["max_tokens_applied"], usage["max_tokens_source"]) == (256, "default")
            assert usage["completion_tokens"] <= 256  # not the model's whole context
    for cmd in commands:
        if cmd.python:
            continue
        if cmd.program == "xdg-open":
            (url,) = [w for w in cmd.words if w.startswith(GATEWAY)]
            page = httpx.get(url.replace(GATEWAY, docs_gateway.url), timeout=60)
            assert page.status_code == 200, url
            continue
        check_answer(cmd, run_shell(cmd, docs_gateway, state, tmp_path), state)


def test_the_shipped_prices_make_hits_save_money(docs_gateway: GatewayProcess) -> None:
    """Every model of the embedded default is priced: a hit says what it saved, and the
    dashboard's USD saved is not $0."""
    chat = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "What does a cache save?"}],
        "temperature": 0,
    }
    requests = [
        ("/v1/chat/completions", chat),
        ("/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": "what a cache saves"}),
        ("/v1/classify", {"model": "sentiment-minilm", "input": "a cache that saves"}),
    ]
    with httpx.Client(base_url=docs_gateway.url, timeout=120) as http:
        for path, body in requests:
            headers = {"authorization": "Bearer my-key"}
            assert http.post(path, json=body, headers=headers).status_code == 200
            hit = http.post(path, json=body, headers=headers)
            assert hit.headers["cf-aig-cache-status"] == "HIT", path
            assert float(hit.headers["x-semcache-saved-usd"]) > 0, path
        admin = {"authorization": f"Bearer {DOC_TOKEN}"}
        overview = http.get("/dashboard/api/overview", headers=admin).json()
        assert overview["totals"]["usd_saved"] > 0
        page = http.get("/dashboard/overview", headers=admin).text
        assert re.search(r'id="usd-saved">\$0\.0*[1-9]', page), "USD saved is $0"

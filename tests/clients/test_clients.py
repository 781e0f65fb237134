"""Third-party clients against one ``semcache serve`` on the embedded default (docs/clients.md).

Each client makes its representative calls the way its users write them, pointed at the
gateway by its base URL. SmolLM2-135M answers weakly, so the tests assert shapes and flows:
some text, a tool call where a named ``tool_choice`` makes vLLM decode one by its grammar, a
parsed structured answer, vectors of MiniLM's 384 dimensions, and a repeat answered from the
exact cache (the ``cf-aig-cache-status`` header where the client exposes headers, else the
gateway's ``semcache_exact_hits_total``).

The clients are imported where they are used: collecting the module stays quick (litellm's
import alone takes seconds).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socketserver
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import pytest
from pydantic import BaseModel

from tests.clients.conftest import EMBEDDINGS, MODEL, Gateway

pytestmark = pytest.mark.slow

CACHE_STATUS = "cf-aig-cache-status"
ACCOUNT = "acc-clients"


def unique(question: str) -> str:
    """The question made unique to this run: the test data dir's cache persists across runs,
    and a first call must reach vLLM."""
    return f"{question} (run {uuid.uuid4().hex[:8]})"


class Weather(BaseModel):
    """The weather of a city."""

    city: str


def get_weather(city: str) -> str:
    """Get the current weather of a city."""
    return f"It is sunny in {city}."


# --- langchain-openai ------------------------------------------------------------------------


def chat_openai(gateway: Gateway, **kwargs: Any) -> Any:
    from langchain_openai import ChatOpenAI

    settings: dict[str, Any] = {"temperature": 0, "max_tokens": 16, "max_retries": 0}
    return ChatOpenAI(
        model=MODEL,
        base_url=f"{gateway.url}/v1",
        api_key="x",  # type: ignore[arg-type]
        **{**settings, **kwargs},
    )


def test_langchain_chat_openai_invokes_and_a_repeat_is_a_cache_hit(gateway: Gateway) -> None:
    llm = chat_openai(gateway, include_response_headers=True)
    question = unique("What is the capital of France?")
    first = llm.invoke(question)
    assert isinstance(first.content, str) and first.content.strip()
    assert first.response_metadata["headers"][CACHE_STATUS] == "MISS"
    again = llm.invoke(question)
    assert again.response_metadata["headers"][CACHE_STATUS] == "HIT"
    assert again.content == first.content


def test_langchain_chat_openai_streams(gateway: Gateway) -> None:
    llm = chat_openai(gateway)
    chunks = list(llm.stream(unique("Name a colour.")))
    assert len(chunks) > 1
    assert "".join(str(c.content) for c in chunks).strip()


def test_langchain_chat_openai_calls_a_bound_tool(gateway: Gateway) -> None:
    llm = chat_openai(gateway, max_tokens=32).bind_tools([get_weather], tool_choice="get_weather")
    message = llm.invoke(unique("What is the weather in Paris?"))
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    assert isinstance(message.tool_calls[0]["args"].get("city"), str)


def test_langchain_chat_openai_structured_output(gateway: Gateway) -> None:
    llm = chat_openai(gateway, max_tokens=32).with_structured_output(Weather)
    answer = llm.invoke(unique("Which city is the capital of France?"))
    assert isinstance(answer, Weather)


def test_langchain_chat_openai_responses_api(gateway: Gateway) -> None:
    llm = chat_openai(gateway, use_responses_api=True)
    message = llm.invoke(unique("What is the capital of France?"))
    assert message.text.strip()
    assert message.response_metadata.get("id", "").startswith("resp")


def test_langchain_openai_embeddings(gateway: Gateway) -> None:
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model=EMBEDDINGS,
        base_url=f"{gateway.url}/v1",
        api_key="x",  # type: ignore[arg-type]
        check_embedding_ctx_length=False,  # else it sends tiktoken's token ids, not text
        max_retries=0,
    )
    vectors = embeddings.embed_documents(["Paris", "France"])
    assert [len(v) for v in vectors] == [384, 384]
    assert len(embeddings.embed_query("Paris")) == 384


# --- langchain-anthropic ---------------------------------------------------------------------


def chat_anthropic(gateway: Gateway, **kwargs: Any) -> Any:
    from langchain_anthropic import ChatAnthropic

    settings: dict[str, Any] = {"temperature": 0, "max_tokens": 16, "max_retries": 0}
    return ChatAnthropic(
        model=MODEL,
        base_url=gateway.url,
        api_key="x",  # type: ignore[arg-type]
        **{**settings, **kwargs},
    )


def test_langchain_chat_anthropic_invokes_and_streams(gateway: Gateway) -> None:
    llm = chat_anthropic(gateway)
    question = unique("What is the capital of France?")
    before = gateway.exact_hits()
    message = llm.invoke(question)
    assert message.text.strip()
    assert message.response_metadata["stop_reason"] in ("end_turn", "max_tokens")
    chunks = list(llm.stream(question))  # the same question streamed: from the exact cache
    assert "".join(c.text for c in chunks) == message.text
    assert gateway.exact_hits() == before + 1


OVER_THE_WINDOW = "Repeat after me: " + "lorem ipsum dolor sit amet " * 1200  # > 4096 tokens


def test_langchain_context_overflow_error_from_chat_openai(gateway: Gateway) -> None:
    from langchain_core.exceptions import ContextOverflowError

    with pytest.raises(ContextOverflowError):
        chat_openai(gateway).invoke(unique(OVER_THE_WINDOW))


def test_langchain_context_overflow_error_from_chat_anthropic(gateway: Gateway) -> None:
    from langchain_core.exceptions import ContextOverflowError

    with pytest.raises(ContextOverflowError):
        chat_anthropic(gateway).invoke(unique(OVER_THE_WINDOW))


# --- litellm ---------------------------------------------------------------------------------


def test_litellm_openai_provider_and_a_repeat_is_a_cache_hit(gateway: Gateway) -> None:
    import litellm

    kwargs: dict[str, Any] = {
        "model": f"openai/{MODEL}",
        "api_base": f"{gateway.url}/v1",
        "api_key": "x",
        "messages": [{"role": "user", "content": unique("What is the capital of France?")}],
        "temperature": 0,
        "max_tokens": 16,
    }
    first = litellm.completion(**kwargs)
    assert first.choices[0].message.content.strip()
    before = gateway.exact_hits()
    again = litellm.completion(**kwargs)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert gateway.exact_hits() == before + 1
    chunks = list(litellm.completion(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip()


def test_litellm_anthropic_provider(gateway: Gateway) -> None:
    import litellm

    answer = litellm.completion(
        model=f"anthropic/{MODEL}",
        api_base=gateway.url,
        api_key="x",
        messages=[{"role": "user", "content": unique("What is the capital of France?")}],
        temperature=0,
        max_tokens=16,
    )
    assert answer.choices[0].message.content.strip()
    assert answer.usage.completion_tokens > 0


def test_litellm_embeddings(gateway: Gateway) -> None:
    import litellm

    result = litellm.embedding(
        model=f"openai/{EMBEDDINGS}",
        api_base=f"{gateway.url}/v1",
        api_key="x",
        input=["Paris", "France"],
    )
    assert [len(item["embedding"]) for item in result.data] == [384, 384]


# --- openai-agents ---------------------------------------------------------------------------


def agent_model(gateway: Gateway, kind: str) -> Any:
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    if kind == "chat":
        return OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    return OpenAIResponsesModel(model=MODEL, openai_client=client)


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_openai_agents_run_an_agent(gateway: Gateway, kind: str) -> None:
    from agents import Agent, ModelSettings, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    agent = Agent(
        name="assistant",
        instructions="Answer in one short sentence.",
        model=agent_model(gateway, kind),
        model_settings=ModelSettings(temperature=0, max_tokens=16),
    )
    result = Runner.run_sync(agent, unique("What is the capital of France?"), max_turns=1)
    assert isinstance(result.final_output, str) and result.final_output.strip()


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_openai_agents_call_a_function_tool(gateway: Gateway, kind: str) -> None:
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.items import ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)
    agent = Agent(
        name="assistant",
        instructions="Use the tool to answer.",
        model=agent_model(gateway, kind),
        tools=[function_tool(get_weather)],
        # a named tool_choice: vLLM decodes the call by its grammar; the SDK resets it after
        # the call, and the second turn answers with the tool's output
        model_settings=ModelSettings(temperature=0, max_tokens=32, tool_choice="get_weather"),
    )
    result = Runner.run_sync(agent, unique("What is the weather in Paris?"), max_turns=3)
    kinds = [type(item) for item in result.new_items]
    assert ToolCallItem in kinds and ToolCallOutputItem in kinds, result.new_items
    assert isinstance(result.final_output, str)


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_openai_agents_stream(gateway: Gateway, kind: str) -> None:
    from agents import Agent, ModelSettings, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    agent = Agent(
        name="assistant",
        instructions="Answer in one short sentence.",
        model=agent_model(gateway, kind),
        model_settings=ModelSettings(temperature=0, max_tokens=16),
    )

    async def run() -> tuple[list[str], Any]:
        result = Runner.run_streamed(agent, unique("Name a colour."), max_turns=1)
        deltas = []
        async for event in result.stream_events():
            data = getattr(event, "data", None)
            if event.type == "raw_response_event" and data is not None:
                if getattr(data, "type", "") == "response.output_text.delta":
                    deltas.append(data.delta)
        return deltas, result.final_output

    deltas, final = asyncio.run(run())
    assert len(deltas) > 1
    assert "".join(deltas) == final


# --- llama-index OpenAILike ------------------------------------------------------------------


def openai_like(gateway: Gateway, *, chat: bool) -> Any:
    from llama_index.llms.openai_like import OpenAILike

    return OpenAILike(
        model=MODEL,
        api_base=f"{gateway.url}/v1",
        api_key="x",
        is_chat_model=chat,
        context_window=4096,
        temperature=0,
        max_tokens=16,
        max_retries=0,
    )


def test_llama_index_openai_like_complete_and_chat(gateway: Gateway) -> None:
    from llama_index.core.llms import ChatMessage

    completion = openai_like(gateway, chat=False).complete(unique("The capital of France is"))
    assert completion.text.strip()
    llm = openai_like(gateway, chat=True)
    reply = llm.chat([ChatMessage(role="user", content=unique("What is the capital of France?"))])
    assert reply.message.role == "assistant" and (reply.message.content or "").strip()
    streamed = list(llm.stream_complete(unique("Name a colour.")))
    assert streamed and streamed[-1].text.strip()


# --- the Cloudflare SDK (Workers AI REST) ----------------------------------------------------


def cloudflare_client(gateway: Gateway) -> Any:
    from cloudflare import Cloudflare

    return Cloudflare(api_token="x", base_url=f"{gateway.url}/client/v4", max_retries=0)


def test_cloudflare_ai_run_messages_and_a_repeat_is_a_cache_hit(gateway: Gateway) -> None:
    client = cloudflare_client(gateway)
    model = "@cf/meta/llama-3.1-8b-instruct"  # an alias of SmolLM2 in the default
    body: dict[str, Any] = {
        "account_id": ACCOUNT,
        "messages": [{"role": "user", "content": unique("What is the capital of France?")}],
        "max_tokens": 16,
        "temperature": 0,
    }
    first = client.ai.with_raw_response.run(model, **body)
    assert first.headers[CACHE_STATUS] == "MISS"
    answer = first.parse()
    assert isinstance(answer, dict) and answer["response"].strip()
    again = client.ai.with_raw_response.run(model, **body)
    assert again.headers[CACHE_STATUS] == "HIT"
    assert again.parse()["response"] == answer["response"]


def test_cloudflare_ai_run_tools(gateway: Gateway) -> None:
    client = cloudflare_client(gateway)
    answer = client.ai.run(
        "@cf/huggingface/smollm2-135m-instruct",
        account_id=ACCOUNT,
        messages=[{"role": "user", "content": unique("What is the weather in Paris?")}],
        tools=[
            {
                "name": "get_weather",
                "description": "Get the current weather of a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            }
        ],
        extra_body={"tool_choice": {"type": "function", "name": "get_weather"}},
        max_tokens=32,
        temperature=0,
    )
    assert isinstance(answer, dict)
    assert [call["name"] for call in answer["tool_calls"]] == ["get_weather"]


def test_cloudflare_ai_run_embeddings_and_classification(gateway: Gateway) -> None:
    client = cloudflare_client(gateway)
    vectors = client.ai.run(
        "@cf/baai/bge-small-en-v1.5", account_id=ACCOUNT, text=["Paris", "France"]
    )
    assert isinstance(vectors, dict) and vectors["shape"] == [2, 384]
    assert [len(v) for v in vectors["data"]] == [384, 384]
    labels = client.ai.run(
        "@cf/huggingface/distilbert-sst-2-int8", account_id=ACCOUNT, text="I love this film."
    )
    assert isinstance(labels, list)
    assert {item.label for item in labels} == {"POSITIVE", "NEGATIVE"}


def test_cloudflare_ai_models_list(gateway: Gateway) -> None:
    client = cloudflare_client(gateway)
    names = {model["name"] for model in client.ai.models.list(account_id=ACCOUNT)}
    assert {
        "@cf/huggingface/smollm2-135m-instruct",
        "@cf/sentence-transformers/all-minilm-l6-v2",
        "@cf/huggingface/distilbert-sst-2-int8",
    } <= names, names


# --- Claude Code (npm) -----------------------------------------------------------------------

CLAUDE_CODE = "@anthropic-ai/claude-code@>=2.1.0 <3"


@pytest.fixture(scope="module")
def claude(data_dir: Path) -> Path:
    """Claude Code from npm, in a folder of the test data dir (installed once, checked each run)."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the Claude Code tests install it from npm")
    folder = data_dir / "npm" / "claude-code"
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [npm, "install", "--prefix", str(folder), "--no-audit", "--no-fund", CLAUDE_CODE],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return folder / "node_modules" / ".bin" / "claude"


class ForwardProxyRecorder:
    """A forward proxy on loopback that records each request line it is sent (``CONNECT
    host:443``, ``GET http://...``) and refuses it: Claude Code's proxy, so any host it tries
    to reach outside the gateway is seen."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        recorder = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(4096).decode(errors="replace").strip()
                recorder.requests.append(line)
                self.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def claude_env(
    gateway: Gateway, home: Path, proxy: ForwardProxyRecorder, **more: str
) -> dict[str, str]:
    """Only loopback: the gateway as Anthropic's API, any other host through the recording
    proxy; telemetry, error reports, updates and other nonessential traffic off."""
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": gateway.url,
        "ANTHROPIC_API_KEY": "x",
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "HTTPS_PROXY": proxy.url,
        "HTTP_PROXY": proxy.url,
        "NO_PROXY": "127.0.0.1,localhost",
        **more,
    }


@pytest.fixture
def proxy() -> Iterator[ForwardProxyRecorder]:
    recorder = ForwardProxyRecorder()
    try:
        yield recorder
    finally:
        recorder.close()


MINIMAL = ["--bare", "--system-prompt", "Answer in one short sentence.", "--tools", ""]
"""Claude Code's minimal mode: no hooks, plugins, CLAUDE.md or MCP, a short system prompt and
no tools (``tools: []``), so the prompt fits SmolLM2's 4096-token window."""


def run_claude(claude: Path, cwd: Path, env: dict[str, str], *args: str) -> CompletedProcess[str]:
    return subprocess.run(
        [str(claude), "-p", unique("What is the capital of France?"), *args],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_claude_code_print_mode_answers(
    gateway: Gateway, claude: Path, proxy: ForwardProxyRecorder, tmp_path: Path
) -> None:
    # its default max_tokens (32000) exceeds the window: asked for fewer
    env = claude_env(gateway, tmp_path, proxy, CLAUDE_CODE_MAX_OUTPUT_TOKENS="64")
    before = gateway.metric("semcache_requests_total", {"route": "/v1/messages"})
    done = run_claude(claude, tmp_path, env, *MINIMAL, "--no-session-persistence")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip()
    assert gateway.metric("semcache_requests_total", {"route": "/v1/messages"}) > before
    assert proxy.requests == []


def test_claude_code_with_its_defaults_says_the_prompt_is_too_long(
    gateway: Gateway, claude: Path, proxy: ForwardProxyRecorder, tmp_path: Path
) -> None:
    """Its default system prompt and tools alone exceed SmolLM2's window: ``claude -p`` ends in
    its own message and exits 1, having reached no host but the gateway."""
    done = run_claude(claude, tmp_path, claude_env(gateway, tmp_path, proxy))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.startswith("Prompt is too long"), done.stdout
    assert proxy.requests == []


def test_claude_code_minimal_with_its_default_max_tokens_says_the_prompt_is_too_long(
    gateway: Gateway, claude: Path, proxy: ForwardProxyRecorder, tmp_path: Path
) -> None:
    """A short prompt with its default ``max_tokens`` (32000): on Anthropic's wording of the
    refusal Claude Code retries with the window less the input less 1000, but only where that
    leaves at least 3000 tokens (seen against a stand-in server with an 8192-token window);
    SmolLM2's 4096 leave fewer, so it ends in its own message."""
    done = run_claude(claude, tmp_path, claude_env(gateway, tmp_path, proxy), *MINIMAL)
    assert done.returncode == 1
    assert done.stdout.startswith("Prompt is too long"), done.stdout

"""A steady mixed load on a gateway fleet, and the check that nothing was lost or served wrong.

Each worker sends, in turn: a hit (a prompt answered before the load), a miss (a new prompt),
a stream, a Workers-AI batch submit, a file upload and a purge of a stored answer. A request
refused for now (429, 502, 503, 504, no answer, a stream cut short) is sent again after its
``Retry-After`` (at most 1 s here), up to ``tries`` times, as a client of the fleet would.
Afterwards :meth:`FleetLoad.check` polls every batch (each item must end with exactly one
result, all good) and reads every acknowledged file back (byte for byte); a hit whose answer
is not the one first stored under its prompt counts as wrong. The fault tests of
``tests/server/test_cluster.py`` and ``bench/failover.py`` share it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from harness.cluster import HOST_HEADER, MODEL_ID, TOKEN, WORKERS_AI_MODEL, Cluster

KINDS = ("hit", "miss", "stream", "batch", "upload", "purge")
RETRY_STATUSES = frozenset({0, 429, 502, 503, 504})
"""0: no answer (connection refused or reset), or a stream cut before ``[DONE]``."""
SENTENCE = "The cat reads a book near the window. "


@dataclass
class Outcome:
    kind: str
    began: float
    """``time.monotonic()`` when the first try was sent."""
    ended: float
    status: int
    """The last try's status (0: none)."""
    tries: int
    host: str = ""


@dataclass
class Check:
    """What :meth:`FleetLoad.check` found after the load."""

    batches: int = 0
    items: int = 0
    items_lost: int = 0
    """Items without exactly one good result (or whole batches that never finished)."""
    files: int = 0
    files_lost: int = 0
    wrong: int = 0
    """Cache hits whose answer was not the stored one."""
    notes: list[str] = field(default_factory=list)


def prompt(words: int = 3) -> str:
    """A prompt no earlier request asked (the tiny tokenizer knows these words)."""
    return f"Story {uuid.uuid4().hex}. " + SENTENCE * words


class FleetLoad:
    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        model: str,
        workers_ai_model: str,
        host_header: str = "",
        workers: int = 3,
        tries: int = 12,
        timeout_s: float = 60.0,
    ) -> None:
        self.base_url = base_url
        self.headers = {"Authorization": f"Bearer {token}"}
        self.model = model
        self.batch_path = f"/client/v4/accounts/acc/ai/run/{workers_ai_model}"
        self.host_header = host_header
        self.workers = workers
        self.tries = tries
        self.timeout_s = timeout_s
        self.outcomes: list[Outcome] = []
        self.stored: list[tuple[dict[str, Any], str]] = []
        """Prompts answered before the load, with the answer a hit must repeat."""
        self.keys: list[str] = []
        """Cache keys of answers stored to be purged."""
        self.batches: list[tuple[str, int]] = []
        self.files: dict[str, bytes] = {}
        self.wrong_hits = 0

    @classmethod
    def through_lb(cls, cluster: Cluster, workers: int = 3) -> FleetLoad:
        """The load on ``cluster``'s load balancer, as its one tenant."""
        return cls(
            cluster.lb_url,
            TOKEN,
            model=MODEL_ID,
            workers_ai_model=WORKERS_AI_MODEL,
            host_header=HOST_HEADER,
            workers=workers,
        )

    def chat(self, text: str, **extra: Any) -> dict[str, Any]:
        body = {"model": self.model, "messages": [{"role": "user", "content": text}]}
        return {**body, "max_tokens": 4, "temperature": 0, **extra}

    async def prepare(self, client: httpx.AsyncClient, prompts: int = 6) -> None:
        """Store the answers the load hits, and some to purge."""
        for i in range(prompts * 2):
            body = self.chat(prompt())
            r = await client.post(
                f"{self.base_url}/v1/chat/completions", json=body, headers=self.headers
            )
            r.raise_for_status()
            if i % 2:
                self.keys.append(r.headers.get("x-semcache-key", ""))
            else:
                self.stored.append((body, r.json()["choices"][0]["message"]["content"]))

    # -- the load -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Send requests until ``stop`` is set, ``workers`` at a time."""
        await asyncio.gather(*(self._worker(k, stop) for k in range(self.workers)))

    async def _worker(self, k: int, stop: asyncio.Event) -> None:
        timeout = httpx.Timeout(self.timeout_s, connect=5.0)
        async with httpx.AsyncClient(timeout=timeout) as client:
            i = k
            while not stop.is_set():
                kind = KINDS[i % len(KINDS)]
                await self._send(client, kind, i)
                i += 1

    async def _send(self, client: httpx.AsyncClient, kind: str, i: int) -> None:
        act = self._action(client, kind, i)
        began = time.monotonic()
        status, host = 0, ""
        for attempt in range(1, self.tries + 1):
            try:
                status, host, wait_s = await act()
            except httpx.HTTPError:
                status, wait_s = 0, 0.5
            if status not in RETRY_STATUSES or attempt == self.tries:
                break
            await asyncio.sleep(min(wait_s, 1.0))
        self.outcomes.append(Outcome(kind, began, time.monotonic(), status, attempt, host))

    def _action(
        self, client: httpx.AsyncClient, kind: str, i: int
    ) -> Callable[[], Awaitable[tuple[int, str, float]]]:
        """One try of request ``i`` of ``kind``: (status, answering host, retry wait)."""
        url = self.base_url
        headers = self.headers
        if kind == "hit":
            body, answer = self.stored[i % len(self.stored)]

            async def hit() -> tuple[int, str, float]:
                r = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
                if r.status_code == 200 and r.headers.get("cf-aig-cache-status") == "HIT":
                    if r.json()["choices"][0]["message"]["content"] != answer:
                        self.wrong_hits += 1
                return self._answer(r)

            return hit
        if kind in ("miss", "stream"):
            body = self.chat(prompt(), stream=kind == "stream")

            async def generate() -> tuple[int, str, float]:
                if not body["stream"]:
                    r = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
                    return self._answer(r)
                async with client.stream(
                    "POST", f"{url}/v1/chat/completions", json=body, headers=headers
                ) as r:
                    data = b"".join([chunk async for chunk in r.aiter_bytes()])
                    status, host, wait = self._answer(r)
                    if status == 200 and b"data: [DONE]" not in data:
                        return 0, host, 0.5  # cut short
                    return status, host, wait

            return generate
        if kind == "batch":
            items = [{"prompt": prompt(), "max_tokens": 4} for _ in range(2)]

            async def submit() -> tuple[int, str, float]:
                r = await client.post(
                    f"{url}{self.batch_path}?queueRequest=true",
                    json={"requests": items},
                    headers=headers,
                )
                if r.status_code == 200:
                    self.batches.append((str(r.json()["result"]["request_id"]), len(items)))
                return self._answer(r)

            return submit
        if kind == "upload":
            data = b'{"custom_id": "%d-%s"}\n' % (i, uuid.uuid4().hex.encode())

            async def upload() -> tuple[int, str, float]:
                r = await client.post(
                    f"{url}/v1/files",
                    files={"file": ("in.jsonl", data)},
                    data={"purpose": "batch"},
                    headers=headers,
                )
                if r.status_code == 200:
                    self.files[str(r.json()["id"])] = data
                return self._answer(r)

            return upload
        key = self.keys[i % len(self.keys)]

        async def purge() -> tuple[int, str, float]:
            r = await client.post(
                f"{url}/admin/cache/purge", json={"kind": "key", "target": key}, headers=headers
            )
            return self._answer(r)

        return purge

    def _answer(self, r: httpx.Response) -> tuple[int, str, float]:
        try:
            wait = float(r.headers.get("retry-after", "0.5"))
        except ValueError:
            wait = 0.5
        return r.status_code, r.headers.get(self.host_header, "") if self.host_header else "", wait

    # -- afterwards -------------------------------------------------------------------------

    async def check(self, client: httpx.AsyncClient, timeout_s: float = 180.0) -> Check:
        """Every batch item has one good result, every acknowledged file reads back."""
        found = Check(
            batches=len(self.batches),
            items=sum(n for _, n in self.batches),
            files=len(self.files),
            wrong=self.wrong_hits,
        )
        deadline = time.monotonic() + timeout_s
        for request_id, n in self.batches:
            results = await self._results(client, request_id, deadline)
            good = (
                results is not None
                and sorted(r["id"] for r in results) == list(range(n))
                and all(r["success"] for r in results)
            )
            if not good:
                found.items_lost += n if results is None else n - sum(r["success"] for r in results)
                found.notes.append(f"batch {request_id}: {results}")
        for file_id, data in self.files.items():
            r = await client.get(
                f"{self.base_url}/v1/files/{file_id}/content", headers=self.headers
            )
            if r.status_code != 200 or r.content != data:
                found.files_lost += 1
                found.notes.append(f"file {file_id}: {r.status_code}")
        return found

    async def _results(
        self, client: httpx.AsyncClient, request_id: str, deadline: float
    ) -> list[dict[str, Any]] | None:
        while time.monotonic() < deadline:
            try:
                r = await client.post(
                    f"{self.base_url}{self.batch_path}",
                    json={"request_id": request_id},
                    headers=self.headers,
                )
            except httpx.HTTPError:
                await asyncio.sleep(0.5)
                continue
            if r.status_code == 200:
                result = r.json()["result"]
                if "responses" in result:
                    responses: list[dict[str, Any]] = result["responses"]
                    return responses
            await asyncio.sleep(0.5)
        return None

    # -- figures ----------------------------------------------------------------------------

    def failed(self) -> list[Outcome]:
        """Requests that did not succeed in the end, retries included."""
        return [o for o in self.outcomes if o.status != 200]

    def retried(self, after: float = 0.0) -> list[Outcome]:
        """Requests begun after ``after`` that needed more than one try."""
        return [o for o in self.outcomes if o.tries > 1 and o.began >= after]

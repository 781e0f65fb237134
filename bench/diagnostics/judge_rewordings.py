"""How a verified partition's judges see the answers to a question and to its rewording.

    .venv/bin/semcache serve --port 8391 &   # or any gateway with a chat model
    .venv/bin/python -m bench.diagnostics.judge_rewordings --url http://127.0.0.1:8391

A verified partition learns from judged explores: the backend's answer to the new request
against the cached answer to its nearest entry (``semcache.semantic.verified.judges``).
This asks the gateway's chat model both questions of QQP test pairs at temperature 0
(``no-store``, so the cache answers nothing) and judges the two answers with the ``exact``
and ``embedding`` judges, in three groups:

- pairs QQP labels duplicates (the stream evaluation counts a hit between them as right);
- pairs the label calls different that are the same question reworded (the questions were
  never paired in QQP, so their clusters differ);
- pairs that really are different questions.

Prints each pair's verdicts and the cosine of its answers, and a line per group.
"""

from __future__ import annotations

import argparse
import asyncio

import httpx

from semcache.semantic.verified.judges import EmbeddingJudge, ExactJudge, Judge
from server.encoders import load_encoder

GROUPS: dict[str, list[tuple[str, str]]] = {
    "labelled duplicates": [
        ("How can I become a celebrity bodyguard?", "How can I become celebrity's bodyguard?"),
        ("What's the population of the usa?", "What is the population of the USA?"),
        ("Why do dogs pee on vehicle tyres?", "Why do dogs pee on tyres?"),
        (
            "Is technology making us dumber or smarter?",
            "Is technology making us smarter or dumber?",
        ),
        (
            "What are the steps to become an IAS officer?",
            "What steps are to be taken to become an IAS officer?",
        ),
        ("Can I earn money using Quora?", "Can I earn some money using Quora?"),
    ],
    "unpaired rewordings": [
        (
            "Why natural resources are important for us?",
            "Why are natural resources important for us?",
        ),
        (
            "How does Europe's basketball leagues compare to the NBA?",
            "How do Europe's basketball leagues compare to the NBA?",
        ),
        ("What is the best cab service in pune?", "Which is the best cab service in Pune?"),
        ("How messi is better than Ronaldo?", "How is Messi better than Ronaldo?"),
        ("What are some examples of propaganda?", "What are some example of propaganda?"),
        (
            "Which universities for MS in CS should I apply to?",
            "Which universities should I apply for MS in CS?",
        ),
        (
            "What is the best magazine for current affairs?",
            "What are the Best current affairs magazine?",
        ),
    ],
    "different questions": [
        (
            "What is the best ROM for Samsung Galaxy S Duos 2 GT S7582?",
            "What is the best ROM for Samsung Galaxy S Duos GT S7582?",
        ),
        (
            "What are the type of questions which belong to human behavior topic and not to "
            "human nature topic?",
            "What are the type of questions which belong to human nature topic and not to "
            "human behavior topic?",
        ),
    ],
}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8391", help="the gateway")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--token", default="judge-rewordings", help="bearer token")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--min-similarity", type=float, default=0.95, help="embedding judge")
    args = parser.parse_args()
    encoder = load_encoder()
    judges: dict[str, Judge] = {
        "exact": ExactJudge(),
        "embedding": EmbeddingJudge(encoder, args.min_similarity),
    }
    headers = {"authorization": f"Bearer {args.token}", "cache-control": "no-store"}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=300) as client:

        async def answer(question: str) -> str:
            reply = await client.post(
                "/v1/chat/completions",
                json={
                    "model": args.model,
                    "temperature": 0,
                    "max_tokens": args.max_tokens,
                    "messages": [{"role": "user", "content": question}],
                },
            )
            reply.raise_for_status()
            return str(reply.json()["choices"][0]["message"]["content"])

        try:
            for group, pairs in GROUPS.items():
                same = dict.fromkeys(judges, 0)
                for cached_q, asked_q in pairs:
                    cached, fresh = await answer(cached_q), await answer(asked_q)
                    verdicts = {n: await j.same(cached, fresh, asked_q) for n, j in judges.items()}
                    for name, verdict in verdicts.items():
                        same[name] += bool(verdict)
                    vectors = await encoder.encode([cached, fresh])
                    shown = " ".join(f"{n}={v}" for n, v in verdicts.items())
                    cosine = float(vectors[0] @ vectors[1])
                    print(f"  {shown} answers' cosine {cosine:.3f} | {asked_q}")
                counts = ", ".join(f"{n} {c}/{len(pairs)}" for n, c in same.items())
                print(f"{group}: judged the same answer by {counts}")
        finally:
            await encoder.aclose()


if __name__ == "__main__":
    asyncio.run(main())

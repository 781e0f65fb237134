"""The runs: the 1- and 8-request cells in rounds of alternating batches, and the sustained
cells in alternating windows (with the control, when asked)."""

from __future__ import annotations

from bench.lib.overhead.batches import Batch, run_batch, run_sustained
from bench.lib.overhead.cells import CELLS, CONTROL, SUSTAINED, Cell
from bench.lib.overhead.chat import RequestFailed, Target
from bench.lib.support import stderr_printer

say = stderr_printer("overhead")


Results = dict[tuple[Cell, str], list[Batch]]


async def run_workload(
    targets: tuple[Target, Target], requests: int, warmup: int, max_tokens: int
) -> Results:
    """Every cell, ``requests`` requests per target, in rounds of alternating batches."""
    uids = iter(range(10**7))
    plan = {cell: max(1, -(-requests // cell.concurrency)) for cell in CELLS}
    results: Results = {(cell, t.name): [] for cell in CELLS for t in targets}
    rounds = max(plan.values())
    for rnd in range(-warmup, rounds):
        order = targets if rnd % 2 == 0 else targets[::-1]
        for cell in CELLS:
            if rnd >= plan[cell]:
                continue
            for target in order:
                batch = await run_batch(target, cell, uids, max_tokens)
                if rnd >= 0:
                    results[cell, target.name].append(batch)
                elif batch.errors:
                    raise RequestFailed(f"warm-up to {target.name} failed: {batch.errors[0]}")
        if rnd >= 0 and (rnd + 1) % max(1, rounds // 4) == 0:
            say(f"round {rnd + 1}/{rounds}")
    return results


async def run_sustained_workload(
    targets: tuple[Target, Target],
    rounds: int,
    seconds: float,
    max_tokens: int,
    vllm_url: str,
    control: bool,
) -> Results:
    """The sustained cells: ``rounds`` windows of ``seconds`` per target, alternating (with
    the control, the gateway always in the middle: the control burns what the gateway used
    in its window just before, or in the round before)."""
    direct, gateway = targets
    uids = iter(range(10**7, 2 * 10**7))
    names = [direct.name, gateway.name] + ([CONTROL] if control else [])
    results: Results = {(cell, name): [] for cell in SUSTAINED for name in names}
    gateway_share = dict.fromkeys(SUSTAINED, 0.0)
    for rnd in range(rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for cell in SUSTAINED:
            for name in order:
                target = gateway if name == gateway.name else direct
                burn = gateway_share[cell] if name == CONTROL else None
                batch = await run_sustained(
                    target, cell, uids, max_tokens, seconds, vllm_url=vllm_url, burn_fraction=burn
                )
                if name == gateway.name:
                    gateway_share[cell] = max(0.0, batch.server_cpu_s / batch.wall_s)
                results[cell, name].append(batch)
        say(f"sustained round {rnd + 1}/{rounds}")
    return results

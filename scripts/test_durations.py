"""Where the suite's time goes, from pytest's JUnit XML: each module's share, and each xdist
worker's load.

    pytest ... --junitxml=run.xml          # `make test PYTEST_ARGS=--junitxml=run.xml`
    python scripts/test_durations.py run.xml [--top 20]

A test's time in the XML is its setup, call and teardown together, so a module fixture's
start (a vLLM server, a gateway) counts in the module's first test, and a session fixture's
start in the first test of each worker that uses it. ``tests/conftest.py`` tags each test
with its worker and start time: with those, the report also shows each worker's busy time
and when it finished (a worker that finishes early sat idle while the other ran on).
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Module:
    tests: int = 0
    seconds: float = 0.0
    failed: int = 0
    workers: set[str] = field(default_factory=set)
    first_start: float | None = None
    last_end: float | None = None


def module_of(classname: str) -> str:
    """``tests.server.test_cli.TestX`` -> ``tests/server/test_cli.py`` (the longest prefix
    that is a file in this checkout; the dotted name if none is)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (REPO_ROOT / path).is_file():
            return path
    return classname


def read(paths: list[Path]) -> dict[str, Module]:
    modules: dict[str, Module] = defaultdict(Module)
    for path in paths:
        for case in ET.parse(path).iter("testcase"):
            module = modules[module_of(case.get("classname", "?"))]
            seconds = float(case.get("time", 0) or 0)
            module.tests += 1
            module.seconds += seconds
            if case.find("failure") is not None or case.find("error") is not None:
                module.failed += 1
            props = {p.get("name"): p.get("value") for p in case.iter("property")}
            if worker := props.get("worker"):
                module.workers.add(worker)
            if (start := props.get("started")) is not None:
                begin = float(start)
                module.first_start = min(module.first_start or begin, begin)
                module.last_end = max(module.last_end or 0.0, begin + seconds)
    return modules


def report(modules: dict[str, Module], top: int) -> str:
    total = sum(m.seconds for m in modules.values())
    tests = sum(m.tests for m in modules.values())
    lines = [f"{tests} tests in {len(modules)} modules: {total:.0f} s of test time"]
    ranked = sorted(modules.items(), key=lambda kv: kv[1].seconds, reverse=True)
    lines.append(f"{'seconds':>8} {'share':>6} {'cum':>6} {'tests':>5}  module")
    cumulative = 0.0
    for name, module in ranked[:top]:
        cumulative += module.seconds
        where = f"  [{','.join(sorted(module.workers))}]" if module.workers else ""
        failed = f"  ({module.failed} failed)" if module.failed else ""
        lines.append(
            f"{module.seconds:8.1f} {100 * module.seconds / total:5.1f}% "
            f"{100 * cumulative / total:5.1f}% {module.tests:5d}  {name}{where}{failed}"
        )
    rest = ranked[top:]
    if rest:
        seconds = sum(m.seconds for _, m in rest)
        lines.append(
            f"{seconds:8.1f} {100 * seconds / total:5.1f}%        "
            f"{sum(m.tests for _, m in rest):5d}  ({len(rest)} more modules)"
        )
    lines.extend(worker_lines(modules))
    return "\n".join(lines)


def worker_lines(modules: dict[str, Module]) -> list[str]:
    """Each worker's busy seconds, first start and last end (needs the worker tags)."""
    busy: dict[str, float] = defaultdict(float)
    spans: dict[str, list[float]] = {}
    last: dict[str, tuple[float, str]] = {}
    for name, module in modules.items():
        if len(module.workers) != 1 or module.first_start is None or module.last_end is None:
            continue
        (worker,) = module.workers
        busy[worker] += module.seconds
        span = spans.setdefault(worker, [module.first_start, module.last_end])
        span[0] = min(span[0], module.first_start)
        span[1] = max(span[1], module.last_end)
        if module.last_end >= last.get(worker, (0.0, ""))[0]:
            last[worker] = (module.last_end, name)
    if not spans:
        return []
    origin = min(span[0] for span in spans.values())
    lines = ["", "worker   busy s   ends at s  last module"]
    for worker in sorted(spans):
        lines.append(
            f"{worker:6} {busy[worker]:8.0f} {spans[worker][1] - origin:11.0f}  {last[worker][1]}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("xml", nargs="+", type=Path, help="JUnit XML file(s) from pytest")
    parser.add_argument("--top", type=int, default=20, help="modules to list (default 20)")
    args = parser.parse_args(argv)
    print(report(read(args.xml), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The stream evaluation's comparisons as text tables (``semcache calibrate --stream``)."""

from __future__ import annotations

from collections.abc import Sequence

from semcache.tuning.stream_eval import Comparison
from semcache.tuning.stream_policies import Outcome


def format_comparison(rows: Sequence[Comparison]) -> str:
    lines = [
        f"{'policy':<34}{'max_error':>10}{'error':>8}{'error<=':>9}{'wrong/req':>10}"
        f"{'hit rate':>10}{'hits':>7}{'explores':>10}{'informed':>10}{'vs static':>11}"
    ]
    for row in rows:
        best = row.top_static.hits if row.top_static else 0
        for name, out in (
            ("verified (cosine)", row.verified_cosine),
            ("verified (verifier prob)", row.verified_verifier),
        ):
            if out is not None:
                ratio = f"{out.hits / best:>10.2f}x" if best else f"{'-':>11}"
                lines.append(_row(name, row.max_error, out, f"{out.informed:>10}") + ratio)
        for name, maybe in (
            ("best static cosine", row.static_cosine),
            ("best static cos+verifier", row.static_verifier),
        ):
            if maybe is None:
                lines.append(f"{name:<34}{row.max_error:>10.2f}   (no threshold meets it)")
            else:
                label = f"{name} ({maybe.policy.split()[-1]})"
                lines.append(_row(label, row.max_error, maybe, f"{'-':>10}"))
        if row.ceiling:
            lines.append(
                f"{'':<4}2x the best static: {2 * best} hits; ceiling at {row.max_error:.2f}: "
                f"{row.ceiling} hits ({_reach(2 * best, row.ceiling)})"
            )
        vcache = row.static_cosine_per_request
        if row.ceiling_per_request and vcache is not None:
            lines.append(
                f"{'':<4}with vCache's error rate (wrong/req <= {row.max_error:.2f}): best "
                f"static cosine ({vcache.policy.split()[-1]}) {vcache.hits} hits, 2x "
                f"{2 * vcache.hits}; ceiling {row.ceiling_per_request} hits "
                f"({_reach(2 * vcache.hits, row.ceiling_per_request)})"
            )
    lines.append(
        "error: wrong answers / answers served; error<=: its one-sided 95 % Wilson bound; "
        "wrong/req: wrong answers / requests (vCache's error rate); explores: requests judged "
        "(backend calls a static threshold would have served or missed alike); informed: "
        "decisions on an entry with judged observations of its own; ceiling: every repeat "
        "served right plus max_error wrong (of those served, or of all requests)"
    )
    return "\n".join(lines)


def format_sources(rows: Sequence[Comparison]) -> str:
    """A mixed stream, per max_error: the verified mode (cosine), the static threshold tuned
    to hold max_error overall and the best one that holds it on every source, each per
    source and overall, beside each source's ceiling."""
    lines = [
        f"{'max_error':>9} {'policy':<30}{'source':<12}{'hits':>6}{'wrong':>6}{'error':>8}"
        f"{'error<=':>9}{'holds':>6}{'ceiling':>8}"
    ]
    for row in rows:
        best = row.static_cosine_every_source
        policies = (
            ("verified (cosine)", row.verified_cosine),
            (_static_name("static, tuned overall", row.static_cosine), row.static_cosine),
            (_static_name("static, every source", best), best),
        )
        for name, out in policies:
            if out is None:
                lines.append(f"{row.max_error:>9.2f} {name:<30}(no threshold meets it)")
                continue
            cells = [*sorted(out.by_source.items()), ("overall", out)]
            for source, part in cells:
                ceil = row.ceiling_by_source.get(source, row.ceiling)
                held = "yes" if part.error_rate <= row.max_error else "NO"
                lines.append(
                    f"{row.max_error:>9.2f} {name:<30}{source:<12}{part.hits:>6}{part.wrong:>6}"
                    f"{part.error_rate:>8.3f}{part.error_upper:>9.3f}{held:>6}{ceil:>8}"
                )
        verified = row.verified_cosine.hits
        ratio = f"{verified / best.hits:.2f}x" if best and best.hits else "-"
        lines.append(
            f"{row.max_error:>9.2f} verified / static every source: {ratio} "
            f"({verified} vs {best.hits if best else 0} hits; ceiling {row.ceiling})"
        )
    lines.append(
        "holds: error <= max_error on that source; error<=: the one-sided 95 % Wilson bound; "
        "ceiling: every repeat of the source served right plus max_error wrong"
    )
    return "\n".join(lines)


def _static_name(name: str, out: Outcome | None) -> str:
    return f"{name} ({out.policy.split()[-1]})" if out is not None else name


def format_seeds(runs: Sequence[tuple[int, Sequence[Comparison]]]) -> str:
    """One line per max_error over streams of several seeds: the verified mode's (cosine)
    hits/wrong and the best static threshold's hits in each, and their ratio."""
    lines = [f"{'max_error':>9}  seed: verified (cosine) hits/wrong vs best static hits/wrong"]
    for k, first in enumerate(runs[0][1] if runs else ()):
        cells = []
        for seed, rows in runs:
            row = rows[k]
            ver = row.verified_cosine
            best = row.top_static
            shown = f"{best.hits}/{best.wrong}" if best else "none"
            ratio = f" {ver.hits / best.hits:.2f}x" if best else ""
            cells.append(f"{seed}: {ver.hits}/{ver.wrong} vs {shown}{ratio}")
        lines.append(f"{first.max_error:>9.2f}  " + "; ".join(cells))
    return "\n".join(lines)


def _reach(target: int, most: int) -> str:
    return "out of reach for any policy" if target > most else "under it"


def _row(name: str, delta: float, out: Outcome, informed: str) -> str:
    return (
        f"{name:<34}{delta:>10.2f}{out.error_rate:>8.3f}{out.error_upper:>9.3f}"
        f"{out.wrong_per_request:>10.4f}{out.hit_rate:>10.3f}{out.hits:>7}{out.explores:>10}"
        f"{informed}"
    )

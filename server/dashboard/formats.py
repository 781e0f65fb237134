"""How the dashboard's templates write figures (Jinja filters)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.template.config import TemplateConfig

from foundation.package_files import package_file

DASH = "\N{EN DASH}"


def number(value: float | None) -> str:
    """Whole numbers without decimals, others with up to three significant decimals."""
    if value is None:
        return DASH
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.3f}".rstrip("0").rstrip(".")


def percent(value: float | None) -> str:
    return DASH if value is None else f"{100 * value:.1f} %"


def millis(seconds: float | None) -> str:
    return DASH if seconds is None else f"{1000 * seconds:,.1f} ms"


def millis_of(ms: float | None) -> str:
    """A duration given in milliseconds (the request log's)."""
    return DASH if ms is None else f"{ms:,.1f} ms"


def usd(value: float | None) -> str:
    return DASH if value is None else f"${value:,.6f}".rstrip("0").rstrip(".")


def size(value: float | None) -> str:
    if value is None:
        return DASH
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return DASH


def age(seconds: float | None) -> str:
    if seconds is None:
        return DASH
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def clock(epoch_s: float | None) -> str:
    """A time of day in UTC."""
    if epoch_s is None:
        return DASH
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d %H:%M:%S")


FILTERS = {
    "clock": clock,
    "number": number,
    "percent": percent,
    "millis": millis,
    "millis_of": millis_of,
    "usd": usd,
    "size": size,
    "age": age,
}


def _add_filters(engine: JinjaTemplateEngine) -> None:
    env: Any = engine.engine
    env.filters.update(FILTERS)


def template_config() -> TemplateConfig[JinjaTemplateEngine]:
    """The dashboard's templates (package data) and their filters."""
    return TemplateConfig(
        directory=package_file("server", "dashboard", "templates"),
        engine=JinjaTemplateEngine,
        engine_callback=_add_filters,
    )

"""A revision from what vLLM servers report: the same report, the same revision."""

from __future__ import annotations

from backends.fleet.remote_revision import REMOTE_PREFIX, remote_revision


def test_the_revision_depends_on_the_set_of_reports_only() -> None:
    a, b = '["/models/a",2048,"0.32.0"]', '["/models/b",2048,"0.32.0"]'
    assert remote_revision([a, b]) == remote_revision([b, a, a])
    # a rolling swap has a revision of its own: neither model's answers are served for it
    assert len({remote_revision([a]), remote_revision([b]), remote_revision([a, b])}) == 3
    assert remote_revision([a]).startswith(REMOTE_PREFIX)

"""``semcache calibrate --stream --sources``: a mixed workload end to end, real encoder."""

from __future__ import annotations

import msgspec
import pytest

from semcache.tuning.stream_eval import Comparison
from server.cli import main

SOURCES = ("classify", "paraphrase", "qqp", "templates")


@pytest.mark.slow
def test_calibrate_reports_a_mixed_stream_per_source(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["calibrate", "--task", "chat", "--stream", "--no-verifier", "--limit", "40"]
    assert main([*args, "--sources", ",".join(SOURCES), "--json"]) == 0
    rows = msgspec.json.decode(capsys.readouterr().out, type=list[Comparison])
    assert [row.max_error for row in rows] == [0.01, 0.02, 0.05, 0.10]
    for row in rows:
        verified = row.verified_cosine
        assert set(verified.by_source) == set(row.ceiling_by_source) == set(SOURCES)
        assert sum(o.requests for o in verified.by_source.values()) == verified.requests
        assert sum(row.ceiling_by_source.values()) <= row.ceiling + len(SOURCES)
        if row.static_cosine_every_source is not None:
            held = row.static_cosine_every_source.by_source.values()
            assert all(o.error_rate <= row.max_error for o in held)
    assert main([*args, "--sources", ",".join(SOURCES)]) == 0
    text = capsys.readouterr().out
    assert "verified / static every source" in text
    assert all(f" {name} " in text for name in SOURCES)


def test_sources_need_the_chat_stream(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--task", "chat", "--sources", "templates"]) == 2
    assert "--stream" in capsys.readouterr().err
    assert main(["calibrate", "--task", "chat"]) == 2  # neither --pairs nor --sources
    assert main(["calibrate", "--stream", "--sources", "nope"]) == 2

"""Presidio's email recognizer, its domain check read from the public-suffix list that
``tldextract`` ships (Presidio's default fetches the list from the network at first use),
its pattern run only around each ``@`` (on a whole long text it backtracks at every word)."""

from __future__ import annotations

from typing import Any

import tldextract
from presidio_analyzer import RecognizerResult
from presidio_analyzer.predefined_recognizers import EmailRecognizer

_EXTRACT = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)
_BEFORE, _AFTER = 64, 255
"""The longest local part and domain an address has (RFC 5321)."""


class OfflineEmailRecognizer(EmailRecognizer):
    def validate_result(self, pattern_text: str) -> bool:
        return _EXTRACT(pattern_text.rsplit("@", 1)[-1]).fqdn != ""

    def analyze(
        self, text: str, entities: list[str], *args: Any, **kwargs: Any
    ) -> list[RecognizerResult]:
        """Presidio's analysis of the spans around each ``@`` (overlapping spans joined)."""
        spans: list[list[int]] = []
        at = text.find("@")
        while at != -1:
            start, end = max(0, at - _BEFORE - 1), min(len(text), at + _AFTER + 1)
            if spans and start <= spans[-1][1]:
                spans[-1][1] = end
            else:
                spans.append([start, end])
            at = text.find("@", at + 1)
        out: list[RecognizerResult] = []
        for start, end in spans:
            for r in super().analyze(text[start:end], entities, *args, **kwargs):
                r.start += start
                r.end += start
                out.append(r)
        return out

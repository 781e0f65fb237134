"""Presidio's email recognizer, its domain check read from the public-suffix list that
``tldextract`` ships (Presidio's default fetches the list from the network at first use)."""

from __future__ import annotations

import tldextract
from presidio_analyzer.predefined_recognizers import EmailRecognizer

_EXTRACT = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)


class OfflineEmailRecognizer(EmailRecognizer):
    def validate_result(self, pattern_text: str) -> bool:
        return _EXTRACT(pattern_text.rsplit("@", 1)[-1]).fqdn != ""

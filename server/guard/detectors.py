"""The detectors: Presidio's analyzer with pattern recognizers only (checksums, context
words, the custom patterns and deny-lists of ``[guard.detectors]``) and its anonymizer.

No NER model: every entity type the policy names has a pattern and, where it has one, a
checksum (Luhn for cards, ISO 7064 for IBANs, each national id's own), so a statistical
model would add hundreds of megabytes and milliseconds per request for names and places
the rules do not ask for. spaCy's blank English pipeline tokenizes for the context words.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

from semcache.guard_rules import GuardSettings

OFF_THREAD_CHARS: Final = 4096
"""Texts longer than this are analysed in a worker thread, not on the event loop."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One detected value: its type and where it is (the value itself is never kept)."""

    entity: str
    start: int
    end: int
    score: float


def _builtin() -> dict[str, Callable[[], Any]]:
    """Entity type → a factory of its Presidio recognizer."""
    from presidio_analyzer.predefined_recognizers import (
        AuTfnRecognizer,
        CreditCardRecognizer,
        EsNifRecognizer,
        IbanRecognizer,
        IpRecognizer,
        ItFiscalCodeRecognizer,
        NhsRecognizer,
        PhoneRecognizer,
        SgFinRecognizer,
        UkNinoRecognizer,
        UsItinRecognizer,
        UsSsnRecognizer,
    )

    from server.guard.offline_email import OfflineEmailRecognizer

    return {
        "CREDIT_CARD": CreditCardRecognizer,
        "IBAN_CODE": IbanRecognizer,
        "US_SSN": UsSsnRecognizer,
        "US_ITIN": UsItinRecognizer,
        "UK_NINO": UkNinoRecognizer,
        "UK_NHS": NhsRecognizer,
        "ES_NIF": partial(EsNifRecognizer, supported_language="en"),  # one language: any text
        "IT_FISCAL_CODE": partial(ItFiscalCodeRecognizer, supported_language="en"),
        "AU_TFN": AuTfnRecognizer,
        "SG_NRIC_FIN": SgFinRecognizer,
        "EMAIL_ADDRESS": OfflineEmailRecognizer,
        "PHONE_NUMBER": PhoneRecognizer,
        "IP_ADDRESS": IpRecognizer,
    }


class Detectors:
    """One analyzer for a policy's ``[guard]`` settings (built once per policy)."""

    def __init__(self, settings: GuardSettings) -> None:
        from presidio_analyzer import AnalyzerEngine, Pattern, PatternRecognizer, RecognizerRegistry
        from presidio_anonymizer import AnonymizerEngine

        from server.guard.credentials import credential_recognizers
        from server.guard.tokens import BlankEnglish

        self.min_score = settings.min_score
        registry = RecognizerRegistry(supported_languages=["en"])
        for factory in _builtin().values():
            registry.add_recognizer(factory())
        for recognizer in credential_recognizers():
            registry.add_recognizer(recognizer)
        for name, det in settings.detectors.items():
            patterns = [Pattern(f"{name}-{i}", p, det.score) for i, p in enumerate(det.patterns)]
            registry.add_recognizer(
                PatternRecognizer(
                    supported_entity=name,
                    name=f"custom-{name}",
                    patterns=patterns,
                    deny_list=list(det.deny_list),
                    deny_list_score=det.score,
                    context=list(det.context),
                )
            )
        self._analyzer = AnalyzerEngine(
            registry=registry, nlp_engine=BlankEnglish(), supported_languages=["en"]
        )
        self._anonymizer = AnonymizerEngine()

    def find(self, text: str, entities: Iterable[str]) -> list[Finding]:
        """The values of ``entities`` in ``text``, overlaps resolved (the best score, then
        the longest span), in order."""
        wanted = list(entities)
        if not text or not wanted:
            return []
        found = self._analyzer.analyze(
            text, language="en", entities=wanted, score_threshold=self.min_score
        )
        found.sort(key=lambda r: (r.start, -r.score, -(r.end - r.start)))
        out: list[Finding] = []
        for r in found:
            if out and r.start < out[-1].end:
                continue  # inside or across a better finding already kept
            out.append(Finding(r.entity_type, r.start, r.end, r.score))
        return out

    async def find_async(self, text: str, entities: Iterable[str]) -> list[Finding]:
        """:meth:`find`, in a worker thread for a long text (the loop serves others)."""
        if len(text) > OFF_THREAD_CHARS:
            return await asyncio.to_thread(self.find, text, list(entities))
        return self.find(text, entities)

    def redact(self, text: str, findings: Sequence[Finding]) -> str:
        """``text`` with each finding replaced by ``<ENTITY_TYPE>`` (Presidio's anonymizer,
        its ``replace`` operator)."""
        if not findings:
            return text
        from presidio_anonymizer.entities import RecognizerResult

        results = [RecognizerResult(f.entity, f.start, f.end, f.score) for f in findings]
        return self._anonymizer.anonymize(text, results).text

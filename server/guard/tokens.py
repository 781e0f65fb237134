"""The analyzer's NLP engine: spaCy's blank English tokenizer (no model to download), each
token's lower-cased text as its lemma, for Presidio's context words."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import spacy
from presidio_analyzer.nlp_engine import NlpArtifacts, NlpEngine


class BlankEnglish(NlpEngine):
    """Tokens and lower-cased lemmas; no entities (recognizers find them)."""

    def __init__(self) -> None:
        self.nlp = spacy.blank("en")

    def load(self) -> None:
        """Nothing to load."""

    def is_loaded(self) -> bool:
        return True

    def process_text(self, text: str, language: str) -> NlpArtifacts:
        doc = self.nlp(text)
        return NlpArtifacts(
            entities=[],
            tokens=doc,
            tokens_indices=[t.idx for t in doc],
            lemmas=[t.lower_ for t in doc],
            nlp_engine=self,
            language=language,
            scores=[],
        )

    def process_batch(
        self,
        texts: Iterable[str],
        language: str,
        batch_size: int = 1,
        n_process: int = 1,
        **kwargs: Any,
    ) -> Iterator[tuple[str, NlpArtifacts]]:
        for text in texts:
            yield str(text), self.process_text(str(text), language)

    def is_stopword(self, word: str, language: str) -> bool:
        return bool(self.nlp.vocab[word].is_stop)

    def is_punct(self, word: str, language: str) -> bool:
        return bool(self.nlp.vocab[word].is_punct)

    def get_supported_entities(self) -> list[str]:
        return []

    def get_supported_languages(self) -> list[str]:
        return ["en"]

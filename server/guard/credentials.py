"""Credential detectors Presidio does not ship: cloud access keys, API tokens, private-key
blocks and JSON Web Tokens, as Presidio pattern recognizers (the prefixes each vendor
documents for its keys; a JWT is checked to decode to a JOSE header)."""

from __future__ import annotations

import base64
import binascii
from typing import Final

import orjson
from presidio_analyzer import Pattern, PatternRecognizer

CLOUD_ACCESS_KEY: Final = (
    Pattern("aws-access-key-id", r"\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b", 0.9),
    Pattern("gcp-api-key", r"\bAIza[0-9A-Za-z_\-]{35}\b", 0.9),
    Pattern(
        "azure-storage-key",
        r"AccountKey=[A-Za-z0-9+/]{86}==",
        0.9,
    ),
)
API_TOKEN: Final = (
    Pattern("github-token", r"\bgh[pousr]_[A-Za-z0-9]{36,255}\b", 0.9),
    Pattern("github-fine-grained", r"\bgithub_pat_[A-Za-z0-9_]{82}\b", 0.9),
    Pattern("slack-token", r"\bxox[abposr]-[A-Za-z0-9-]{10,250}\b", 0.9),
    Pattern("openai-key", r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_\-]{32,}\b", 0.85),
    Pattern("anthropic-key", r"\bsk-ant-(?:api|admin)\d{2}-[A-Za-z0-9_\-]{80,}\b", 0.9),
    Pattern("stripe-key", r"\b(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{24,}\b", 0.9),
    Pattern("huggingface-token", r"\bhf_[A-Za-z0-9]{34,}\b", 0.85),
)
PRIVATE_KEY: Final = (
    Pattern(
        "pem-private-key",
        r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----[\s\S]+?"
        r"-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----",
        0.95,
    ),
)
JWT: Final = (
    Pattern("jwt", r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}", 0.6),
)


class JwtRecognizer(PatternRecognizer):
    """A JWT: three base64url parts whose first decodes to a JSON header naming ``alg``."""

    def validate_result(self, pattern_text: str) -> bool | None:
        head = pattern_text.split(".", 1)[0]
        try:
            header = orjson.loads(base64.urlsafe_b64decode(head + "=" * (-len(head) % 4)))
        except (binascii.Error, ValueError, orjson.JSONDecodeError):
            return False
        return isinstance(header, dict) and "alg" in header


def credential_recognizers() -> list[PatternRecognizer]:
    """One recognizer per credential entity type."""
    return [
        PatternRecognizer(
            supported_entity="CLOUD_ACCESS_KEY",
            patterns=list(CLOUD_ACCESS_KEY),
            context=["aws", "gcp", "azure", "access", "key"],
        ),
        PatternRecognizer(
            supported_entity="API_TOKEN",
            patterns=list(API_TOKEN),
            context=["token", "api", "key", "secret"],
        ),
        PatternRecognizer(supported_entity="PRIVATE_KEY", patterns=list(PRIVATE_KEY)),
        JwtRecognizer(supported_entity="JWT", patterns=list(JWT), context=["bearer", "jwt"]),
    ]

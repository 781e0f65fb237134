"""Generated sensitive values, one per entity type, each with a valid checksum where the
type has one (Luhn, ISO 7064 mod 97, the national ids' own), fresh on every call."""

from __future__ import annotations

import base64
import random
import string

import orjson


def luhn_complete(digits: str) -> str:
    """``digits`` with the Luhn check digit appended."""
    total = 0
    for i, d in enumerate(reversed(digits)):
        n = int(d)
        if i % 2 == 0:
            n *= 2
            n -= 9 if n > 9 else 0
        total += n
    return digits + str((10 - total % 10) % 10)


def card(rng: random.Random) -> str:
    number = luhn_complete("4" + "".join(rng.choice(string.digits) for _ in range(14)))
    return " ".join(number[i : i + 4] for i in range(0, 16, 4))


def iban(rng: random.Random) -> str:
    """A German IBAN: ``DE`` + two check digits + 18 digits (ISO 13616, mod 97)."""
    bban = "".join(rng.choice(string.digits) for _ in range(18))
    check = 98 - int(bban + "131400") % 97  # D=13, E=14, then "00"
    return f"DE{check:02d}{bban}"


def ssn(rng: random.Random) -> str:
    return f"{rng.randint(100, 665)}-{rng.randint(10, 99)}-{rng.randint(1000, 9999)}"


def nino(rng: random.Random) -> str:
    letters = "ABCEGHJKLMNPRSTWXYZ"
    return (
        rng.choice(letters)
        + rng.choice(letters)
        + "".join(rng.choice(string.digits) for _ in range(6))
        + rng.choice("ABCD")
    )


def email(rng: random.Random) -> str:
    user = "".join(rng.choice(string.ascii_lowercase) for _ in range(8))
    return f"{user}.{rng.randint(10, 99)}@example.org"


def phone(rng: random.Random) -> str:
    return f"+1 415-555-{rng.randint(1000, 9999)}"


def ip(rng: random.Random) -> str:
    return f"10.{rng.randint(1, 254)}.{rng.randint(1, 254)}.{rng.randint(1, 254)}"


def aws_key(rng: random.Random) -> str:
    return "AKIA" + "".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(16))


def github_token(rng: random.Random) -> str:
    return "ghp_" + "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(36))


def private_key(rng: random.Random) -> str:
    body = base64.b64encode(rng.randbytes(96)).decode()
    lines = "\n".join(body[i : i + 64] for i in range(0, len(body), 64))
    return f"-----BEGIN PRIVATE KEY-----\n{lines}\n-----END PRIVATE KEY-----"


def jwt(rng: random.Random) -> str:
    def part(obj: object) -> str:
        return base64.urlsafe_b64encode(orjson.dumps(obj)).rstrip(b"=").decode()

    sig = base64.urlsafe_b64encode(rng.randbytes(32)).rstrip(b"=").decode()
    return f"{part({'alg': 'HS256', 'typ': 'JWT'})}.{part({'sub': str(rng.random())})}.{sig}"


GENERATORS = {
    "CREDIT_CARD": card,
    "IBAN_CODE": iban,
    "US_SSN": ssn,
    "UK_NINO": nino,
    "EMAIL_ADDRESS": email,
    "PHONE_NUMBER": phone,
    "IP_ADDRESS": ip,
    "CLOUD_ACCESS_KEY": aws_key,
    "API_TOKEN": github_token,
    "PRIVATE_KEY": private_key,
    "JWT": jwt,
}
"""Entity type → a generator of one fresh value."""

SENTENCES = {
    "CREDIT_CARD": "Charge my card {} for the order.",
    "IBAN_CODE": "Wire the refund to IBAN {} please.",
    "US_SSN": "My social security number is {} for the form.",
    "UK_NINO": "My national insurance number is {} today.",
    "EMAIL_ADDRESS": "Write to me at {} tomorrow.",
    "PHONE_NUMBER": "My phone number is {}, call after lunch.",
    "IP_ADDRESS": "The server at {} is down.",
    "CLOUD_ACCESS_KEY": "The aws access key is {} in prod.",
    "API_TOKEN": "Use the token {} for the API.",
    "PRIVATE_KEY": "Here is the key:\n{}\nkeep it safe.",
    "JWT": "The bearer token is {} for now.",
}
"""Entity type → a prompt around one value (context words where Presidio scores them)."""

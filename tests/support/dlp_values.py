"""Generated sensitive values, one per entity type (and one per credential pattern), each
with a valid checksum where the type has one (Luhn, ISO 7064 mod 97, the national ids' own),
fresh on every call."""

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
    """A UK national insurance number (the prefixes HMRC never issues left out)."""
    letters = "ABCEGHJKLMNPRSTWXYZ"
    while (prefix := rng.choice(letters) + rng.choice(letters)) in NINO_UNUSED:
        pass
    return prefix + "".join(rng.choice(string.digits) for _ in range(6)) + rng.choice("ABCD")


NINO_UNUSED = frozenset(("BG", "GB", "KN", "NK", "NT", "TN", "ZZ"))


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


def itin(rng: random.Random) -> str:
    """A US ITIN: ``9XX-7X-XXXX`` (the IRS's ranges; an ITIN has no check digit)."""
    return f"9{rng.randint(0, 99):02d}-{rng.randint(70, 88)}-{rng.randint(0, 9999):04d}"


def nhs(rng: random.Random) -> str:
    """A UK NHS number: nine digits and the mod-11 check digit (weights 10 to 2), spaced
    3-3-4; England's numbers start with 4 (the fourth digit 0: no US phone number)."""
    while True:
        digits = "4" + "".join(rng.choice(string.digits) for _ in range(2)) + "0"
        digits += "".join(rng.choice(string.digits) for _ in range(5))
        check = (
            11 - sum(int(d) * w for d, w in zip(digits, range(10, 1, -1), strict=True)) % 11
        ) % 11
        if check != 10:
            number = digits + str(check)
            return f"{number[:3]} {number[3:6]} {number[6:]}"


def nif(rng: random.Random) -> str:
    """A Spanish NIF (DNI): eight digits and the letter of their value mod 23."""
    number = rng.randint(10_000_000, 99_999_999)
    return f"{number}{'TRWAGMYFPDXBNJZSQVHLCKE'[number % 23]}"


_ODD = dict(
    zip(
        "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ",
        [
            1,
            0,
            5,
            7,
            9,
            13,
            15,
            17,
            19,
            21,
            1,
            0,
            5,
            7,
            9,
            13,
            15,
            17,
            19,
            21,
            2,
            4,
            18,
            20,
            11,
            3,
            6,
            8,
            12,
            14,
            16,
            10,
            22,
            25,
            24,
            23,
        ],
        strict=True,
    )
)


def fiscal_code(rng: random.Random) -> str:
    """An Italian codice fiscale: surname and name letters, birth year, month letter, day,
    municipality code, and the check letter (odd positions by the decree's table, even
    positions by their value, mod 26)."""
    consonants = "BCDFGHJKLMNPRSTVZ"
    body = "".join(rng.choice(consonants) for _ in range(6))
    body += f"{rng.randint(0, 99):02d}{rng.choice('ABCDEHLMPRST')}{rng.randint(1, 28):02d}"
    body += f"{rng.choice('ABCDEFGHLM')}{rng.randint(100, 999)}"
    total = sum(
        _ODD[c] if i % 2 == 0 else (int(c) if c.isdigit() else ord(c) - ord("A"))
        for i, c in enumerate(body)
    )
    return body + chr(ord("A") + total % 26)


def tfn(rng: random.Random) -> str:
    """An Australian tax file number: nine digits whose weighted sum (1, 4, 3, 7, 5, 8, 6,
    9, 10) is a multiple of 11, spaced 3-3-3."""
    weights = (1, 4, 3, 7, 5, 8, 6, 9, 10)
    while True:
        digits = [rng.randint(0, 9) for _ in range(8)]
        last = sum(d * w for d, w in zip(digits, weights, strict=False)) % 11  # 10 ≡ -1
        if last != 10:
            number = "".join(map(str, [*digits, last]))
            return f"{number[:3]} {number[3:6]} {number[6:]}"


def nric(rng: random.Random) -> str:
    """A Singapore NRIC: ``S`` or ``T``, seven digits, and the check letter of their
    weighted sum (2, 7, 6, 5, 4, 3, 2; ``T`` adds 4) mod 11."""
    prefix = rng.choice("ST")
    digits = [rng.randint(0, 9) for _ in range(7)]
    total = sum(d * w for d, w in zip(digits, (2, 7, 6, 5, 4, 3, 2), strict=True))
    total += 4 if prefix == "T" else 0
    return prefix + "".join(map(str, digits)) + "JZIHGFEDCBA"[total % 11]


def _chars(rng: random.Random, n: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def gcp_key(rng: random.Random) -> str:
    return "AIza" + _chars(rng, 35)


def azure_key(rng: random.Random) -> str:
    """An Azure storage connection string's key (64 bytes, base64)."""
    return "AccountKey=" + base64.b64encode(rng.randbytes(64)).decode()


def slack_token(rng: random.Random) -> str:
    return (
        f"xoxb-{_chars(rng, 12, string.digits)}-{_chars(rng, 13, string.digits)}-{_chars(rng, 24)}"
    )


def openai_key(rng: random.Random) -> str:
    return "sk-proj-" + _chars(rng, 48)


def anthropic_key(rng: random.Random) -> str:
    return "sk-ant-api03-" + _chars(rng, 93) + "AA"


def stripe_key(rng: random.Random) -> str:
    return "sk_test_" + _chars(rng, 24)


def hf_token(rng: random.Random) -> str:
    return "hf_" + _chars(rng, 34)


def github_fine_grained(rng: random.Random) -> str:
    return f"github_pat_{_chars(rng, 22)}_{_chars(rng, 59)}"


GENERATORS = {
    "CREDIT_CARD": card,
    "IBAN_CODE": iban,
    "US_SSN": ssn,
    "US_ITIN": itin,
    "UK_NINO": nino,
    "UK_NHS": nhs,
    "ES_NIF": nif,
    "IT_FISCAL_CODE": fiscal_code,
    "AU_TFN": tfn,
    "SG_NRIC_FIN": nric,
    "EMAIL_ADDRESS": email,
    "PHONE_NUMBER": phone,
    "IP_ADDRESS": ip,
    "CLOUD_ACCESS_KEY": aws_key,
    "CLOUD_ACCESS_KEY/gcp": gcp_key,
    "CLOUD_ACCESS_KEY/azure": azure_key,
    "API_TOKEN": github_token,
    "API_TOKEN/github-fine-grained": github_fine_grained,
    "API_TOKEN/slack": slack_token,
    "API_TOKEN/openai": openai_key,
    "API_TOKEN/anthropic": anthropic_key,
    "API_TOKEN/stripe": stripe_key,
    "API_TOKEN/huggingface": hf_token,
    "PRIVATE_KEY": private_key,
    "JWT": jwt,
}
"""Case → a generator of one fresh value: each entity type, and each credential pattern
(``TYPE/vendor``; :func:`entity_of` gives its type)."""

SENTENCES = {
    "CREDIT_CARD": "Charge my card {} for the order.",
    "IBAN_CODE": "Wire the refund to IBAN {} please.",
    "US_SSN": "My social security number is {} for the form.",
    "US_ITIN": "My individual taxpayer number (ITIN) is {} on the return.",
    "UK_NINO": "My national insurance number is {} today.",
    "UK_NHS": "My NHS number is {} at the surgery.",
    "ES_NIF": "Mi NIF es {} para la factura.",
    "IT_FISCAL_CODE": "Il mio codice fiscale è {} per il contratto.",
    "AU_TFN": "My tax file number is {} for payroll.",
    "SG_NRIC_FIN": "My NRIC is {} for the booking.",
    "EMAIL_ADDRESS": "Write to me at {} tomorrow.",
    "PHONE_NUMBER": "My phone number is {}, call after lunch.",
    "IP_ADDRESS": "The server at {} is down.",
    "CLOUD_ACCESS_KEY": "The aws access key is {} in prod.",
    "CLOUD_ACCESS_KEY/gcp": "The gcp api key is {} for maps.",
    "CLOUD_ACCESS_KEY/azure": "The azure storage string holds {} in prod.",
    "API_TOKEN": "Use the token {} for the API.",
    "API_TOKEN/github-fine-grained": "The github token {} reads the repo.",
    "API_TOKEN/slack": "The slack bot token is {} for alerts.",
    "API_TOKEN/openai": "My api key is {} for the model.",
    "API_TOKEN/anthropic": "My api key is {} for Claude.",
    "API_TOKEN/stripe": "The stripe secret key is {} in staging.",
    "API_TOKEN/huggingface": "The hub token is {} for downloads.",
    "PRIVATE_KEY": "Here is the key:\n{}\nkeep it safe.",
    "JWT": "The bearer token is {} for now.",
}
"""Case → a prompt around one value (context words where Presidio scores them)."""


def entity_of(case: str) -> str:
    """The entity type of a case of :data:`GENERATORS` (``API_TOKEN/slack``: ``API_TOKEN``)."""
    return case.partition("/")[0]

"""Seeded templated prompts whose near-duplicates are wrong to share, labels by construction.

A family is one request written several ways (its phrasings) with slots: an entity, a
number, a unit or a negation. A fill is a value for every slot. Two texts mean the same
exactly when they are of one family and one fill: the phrasings of a fill are label-1
pairs (the paraphrase repeats a cache should serve), and a fill beside a fill that differs
in a single slot, in the same phrasing, is a label-0 pair ("convert 5 km to miles" vs
"convert 8 km to miles": the hard negatives a cosine threshold cannot tell apart).
"""

from __future__ import annotations

import itertools
import random

import msgspec

from semcache.tuning.pairs import Pair


class Family(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    phrasings: tuple[str, ...]
    """``str.format`` templates, each using every slot."""
    slots: dict[str, tuple[str, ...]]
    """The values each slot takes; any two values give different answers."""


_COUNTRIES = (
    "France", "Germany", "Spain", "Italy", "Portugal", "Poland", "Austria", "Sweden",
    "Norway", "Finland", "Denmark", "Greece", "Hungary", "Ireland", "Canada", "Mexico",
    "Brazil", "Argentina", "Chile", "Peru", "Japan", "Vietnam", "Thailand", "Egypt",
    "Kenya", "Morocco", "Turkey", "Australia",
)  # fmt: skip
_CITIES = (
    "Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Warsaw", "Vienna", "Stockholm",
    "Oslo", "Helsinki", "Prague", "Athens", "Dublin", "Toronto", "Chicago", "Boston",
    "Seattle", "Denver", "Tokyo", "Osaka", "Seoul", "Sydney", "Cairo", "Nairobi",
)  # fmt: skip
_NUMBERS = tuple(str(n) for n in (2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15, 20, 25, 30, 40, 50, 75, 100))
_LENGTHS = ("kilometers", "miles", "meters", "feet", "inches", "centimeters", "yards")
_WEIGHTS = ("kilograms", "pounds", "grams", "ounces")
_FOODS = (
    "grapes", "chocolate", "onions", "garlic", "avocado", "apples", "carrots", "bananas",
    "cheese", "peanut butter", "blueberries", "popcorn", "watermelon", "eggs",
)  # fmt: skip
_LANGUAGES = ("Python", "JavaScript", "Rust", "Go", "Java", "C++", "Ruby", "Kotlin")
_TASKS = (
    "read a file line by line", "reverse a string", "sort a list", "parse JSON",
    "make an HTTP request", "start a thread", "read an environment variable",
)  # fmt: skip

FAMILIES: tuple[Family, ...] = (
    Family(
        name="convert-length",
        phrasings=(
            "Convert {n} {a} to {b}.",
            "How many {b} are in {n} {a}?",
            "What is {n} {a} in {b}?",
        ),
        slots={"n": _NUMBERS, "a": _LENGTHS, "b": _LENGTHS},
    ),
    Family(
        name="convert-weight",
        phrasings=(
            "Convert {n} {a} to {b}.",
            "How many {b} is {n} {a}?",
            "What does {n} {a} come to in {b}?",
        ),
        slots={"n": _NUMBERS, "a": _WEIGHTS, "b": _WEIGHTS},
    ),
    Family(
        name="capital",
        phrasings=(
            "What is the capital of {country}?",
            "Which city is the capital of {country}?",
            "Name the capital city of {country}.",
        ),
        slots={"country": _COUNTRIES},
    ),
    Family(
        name="weather",
        phrasings=(
            "What will the weather be like in {city} on {day}?",
            "What is the weather forecast for {city} on {day}?",
            "How is the weather going to be in {city} on {day}?",
        ),
        slots={"city": _CITIES, "day": ("Monday", "Tuesday", "Friday", "Saturday", "Sunday")},
    ),
    Family(
        name="dogs-food",
        phrasings=(
            "Explain why {food} {is} safe for dogs to eat.",
            "Why {is} {food} safe for my dog to eat?",
            "Tell me why {food} {is} safe food for dogs.",
        ),
        slots={"food": _FOODS, "is": ("is", "is not")},
    ),
    Family(
        name="code",
        phrasings=(
            "How do I {task} in {lang}?",
            "Show me how to {task} in {lang}.",
            "What is the way to {task} in {lang}?",
        ),
        slots={"task": _TASKS, "lang": _LANGUAGES},
    ),
    Family(
        name="square",
        phrasings=(
            "What is {n} squared?",
            "Compute the square of {n}.",
            "What do you get when you multiply {n} by itself?",
        ),
        slots={"n": tuple(str(n) for n in range(11, 100))},
    ),
    Family(
        name="recipe",
        phrasings=(
            "Give me a recipe for {dish} {diet}.",
            "How do I make {dish} {diet}?",
            "I need a recipe to cook {dish} {diet}.",
        ),
        slots={
            "dish": ("pancakes", "lasagna", "brownies", "pizza dough", "curry", "risotto"),
            "diet": ("with eggs", "without eggs", "with gluten", "without gluten"),
        },
    ),
)


Fill = tuple[tuple[str, str], ...]
"""A value for every slot of a family, as sorted ``(slot, value)`` items."""


class TemplatePairs(msgspec.Struct, kw_only=True):
    pairs: list[Pair]
    meaning: dict[str, str]
    """Each text's family and fill (same string: the same request)."""


def _valid(family: Family, fill: dict[str, str]) -> bool:
    """A conversion from a unit to itself is no question."""
    return not ("a" in fill and "b" in fill and fill["a"] == fill["b"])


def _texts(family: Family, fill: dict[str, str]) -> list[str]:
    return [phrasing.format(**fill) for phrasing in family.phrasings]


def _meaning(family: Family, fill: dict[str, str]) -> str:
    return family.name + "|" + "|".join(f"{k}={fill[k]}" for k in sorted(fill))


def generate_template_pairs(
    *, seed: int, groups: int = 12, variants: int = 3, families: tuple[Family, ...] = FAMILIES
) -> TemplatePairs:
    """Per family, ``groups`` seeded base fills, each beside ``variants`` fills that differ
    from it in one slot; every fill is asked in all its phrasings (see module docstring)."""
    rng = random.Random(seed)
    pairs: list[Pair] = []
    meaning: dict[str, str] = {}

    def add_fill(family: Family, fill: dict[str, str]) -> list[str]:
        texts = _texts(family, fill)
        for text in texts:
            meaning[text] = _meaning(family, fill)
        pairs.extend(Pair(a, b, 1) for a, b in itertools.pairwise(texts))
        return texts

    for family in families:
        for _ in range(groups):
            base = {slot: rng.choice(values) for slot, values in family.slots.items()}
            if not _valid(family, base):
                continue
            base_texts = add_fill(family, base)
            for _ in range(variants):
                slot = rng.choice(sorted(family.slots))
                value = rng.choice([v for v in family.slots[slot] if v != base[slot]])
                other = {**base, slot: value}
                if not _valid(family, other):
                    continue
                other_texts = add_fill(family, other)
                k = rng.randrange(len(family.phrasings))
                pairs.append(Pair(base_texts[k], other_texts[k], 0))
    return TemplatePairs(pairs=pairs, meaning=meaning)

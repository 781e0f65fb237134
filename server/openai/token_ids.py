"""Token-id inputs (``/v1/embeddings`` ``input``, ``/v1/completions`` ``prompt``): checked as
ids before they reach a model or a cache key.

A list of token ids is non-empty and holds integers from 0 to ``MAX_TOKEN_ID`` (no
vocabulary is larger; JSON booleans are not integers here). Whether an id is in a model's
vocabulary is checked where the vocabulary is known: ``out_of_vocabulary`` for the
gateway's own embedding models, vLLM itself for the models it serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

MAX_TOKEN_ID: Final = 2**31 - 1


class InputError(ValueError):
    """An input item of the wrong kind; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def is_id(value: Any) -> bool:
    """Whether ``value`` is a JSON integer (not a boolean)."""
    return isinstance(value, int) and not isinstance(value, bool)


def token_ids(value: list[Any], where: str) -> list[int]:
    """``value`` (the item at ``where``) as a list of token ids; ``InputError`` if it is
    empty or holds anything but ids in range."""
    if not value:
        raise InputError(where, f"`{where}` is an empty list of token ids.")
    for j, item in enumerate(value):
        if not is_id(item):
            raise InputError(
                where, f"`{where}[{j}]` is not a token id: expected an integer, got {item!r:.40}."
            )
        if item < 0:
            raise InputError(where, f"`{where}[{j}]`: token id {item} is negative.")
        if item > MAX_TOKEN_ID:
            raise InputError(
                where,
                f"`{where}[{j}]`: token id {item} is past any vocabulary (at most {MAX_TOKEN_ID}).",
            )
    return value


def token_id_lists(value: list[Any], where: str) -> list[list[int]] | None:
    """``value`` as token-id lists when it is a list of ids or a list of lists (each
    checked by ``token_ids``); ``None`` when it is neither (strings, a mix)."""
    if value and all(is_id(v) for v in value):
        return [token_ids(value, where)]
    if value and all(isinstance(v, list) for v in value):
        return [token_ids(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return None


def out_of_vocabulary(items: Sequence[list[int]], size: int, where: str) -> InputError | None:
    """The error for the first id of ``items`` (``where``'s token-id lists) that a
    vocabulary of ``size`` ids does not hold; ``None`` when every id is in it."""
    for ids in items:
        for token in ids:
            if token >= size:
                return InputError(
                    where,
                    f"Token id {token} is out of this model's vocabulary (ids 0 to {size - 1}).",
                )
    return None

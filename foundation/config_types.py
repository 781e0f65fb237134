"""Constrained field types shared by every config and policy schema.

msgspec checks these when a file is decoded, so a struct that uses them is valid once loaded.
This module imports nothing from the project: server, semcache and backends all use it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0.0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
Unit = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
"""A share or a similarity: 0 to 1, both included."""
Fraction = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
"""A part of a whole that cannot be nothing: above 0, at most 1."""
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]

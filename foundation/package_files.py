"""Files shipped inside the packages (default config, policy, verifier, classifier head).

They are package data, found with ``importlib.resources`` wherever the package lives: a
source checkout or an installed wheel. Imports nothing from the project.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def package_file(package: str, *parts: str) -> Path:
    """The path of a file or folder shipped in ``package`` (e.g. ``"server", "configs"``).

    Wheels install as plain folders (never zipped), so the resource is a real path that
    callers can read, watch for changes and pass on as a ``Path``.
    """
    found = resources.files(package).joinpath(*parts)
    if not isinstance(found, Path):
        raise RuntimeError(f"{package}/{'/'.join(parts)} is not on the file system: {found!r}")
    return found

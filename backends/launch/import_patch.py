"""Patching a module as it is imported: how each launch shim
(``backends.launch.nixl_progress``, ``backends.launch.gloo_device``,
``backends.launch.cpu_pinning``, ``backends.launch.amx``) reaches a library inside a launched
vLLM server, whichever of them imports it first."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Collection, Sequence
from typing import Any

Patch = Callable[[types.ModuleType], None]


def patch_when_imported(names: Collection[str], patch: Patch) -> None:
    """Run ``patch`` on each module of ``names``: at once on those already imported, right
    after their first import on the others."""
    waiting: set[str] = set()
    for name in names:
        loaded = sys.modules.get(name)
        if loaded is not None:
            patch(loaded)
        else:
            waiting.add(name)
    if waiting:
        sys.meta_path.insert(0, _PatchOnImport(frozenset(waiting), patch))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the named modules as the path finder does, and patches each once executed."""

    def __init__(self, names: frozenset[str], patch: Patch) -> None:
        self.names = names
        self.patch = patch

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        patch = self.patch

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: types.ModuleType) -> None:
                loader.exec_module(module)
                patch(module)

        spec.loader = Loader()
        return spec

"""The repository's scripts loaded as modules by the tests (one place): ``scripts/NAME.py`` registered under its name
(dataclasses resolve their module by name)."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from types import ModuleType
from typing import Iterator

from tests.paths import REPO

SCRIPTS = REPO / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` loaded and left registered (for a script that imports no sibling: ``sys.path`` is left
    alone)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def script_module(name: str) -> Iterator[ModuleType]:
    """:func:`load_script` for the ``with`` block, ``scripts/`` on the path (its siblings importable, as when it
    runs); after the block the module is unregistered and the path as it was."""
    added = str(SCRIPTS) not in sys.path
    if added:
        sys.path.insert(0, str(SCRIPTS))
    try:
        yield load_script(name)
    finally:
        sys.modules.pop(name, None)
        if added:
            sys.path.remove(str(SCRIPTS))

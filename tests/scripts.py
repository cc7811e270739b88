"""The repository's scripts loaded as modules by the tests (one place): ``scripts/NAME.py``, its sibling scripts
importable as when it runs, registered under its name (dataclasses resolve their module by name)."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from types import ModuleType
from typing import Iterator

from tests.paths import REPO

SCRIPTS = REPO / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` loaded and left registered (and ``scripts/`` left on the path)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def script_module(name: str) -> Iterator[ModuleType]:
    """:func:`load_script` for the ``with`` block: the module unregistered and ``scripts/`` off the path after it."""
    added = str(SCRIPTS) not in sys.path
    try:
        yield load_script(name)
    finally:
        sys.modules.pop(name, None)
        if added and str(SCRIPTS) in sys.path:
            sys.path.remove(str(SCRIPTS))

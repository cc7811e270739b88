"""Bookkeeping shared by every runtime patch: version guard, attribute replacement, registry."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable
from megatron.core import package_info

SUPPORTED_MCORE_VERSION = "0.16.1"


class PatchVersionError(RuntimeError):
    """megatron-core is not the version a patch was written against."""


@dataclass(frozen=True)
class Patch:
    """One runtime patch: what upstream object it replaces, why, and how."""

    name: str
    target: str
    why: str
    apply: Callable[[], None]


def mcore_version() -> str:
    return package_info.__version__


def require_supported_version(patch_name: str, target: str) -> None:
    found = mcore_version()
    if found != SUPPORTED_MCORE_VERSION:
        raise PatchVersionError(
            f"patch '{patch_name}' replaces {target} of megatron-core {SUPPORTED_MCORE_VERSION}, "
            f"but megatron-core {found} is installed: check the upstream function and update the patch"
        )


def resolve_owner(dotted_owner: str) -> Any:
    """The module, or ``module:Class``, that a patch changes."""
    module_name, _, class_name = dotted_owner.partition(":")
    owner: Any = importlib.import_module(module_name)
    return getattr(owner, class_name) if class_name else owner


def replace(dotted_owner: str, attr: str, new: Any) -> Any:
    """Set ``owner.attr = new`` (owner a module or ``module:Class``); return the original."""
    owner = resolve_owner(dotted_owner)
    if not hasattr(owner, attr):
        raise PatchVersionError(f"{dotted_owner}.{attr} does not exist: megatron-core changed, update the patch")
    original = getattr(owner, attr)
    setattr(owner, attr, new)
    return original

"""Options declared once: a dataclass field carries its command-line flag (Megatron-LM's name, help, default and
argparse's details) in its metadata; the parser is generated from the fields (:func:`add_fields_to_parser`) and a
parsed namespace read back into them (:func:`read_fields`), so a flag without its field, or a field without its
flag, cannot be written. A field that no flag sets is :func:`derived`: validation computes it from the options.
Sections nest: a field whose default is a dataclass (``field(default_factory=Section)``) holds that section's options."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Iterator, Mapping

OPTION, DERIVED, GROUP = "option", "derived", "group"


@dataclass(frozen=True)
class Flag:
    """One spelling of an option: its name (``--lr``) and argparse's keywords (help, type, choices, nargs, action...)."""

    name: str
    kwargs: tuple[tuple[str, Any], ...]

    @property
    def dest(self) -> str:
        return dict(self.kwargs).get("dest") or self.name.removeprefix("--").replace("-", "_")


def option(flag: str, *, default: Any = None, help: str, group: str | None = None, aliases: tuple[Flag, ...] = (),
           **argparse_kwargs: Any) -> Any:
    """A field set by ``flag``: its default, help and argparse keywords; ``aliases`` (:func:`alias`): other spellings
    writing the same field (Megatron-LM's older flags); ``group``: the help section when not the class's ``GROUP``."""
    return field(default=default, metadata={OPTION: (alias(flag, help=help, **argparse_kwargs), *aliases), GROUP: group})


def alias(flag: str, *, help: str, **argparse_kwargs: Any) -> Flag:
    """One spelling of an option: the option's own (:func:`option`) or another (``--use-flash-attn``: ``--attention-backend
    flash``), its dest the option's."""
    return Flag(flag, tuple({"help": help, **argparse_kwargs}.items()))


def derived(default: Any = None) -> Any:
    """A field no flag sets: validation fills it from the options (its name in :class:`Values`: the field's)."""
    return field(default=default, metadata={DERIVED: True})


def is_section(f: dataclasses.Field) -> bool:
    return OPTION not in f.metadata and DERIVED not in f.metadata and dataclasses.is_dataclass(f.default_factory)


def flags_of(f: dataclasses.Field) -> tuple[Flag, ...]:
    return f.metadata.get(OPTION, ())


def key_of(f: dataclasses.Field) -> str:
    """The field's name in a namespace and in :class:`Values`: its flag's dest, or a derived field's name."""
    if OPTION in f.metadata:
        return f.metadata[OPTION][0].dest
    if DERIVED in f.metadata:
        return f.name
    raise TypeError(f"field {f.name} has no flag and is not derived: declare it with option(...) or derived(...)")


def walk(cls: type, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], dataclasses.Field, type]]:
    """Every leaf field of ``cls`` and its nested sections: (path, field, the class declaring it)."""
    for f in fields(cls):
        if is_section(f):
            yield from walk(f.default_factory, (*path, f.name))
        else:
            yield (*path, f.name), f, cls


def field_paths(cls: type) -> dict[str, tuple[str, ...]]:
    """Each key (:func:`key_of`) and the path of its one field; a key with two fields is a ``TypeError``."""
    paths: dict[str, tuple[str, ...]] = {}
    for path, f, _ in walk(cls):
        key = key_of(f)
        if key in paths:
            raise TypeError(f"{key}: two fields ({'.'.join(paths[key])}, {'.'.join(path)})")
        paths[key] = path
    return paths


def add_fields_to_parser(parser: Any, cls: type, groups: Mapping[str, Any] | None = None,
                         defaults_shown: Mapping[str, Any] | None = None) -> None:
    """One argparse action per flag of ``cls``'s fields (nested sections included), in field order, each in the help
    group its field names (or its class's ``GROUP``; ``groups``: the groups by title, else ``parser`` itself);
    ``defaults_shown``: by dest, a command line's own default, added to the help as " (default X)"."""
    groups, shown = groups or {}, defaults_shown or {}
    for _, f, owner in walk(cls):
        title = f.metadata.get(GROUP) or getattr(owner, "GROUP", None)
        add_field_to_parser(groups.get(title, parser), f, shown)


def add_field_to_parser(parser: Any, f: dataclasses.Field, defaults_shown: Mapping[str, Any] | None = None) -> None:
    """The argparse action(s) of one option field ``f`` on ``parser`` (a parser or group): what a script that takes
    one of the training options adds (the same flag, help and default: ``python -m megatron_epp.measure.profile_gpu``'s ``--epp-profile-cache``)."""
    shown = defaults_shown or {}
    for flag in flags_of(f):
        kwargs = dict(flag.kwargs)
        dest = kwargs.pop("dest", None) or flags_of(f)[0].dest
        kwargs["default"] = f.default
        if dest in shown:
            kwargs["help"] += f" (default {shown[dest]})".replace("%", "%%")
        parser.add_argument(flag.name, dest=dest, **kwargs)


def read_fields(cls: type, values: dict[str, Any]) -> Any:
    """``cls`` (nested sections included) from parsed values by dest, each taken out of ``values`` (what is left
    there has no field); derived fields keep their defaults."""
    kwargs = {}
    for f in fields(cls):
        if is_section(f):
            kwargs[f.name] = read_fields(f.default_factory, values)
        elif OPTION in f.metadata:
            kwargs[f.name] = values.pop(key_of(f))
    return cls(**kwargs)


class Values:
    """A read-only view of a config's fields by key (:func:`key_of`, the flags' dests): what validation reads."""

    def __init__(self, config: Any, paths: Mapping[str, tuple[str, ...]]) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_paths", paths)

    def __getattr__(self, key: str) -> Any:
        if key not in self._paths:
            raise AttributeError(key)
        value = self._config
        for name in self._paths[key]:
            value = getattr(value, name)
        return value

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"{key}: read-only (validation returns its changes)")


def replace_keys(config: Any, paths: Mapping[str, tuple[str, ...]], changes: Mapping[str, Any]) -> Any:
    """A copy of ``config`` with the fields of ``changes`` (by key) changed."""
    nested: dict[str, dict[str, Any]] = {}
    direct = {}
    for key, value in changes.items():
        head, *rest = paths[key]
        if rest:
            nested.setdefault(head, {})[".".join(rest)] = value
        else:
            direct[head] = value
    for head, inner in nested.items():
        section = getattr(config, head)
        direct[head] = replace_keys(section, {k: tuple(k.split(".")) for k in inner}, inner)
    return dataclasses.replace(config, **direct)


def int_list(text: str) -> tuple[int, ...]:
    """An argparse ``type``: comma-separated non-negative integers, each in tokens or with a ``K`` suffix (``48K``:
    49152); a bad one is argparse's one-line error (``argument --caps: ...``), not a traceback."""
    try:
        values = tuple(int(v[:-1]) * 1024 if v[-1:] in "kK" else int(v) for v in (v.strip() for v in text.split(",")) if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers (48K: 49152)") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected non-negative integers")
    return values

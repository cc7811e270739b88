"""Options declared once: a dataclass field carries its command-line flag (Megatron-LM's name, help, default and
argparse's details) in its metadata; the parser is generated from the fields (:func:`add_fields_to_parser`) and a
parsed namespace read back into them (:func:`read_fields`), so a flag without its field, or a field without its
flag, cannot be written. A field that no flag sets is :func:`derived`: validation computes it from the options.
Sections nest: a field whose default is a dataclass (``field(default_factory=Section)``) holds that section's options.
A field also carries what else reads it: its ``tags`` (:func:`fields_tagged`, :func:`tag_values`) and a numeric
option's range (:class:`Range`, checked by :func:`range_problem`)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Iterator, Mapping

OPTION, DERIVED, GROUP, TAGS, RANGE = "option", "derived", "group", "tags", "range"


@dataclass(frozen=True)
class Flag:
    """One spelling of an option: its name (``--lr``) and argparse's keywords (help, type, choices, nargs, action...)."""

    name: str
    kwargs: tuple[tuple[str, Any], ...]

    @property
    def dest(self) -> str:
        return dict(self.kwargs).get("dest") or self.name.removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class Range:
    """A numeric option's range: at least ``low`` (above it where ``low_open``), and at most ``high`` (below it where
    ``high_open``) when there is one."""

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    @classmethod
    def of(cls, at_least: float | None, above: float | None, at_most: float | None, below: float | None) -> "Range | None":
        """:func:`option`'s bounds as a range (None without one); one lower bound, at most one upper bound."""
        if at_least is None and above is None:
            if at_most is not None or below is not None:
                raise TypeError("an upper bound needs a lower bound (at_least or above)")
            return None
        if (at_least is not None and above is not None) or (at_most is not None and below is not None):
            raise TypeError("one lower bound (at_least or above) and at most one upper bound (at_most or below)")
        return cls(above if at_least is None else at_least, below if at_most is None else at_most,
                   low_open=at_least is None, high_open=at_most is None and below is not None)

    def problem(self, value: float) -> str | None:
        """Why ``value`` is outside the range (``must be >= 1``), None inside it (a NaN is outside)."""
        low_ok = value > self.low if self.low_open else value >= self.low
        if self.high is None:
            return None if low_ok else f"must be {'>' if self.low_open else '>='} {self.low}"
        high_ok = value < self.high if self.high_open else value <= self.high
        if low_ok and high_ok:
            return None
        return f"must be in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"


def option(flag: str, *, default: Any = None, help: str, group: str | None = None, aliases: tuple[Flag, ...] = (),
           tags: Iterable[str] | Mapping[str, Any] = (), at_least: float | None = None, above: float | None = None,
           at_most: float | None = None, below: float | None = None, **argparse_kwargs: Any) -> Any:
    """A field set by ``flag``: its default, help and argparse keywords; ``aliases`` (:func:`alias`): other spellings
    writing the same field (Megatron-LM's older flags); ``group``: the help section when not the class's ``GROUP``;
    ``tags``: what else reads the field (:func:`fields_tagged`), each tag with a value for its readers (a mapping:
    a reason, a place in a record) or none (an iterable of tags: True); ``at_least``/``above`` and
    ``at_most``/``below``: a numeric option's range (:class:`Range`; a value outside is an error naming the flag)."""
    metadata = {OPTION: (alias(flag, help=help, **argparse_kwargs), *aliases), GROUP: group,
                TAGS: dict(tags) if isinstance(tags, Mapping) else dict.fromkeys(tags, True)}
    bounds = Range.of(at_least, above, at_most, below)
    if bounds is not None:
        metadata[RANGE] = bounds
    return field(default=default, metadata=metadata)


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


def tag_values(cls: type, tag: str) -> dict[str, Any]:
    """The fields of ``cls`` (nested sections included) tagged ``tag`` (:func:`option`'s ``tags``): their keys
    (:func:`key_of`), in declaration order, each with its value of the tag."""
    return {key_of(f): f.metadata[TAGS][tag] for _, f, _ in walk(cls) if tag in f.metadata.get(TAGS, {})}


def fields_tagged(cls: type, tag: str) -> tuple[str, ...]:
    """The keys (:func:`key_of`) of the fields of ``cls`` (nested sections included) tagged ``tag``, in declaration order."""
    return tuple(tag_values(cls, tag))


def range_problem(cls: type, values: Any) -> str | None:
    """The first option of ``cls`` (in declaration order) whose value in ``values`` (by key; None: not given) is
    outside its :class:`Range`, as one line (``--num-layers 0: must be >= 1``); None when all are inside."""
    for _, f, _ in walk(cls):
        bounds = f.metadata.get(RANGE)
        value = None if bounds is None else getattr(values, key_of(f))
        if value is not None and (why := bounds.problem(value)):
            return f"{flags_of(f)[0].name} {value}: {why}"
    return None


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

"""Reading a config: YAML loaded, `--set a.b=value` overrides applied, every key and type checked
against `schema` and every value by its section's `validate()`, one `ConfigError` listing every
problem; and the run directory's `config.yaml` written and read back."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml

from transformer_mt.config.schema import Config, config_to_dict, plain_copy
from transformer_mt.core.errors import ConfigError, Problems
from transformer_mt.core.files import write_text_atomic


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: object, line: int, first_line: int):
        super().__init__(f"duplicate key {key!r} (first at line {first_line}); the second would silently "
                         "replace the first")
        self.line = line


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.safe_load`'s loader, refusing a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base`: its keys may be overridden, which is what merging is for
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # a list or mapping as a key: not hashable, and no config key anyway
            if key in seen:
                raise _DuplicateKey(key, key_node.start_mark.line + 1, seen[key])
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = (),
                inherit: Callable[[Config], dict] | None = None) -> Config:
    """Read a YAML config file, apply `a.b=value` overrides, and validate it. A relative local
    `data.path`, `data.corpora` path or `train.init_from` is resolved against the config file's
    directory, or, when an override sets that key (or its section), against the current directory.
    `inherit`: when the config sets `train.init_from`, called with the config as written (unchecked,
    its paths resolved) -> sections of settings (`{"model": {...}}`) whose keys the config does not
    give are taken from there (fine-tuning: the parent's), before the config is checked."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError([f"{path}: is a directory, not a config file"])
    if not path.is_file():
        raise ConfigError([f"{path}: config file not found{_near(path)}"])
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except _DuplicateKey as err:
        raise ConfigError([f"{path}:{err.line}: {err}"]) from None
    except OSError as err:
        raise ConfigError([f"{path}: cannot read it ({err.strerror or err})"]) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(err, "problem", None) or str(err)
        hint = " (YAML is indented with spaces, never tabs)" if "'\\t'" in problem else ""
        raise ConfigError([f"{where}: YAML syntax error: {problem}{hint}"]) from None
    except UnicodeDecodeError as err:
        raise ConfigError([f"{path}: not valid UTF-8 ({err.reason})"]) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of sections, not {type(raw).__name__}"])
    overridden = {item.partition("=")[0].strip() for item in overrides}  # keys as `apply_overrides` reads them

    def base(key: str) -> Path:  # where a relative path read from `key` (or from its section) is
        return Path.cwd() if overridden & {key, key.partition(".")[0]} else path.parent

    try:
        raw = apply_overrides(raw, overrides)
        if inherit is not None:
            written = _resolved_paths(_build(Config, raw, "", Problems()), base)  # unchecked: the checks come below
            if written.train.init_from:
                raw = _with_inherited(raw, inherit(written))
        cfg = config_from_dict(raw)
    except RecursionError:  # `a: &a [*a]`: a value that contains itself
        raise ConfigError([f"{path}: a YAML alias refers to the value that contains it"]) from None
    return _resolved_paths(cfg, base)


def _with_inherited(raw: dict, inherited: dict) -> dict:
    """`raw` with each key of `inherited`'s sections that `raw` does not give (and this tmt knows)."""
    raw = dict(raw)
    known = {f.name: [key.name for key in dataclasses.fields(f.default_factory)] for f in dataclasses.fields(Config)
             if dataclasses.is_dataclass(f.default_factory)}
    for section, values in inherited.items():
        written = {} if raw.get(section) is None else raw[section]
        if isinstance(values, dict) and isinstance(written, dict):  # else `_build` reports the mapping
            raw[section] = {**{k: v for k, v in values.items() if k in known.get(section, ())}, **written}
    return raw


def _resolved_paths(cfg: Config, base: Callable[[str], Path]) -> Config:
    """`cfg` with its relative local paths resolved against `base(key)`."""
    data, init_from = cfg.data, cfg.train.init_from
    corpora = tuple(dataclasses.replace(entry, path=_resolved(entry.path, entry.format or data.format,
                                                              base("data.corpora"))) for entry in data.corpora)
    data = dataclasses.replace(data, path=_resolved(data.path, data.format, base("data.path")), corpora=corpora)
    if init_from and not user_path(init_from).is_absolute():
        init_from = str((base("train.init_from") / user_path(init_from)).resolve())
    return dataclasses.replace(cfg, data=data, train=dataclasses.replace(cfg.train, init_from=init_from))


def _near(path: Path) -> str:
    """` (did you mean configs/demo.yaml?)` when a YAML file beside `path` has a name close to it, else ""."""
    try:
        names = [entry.name for entry in path.parent.iterdir() if entry.suffix in (".yaml", ".yml")]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.8)
    return f" (did you mean {path.with_name(close[0])}?)" if close else ""


def user_path(text: str) -> Path:
    """`text` as a path, `~` expanded where it can be (`~nobody` stays as written: no such file)."""
    try:
        return Path(text).expanduser()
    except RuntimeError:  # an unknown user, or no home directory
        return Path(text)


# The config's sections, each with a key to show in advice (`--set model.d_model=...`).
_SECTIONS = {f.name: dataclasses.fields(f.default_factory)[0].name for f in dataclasses.fields(Config)
             if dataclasses.is_dataclass(f.default_factory)}


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Return a copy of `raw` with each `a.b.c=value` set; values are parsed as YAML."""
    raw = plain_copy(raw)  # YAML gives no tuples: the same dicts and lists
    problems = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item!r}: expected KEY=VALUE, e.g. train.lr=3e-4")
            continue
        try:  # argv bytes that are not UTF-8 arrive as lone surrogates (os.fsdecode)
            item.encode("utf-8")
        except UnicodeEncodeError:
            problems.append(f"--set {item!r}: not valid UTF-8 (the bytes shown as \\udcXX)")
            continue
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        node = raw
        parts = key.strip().split(".")
        if parts[0] in _SECTIONS and len(parts) == 1:  # `--set model=...`: a whole section
            if not isinstance(value, dict):  # null would silently drop the config's keys for the defaults
                problems.append(f"--set {item}: {parts[0]} is a section; set its keys, e.g. "
                                f"--set {parts[0]}.{_SECTIONS[parts[0]]}=...")
                continue
            if isinstance(raw.get(parts[0]), dict):  # `--set 'model={d_model: 256}'`: those keys, the rest kept
                value = {**raw[parts[0]], **value}
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    if problems:
        raise ConfigError(problems)
    return raw


def config_from_dict(raw: dict) -> Config:
    """Build and validate a `Config`; raise one `ConfigError` listing every problem."""
    problems = Problems()
    cfg = _build(Config, raw, "", problems)
    cfg.validate(problems)
    if problems.found:
        raise ConfigError(problems.found)
    return cfg


def read_saved_config(path: Path) -> dict | None:
    """A run's saved `config.yaml` as a plain dict, unchecked; None when missing, unreadable or no mapping."""
    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return saved if isinstance(saved, dict) else None


def save_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (the run directory's `config.yaml`)."""
    write_text_atomic(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True))


def _resolved(path: str, data_format: str, base_dir: Path) -> str:
    """A local `path` made absolute against `base_dir`; a hub name (with `format: hub`, a path that
    names no folder there), or no path, as it is."""
    if not path:
        return path
    data_path = user_path(path)
    if data_format == "hub" and not (base_dir / data_path).is_dir():
        return path
    if not data_path.is_absolute():
        data_path = (base_dir / data_path).resolve()
    return str(data_path)


def _build(cls: type, raw: Any, prefix: str, problems: Problems) -> Any:
    """Instantiate dataclass `cls` from `raw`, adding to `problems` (and unusable keys to its `defaulted`)."""
    label = prefix.rstrip(".") or "config"
    if raw is None and prefix:  # `train:` with every key commented out: all defaults
        raw = {}
    if not isinstance(raw, dict):
        problems.found.append(f"{label}: expected a mapping, got {_show(raw)}")
        problems.defaulted.append(prefix.rstrip(".") or "")  # "" (the whole config) covers every key
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (valid keys: {', '.join(names)})"
            problems.found.append(f"{prefix}{key}: unknown key{hint}")
    values = {}
    for name in names:
        if name not in raw:
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, raw[name], f"{prefix}{name}.", problems)
        elif _entry_type(hint) is not None:  # a list of entries, each a mapping of its own keys
            entries = () if raw[name] is None else raw[name]  # `corpora:` with every entry commented out
            if not isinstance(entries, (list, tuple)):
                problems.found.append(f"{prefix}{name}: expected a list of mappings, got {_show(entries)}")
                problems.defaulted.append(f"{prefix}{name}")
                continue
            named = "name" in [f.name for f in dataclasses.fields(_entry_type(hint))]  # `- dedup`: {name: dedup}
            entries = [{"name": entry} if named and isinstance(entry, str) else entry for entry in entries]
            values[name] = tuple(_build(_entry_type(hint), entry, f"{prefix}{name}[{i}].", problems)
                                 for i, entry in enumerate(entries))
        elif raw[name] is None and defaults[name] == "":  # `path:` or `--set data.path=null`: unset, as the default
            values[name] = ""
        else:
            value, problem = _coerce(raw[name], hint)
            if problem:
                problems.found.append(f"{prefix}{name}: {problem}")
                problems.defaulted.append(f"{prefix}{name}")
            else:
                values[name] = value
    return cls(**values)


def _entry_type(hint: Any) -> type | None:
    """The dataclass of a `tuple[Entry, ...]` field (a list of mappings in YAML), else None."""
    args = typing.get_args(hint)
    entries = typing.get_origin(hint) is tuple and args[1:] == (Ellipsis,) and dataclasses.is_dataclass(args[0])
    return args[0] if entries else None


def _coerce(value: Any, hint: Any) -> tuple[Any, str | None]:
    """Check `value` against a type hint; return (converted value, problem or None)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        if value in args:
            return value, None
        advice = ""
        if "cuda" in args and isinstance(value, str) and re.fullmatch(r"cuda:\d+", value):  # a device
            advice = f" (to train on GPU {value[5:]}, set cuda and start with CUDA_VISIBLE_DEVICES={value[5:]})"
        return None, f"{_show(value)} is not one of {', '.join(map(str, args))}{advice}"
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None, None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(value, inner[0])
        for alternative in inner:  # e.g. int | Literal["auto"]: the first that takes the value
            converted, problem = _coerce(value, alternative)
            if problem is None:
                return converted, None
        return None, f"expected {' or '.join(map(_describe, inner))}, got {_show(value)}"
    if origin is tuple and args[1:] == (Ellipsis,):  # a list of any length
        if not isinstance(value, (list, tuple)):
            return None, f"expected a list, got {_show(value)}"
        items = [_coerce(item, args[0]) for item in value]
        if problems := [problem for _, problem in items if problem]:
            return None, problems[0]
        return tuple(item for item, _ in items), None
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            return None, f"expected a list of {len(args)} numbers, got {_show(value)}"
        items = []
        for item, item_hint in zip(value, args):
            converted, problem = _coerce(item, item_hint)
            if problem:
                return None, problem
            items.append(converted)
        return tuple(items), None
    if hint is bool:
        return (value, None) if isinstance(value, bool) else (None, f"expected true or false, got {_show(value)}")
    if hint in (int, float):
        number = value
        if isinstance(value, str):  # YAML 1.1 reads `1e5` and `3e-4` (no dot) as strings
            try:
                number = float(value)
            except ValueError:
                pass
        if isinstance(number, bool) or not isinstance(number, (int, float)) \
                or (hint is int and isinstance(number, float) and not number.is_integer()):  # 1e5 is an integer
            return None, f"expected {_describe(hint)}, got {_show(value)}"
        if isinstance(number, float) and not math.isfinite(number):  # NaN would pass every range check
            return None, f"expected a finite number, got {_show(value)}"
        return hint(number), None
    if hint is str:
        if isinstance(value, str):
            return value, None
        # YAML reads no, yes, on, off as booleans and 1.0 as a number: a language code `no` is False.
        quote = " (quote it, e.g. 'no', for YAML to read a string)" if isinstance(value, (bool, int, float)) else ""
        return None, f"expected a string, got {_show(value)}{quote}"
    raise TypeError(f"unsupported config type {hint}")  # a programming error, not a user one


def _describe(hint: Any) -> str:
    """What a value of type `hint` is, for a message: "an integer", "auto"."""
    if typing.get_origin(hint) is Literal:
        return ", ".join(map(str, typing.get_args(hint)))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(hint, str(hint))


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"

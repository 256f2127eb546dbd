"""The documentation site's reference pages, generated from the code so they cannot drift from it.

A MkDocs hook (mkdocs.yml: `hooks`): a page holding `<!-- reference:config -->` or
`<!-- reference:cli -->` gets, in its place, every config key (from the dataclasses of
`transformer_mt/config/schema.py`: type, default and the docstring under each field) or every
command and option (from `tmt`'s argparse parser). `tests/test_docs.py` checks that nothing is
left without an entry.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import re
import types
import typing

from transformer_mt.cli.parser import build_parser
from transformer_mt.config import schema
from transformer_mt.config.schema import config_to_dict


def field_docs() -> dict[str, dict[str, str]]:
    """{class name: {field: the docstring written under it}}, read from schema.py's source."""
    docs: dict[str, dict[str, str]] = {}
    for node in ast.parse(inspect.getsource(schema)).body:
        if isinstance(node, ast.ClassDef):
            docs[node.name] = {}
            for item, following in zip(node.body, node.body[1:] + [None]):
                if isinstance(item, ast.AnnAssign) and isinstance(following, ast.Expr) \
                        and isinstance(following.value, ast.Constant):
                    docs[node.name][item.target.id] = " ".join(following.value.value.split())
    return docs


def type_name(hint) -> str:
    """`int | None`, `'text' | 'tsv'`, `list[CorpusEntry]`: a type as a user writes its values."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return " \\| ".join(repr(v) for v in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in typing.get_args(hint))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in typing.get_args(hint))}]"
    if hint is Ellipsis:
        return "..."
    return "null" if hint is type(None) else hint.__name__


def config_entries() -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default as YAML reads it, meaning) of every config key, in the schema's order."""
    docs, root = field_docs(), schema.Config()
    defaults = config_to_dict(root)
    entries = []
    for top in dataclasses.fields(schema.Config):
        section = getattr(root, top.name)
        if not dataclasses.is_dataclass(section):
            hint = typing.get_type_hints(schema.Config)[top.name]
            entries.append((top.name, type_name(hint), json.dumps(defaults[top.name]), docs["Config"].get(top.name, "")))
            continue
        hints = typing.get_type_hints(type(section))
        for f in dataclasses.fields(section):
            entries.append((f"{top.name}.{f.name}", type_name(hints[f.name]), json.dumps(defaults[top.name][f.name]),
                            docs[type(section).__name__].get(f.name, "")))
    return entries


def md_text(text: str) -> str:
    """`text` for a Markdown table cell: pipes escaped; `<...>` and `[...]` outside code spans shown as
    written, not read as HTML or links."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;").replace("[", "\\[") for i, p in enumerate(parts))


def config_reference() -> str:
    """A table per section: key, type, default, meaning."""
    out, section = [], None
    for key, kind, default, meaning in config_entries():
        head = key.split(".")[0] if "." in key else "top level"
        if head != section:
            section = head
            out += ["", f"## `{head}`" if head != "top level" else "## Top level", "",
                    "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        out.append(f"| `{key}` | {kind} | `{default}` | {md_text(meaning)} |")
    return "\n".join(out).lstrip() + "\n"


def cli_options(parser: argparse.ArgumentParser) -> list[tuple[str, str, str]]:
    """(flags, default, help) of each option and positional argument of one parser, --help left out."""
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        flags = ", ".join(action.option_strings) or action.dest
        if action.metavar and action.option_strings:
            flags += f" {action.metavar}"
        elif action.choices and action.option_strings:
            flags += " {" + ",".join(map(str, action.choices)) + "}"
        default = "" if action.default in (None, False, [], argparse.SUPPRESS) else f"`{action.default}`"
        if action.required:
            default = "required"
        rows.append((flags, default, action.help or ""))
    return rows


def commands() -> dict[str, argparse.ArgumentParser]:
    """{"tmt": the main parser, "train": its parser, ...}."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"tmt": parser, **sub.choices}


def cli_reference() -> str:
    """A section per command: what it does, its options, its examples."""
    out = []
    for name, parser in commands().items():
        title = "tmt" if name == "tmt" else f"tmt {name}"
        out += [f"## `{title}`", "", parser.description or "", "", "| option | default | meaning |",
                "| --- | --- | --- |"]
        out += [f"| `{flags}` | {default} | {md_text(text)} |"
                for flags, default, text in cli_options(parser)]
        if parser.epilog:
            out += ["", "```text", parser.epilog.strip("\n"), "```"]
        out.append("")
    return "\n".join(out)


GENERATED = {"<!-- reference:config -->": config_reference, "<!-- reference:cli -->": cli_reference}


def on_page_markdown(markdown: str, **kwargs) -> str:
    """MkDocs hook: put each generated reference where its marker stands, and unescape the pipes of
    code spans in table rows (`\\|`, which GitHub needs there and the site would show)."""
    for marker, make in GENERATED.items():
        if marker in markdown:  # in a block the stylesheet gives the tables' layout (assets/extra.css)
            markdown = markdown.replace(marker, f'<div class="reference" markdown>\n\n{make()}\n\n</div>')
    return "\n".join(re.sub(r"`[^`]*`", lambda span: span[0].replace("\\|", "|"), line) if line.startswith("|")
                     else line for line in markdown.split("\n"))

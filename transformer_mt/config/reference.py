"""The README's configuration reference, generated from the fields and docstrings of `config.py`."""

from __future__ import annotations

import ast
import dataclasses
import inspect

from transformer_mt.config import schema as config


def reference_markdown() -> str:
    """A Markdown table per config section: key, default and the field's docstring.

    Read from `config.py`'s source, so the README's configuration reference cannot drift from the
    dataclasses (a test compares them).
    """
    tree = ast.parse(inspect.getsource(config))
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            docs[node.name] = {}
            body = node.body
            for item, following in zip(body, body[1:] + [None]):
                if isinstance(item, ast.AnnAssign) and isinstance(following, ast.Expr) \
                        and isinstance(following.value, ast.Constant):
                    docs[node.name][item.target.id] = " ".join(following.value.value.split())
    root = config.Config()
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(config.Config):
        value = getattr(root, f.name)
        if not dataclasses.is_dataclass(value):
            lines.append(f"| `{f.name}` | `{value!r}` | {docs['Config'].get(f.name, '')} |")
            continue
        for sub in dataclasses.fields(value):
            default = config.config_to_dict(root)[f.name][sub.name]
            meaning = docs[type(value).__name__].get(sub.name, "").replace("|", "\\|")
            lines.append(f"| `{f.name}.{sub.name}` | `{default!r}` | {meaning} |")
    return "\n".join(lines) + "\n"

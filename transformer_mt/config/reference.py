"""The README's configuration reference, generated from the fields and docstrings of `schema.py`."""

from __future__ import annotations

import ast
import dataclasses
import inspect

from transformer_mt.config import schema


def reference_markdown() -> str:
    """A Markdown table of every config key, its default and its field's docstring (read from the source)."""
    docs: dict[str, dict[str, str]] = {}
    for node in ast.parse(inspect.getsource(schema)).body:
        if isinstance(node, ast.ClassDef):
            docs[node.name] = {item.target.id: " ".join(following.value.value.split())
                               for item, following in zip(node.body, node.body[1:])
                               if isinstance(item, ast.AnnAssign) and isinstance(following, ast.Expr)
                               and isinstance(following.value, ast.Constant)}
    root, defaults = schema.Config(), schema.config_to_dict(schema.Config())
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(schema.Config):
        value = getattr(root, f.name)
        if not dataclasses.is_dataclass(value):
            lines.append(f"| `{f.name}` | `{value!r}` | {docs['Config'].get(f.name, '')} |")
            continue
        for sub in dataclasses.fields(value):
            meaning = docs[type(value).__name__].get(sub.name, "").replace("|", "\\|")
            lines.append(f"| `{f.name}.{sub.name}` | `{defaults[f.name][sub.name]!r}` | {meaning} |")
    return "\n".join(lines) + "\n"

"""The documentation's reference covers the code: every config key, command-line option, run-directory
entry and summary.json key has an entry (the config and CLI pages are generated at build time)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from transformer_mt.config.schema import Config, config_to_dict
from transformer_mt.core.run_layout import RunDir

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("docs_reference", REPO / "tools" / "docs_reference.py")
docs_reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(docs_reference)


def dotted_keys(tree: dict, prefix: str = "") -> set[str]:
    """`train.lr`, ...: the keys of a config as a user writes them (`data.corpora` is one key)."""
    keys = set()
    for name, value in tree.items():
        key = prefix + name
        if isinstance(value, dict) and not prefix:
            keys |= dotted_keys(value, key + ".")
        else:
            keys.add(key)
    return keys


def test_every_config_key_has_a_reference_entry_with_its_meaning():
    entries = {key: meaning for key, _, _, meaning in docs_reference.config_entries()}
    assert set(entries) == dotted_keys(config_to_dict(Config()))
    assert not [key for key, meaning in entries.items() if not meaning.strip()], "a config field has no docstring"
    page = docs_reference.config_reference()
    assert all(f"| `{key}` |" in page for key in entries)


def test_every_command_and_option_has_a_reference_entry_with_its_help():
    page = docs_reference.cli_reference()
    for name, parser in docs_reference.commands().items():
        assert f"## `{'tmt' if name == 'tmt' else 'tmt ' + name}`" in page
        for action in parser._actions:
            if action.help == "show this help message and exit" or not action.option_strings and action.nargs == 0:
                continue
            if action.dest == "command":
                continue
            flag = (action.option_strings or [action.dest])[0]
            assert f"`{flag}" in page, f"tmt {name} {flag}"
            assert action.help, f"tmt {name} {flag} has no help text"


def test_the_generated_pages_replace_their_markers():
    for page in ("config.md", "cli.md"):
        text = (REPO / "docs" / "reference" / page).read_text(encoding="utf-8")
        out = docs_reference.on_page_markdown(text)
        assert "<!-- reference:" not in out and out.count("| --- |") >= 7


def test_the_run_directory_page_names_every_entry_and_summary_key(trained_workdir: Path):
    page = (REPO / "docs" / "reference" / "run-directory.md").read_text(encoding="utf-8")
    assert not [name for name in RunDir.ENTRIES if f"`{name}" not in page]
    run = trained_workdir / "runs" / "tiny"
    summary = json.loads(RunDir(run).summary.read_text(encoding="utf-8"))
    scores = json.loads(RunDir(run).test_scores.read_text(encoding="utf-8"))
    keys = set(summary) | set(summary["provenance"]) | set(summary["data"]) | set(scores)
    assert not sorted(key for key in keys if f"`{key}`" not in page)



def test_a_pipe_escaped_in_a_table_code_span_reads_as_a_pipe_on_the_site():
    """GitHub needs `\\|` inside a table's code span; the site shows the code without the backslash."""
    import markdown

    page = (REPO / "docs" / "results" / "index.md").read_text(encoding="utf-8")
    assert "`nrefs:1\\|case:mixed" in page  # as GitHub reads it
    html = markdown.markdown(docs_reference.on_page_markdown(page), extensions=["tables"])
    assert "<code>nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0</code>" in html
    assert "\\|" not in html


def test_site_search_finds_a_config_key_typed_without_its_section():
    """`keep_last` must match `train.keep_last`: the search index splits keys at dots and underscores."""
    import re

    import yaml

    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8").replace("!!python", "python"))
    search = next(p["search"] for p in config["plugins"] if isinstance(p, dict) and "search" in p)
    split = [word for word in re.split(search["separator"], "train.keep_last: 5") if word]
    assert split == ["train", "keep", "last", "5"]
    assert [word for word in re.split(search["separator"], "sacreBLEU 2.6.0") if word] == ["sacreBLEU", "2.6.0"]

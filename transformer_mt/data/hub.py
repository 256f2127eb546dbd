"""Parallel text from a Hugging Face Hub dataset (or a folder saved from one) as `SplitSource`s; errors
name the dataset, split and row, and say what to do (no network, a loading script, a wrong column)."""

from __future__ import annotations

import functools
import os
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from transformer_mt.config.schema import DataConfig
from transformer_mt.core.errors import DataError
from transformer_mt.data.sources import CHUNK_ROWS, SPLITS, PairChunk, SplitSource, pair_from_record

if TYPE_CHECKING:
    import datasets

HUB_VALID_NAMES = ("validation", "valid", "dev")
# How `datasets` refuses a dataset defined by a loading script (a RuntimeError).
LOADING_SCRIPT_REFUSED = "Dataset scripts are no longer supported"
PARQUET_CONVERSION = "refs/convert/parquet"  # the hub's branch of Parquet files made from a dataset
PROBE_TIMEOUT_S = 5.0


def hub_sources(cfg: DataConfig) -> dict[str, SplitSource | None]:
    """The sources of train, valid and test (None: missing) of a Hub dataset, its columns checked."""
    # A local dataset folder needs no network; behind a proxy a direct probe proves nothing.
    proxy = any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))
    if not _hub_offline() and not proxy and not Path(cfg.path).is_dir():
        _check_hub_reachable(cfg)
    dataset_dict = _load_hub_dataset(cfg)
    names = {"train": ["train"], "valid": list(HUB_VALID_NAMES), "test": ["test"]}
    sources: dict[str, SplitSource | None] = dict.fromkeys(SPLITS)
    for split in SPLITS:
        found = next((name for name in names[split] if name in dataset_dict), None)
        if found is not None:
            dataset = dataset_dict[found]
            chunks = functools.partial(_hub_chunks, dataset, cfg, found, _pair_columns(dataset, cfg, found))
            sources[split] = SplitSource(f"hub split {found!r} of {cfg.path} ({len(dataset)} rows)",
                                         f"hub:{dataset._fingerprint}", chunks)
    if sources["train"] is None:
        raise DataError(f"data.path: hub dataset {cfg.path!r} has no 'train' split "
                        f"(splits: {', '.join(dataset_dict)})")
    return sources


def _local_files_hint(cfg: DataConfig) -> str:
    return (f"train from local files instead: set data.format: text and data.path: a directory with "
            f"train.{cfg.src_lang}/train.{cfg.tgt_lang} (see README)")


def _hub_offline() -> bool:
    """True when the environment tells `datasets` to use only its local cache."""
    true_values = {"1", "ON", "YES", "TRUE"}  # as datasets.config.ENV_VARS_TRUE_VALUES
    return any(os.environ.get(name, "").upper() in true_values for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _check_hub_reachable(cfg: DataConfig) -> None:
    """Fail in seconds, not after minutes of retries, when the Hub host cannot be reached (a daemon
    thread probes it, so that a stalled DNS lookup cannot hang the run)."""
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)

    outcome: list[OSError | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
            outcome.append(None)
        except OSError as err:
            outcome.append(err)

    thread = threading.Thread(target=probe, name="hub-probe", daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT_S + 1)
    error = outcome[0] if outcome else TimeoutError("timed out")
    if error is not None:
        raise DataError(f"cannot reach the Hugging Face Hub to download {cfg.path!r} ({host}:{port}: {error}). "
                        f"Without a network, {_local_files_hint(cfg)}; or, if the dataset is already in your HF "
                        "cache, set HF_HUB_OFFLINE=1.")


def _load_hub_dataset(cfg: DataConfig) -> datasets.DatasetDict:
    import datasets

    if cfg.revision == PARQUET_CONVERSION and cfg.hub_config is None:  # all language pairs in one
        raise DataError(f"data.hub_config: with data.revision: {PARQUET_CONVERSION}, name the configuration to "
                        "read (its folder on that branch, e.g. iwslt2017-en-it; 'default' for a dataset with "
                        "only one)")
    was_enabled = datasets.is_progress_bar_enabled()
    if not sys.stderr.isatty():
        datasets.disable_progress_bars()  # a log file or CI: no "Generating train split" bars in it
    cannot_build = getattr(datasets.exceptions, "DatasetGenerationError", ())
    try:
        if cfg.revision == PARQUET_CONVERSION:  # a folder per configuration, `<config>/<split>/0000.parquet`
            return datasets.load_dataset(cfg.path, data_dir=cfg.hub_config, revision=cfg.revision)
        return datasets.load_dataset(cfg.path, cfg.hub_config, revision=cfg.revision)
    except cannot_build as err:  # whatever went wrong (a full disk, a bad file): name its cause
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 else (f"{type(err.__cause__).__name__}: {err.__cause__}"
                                                  if err.__cause__ is not None else (lines[0] if lines else ""))
        advice = ("; local files of sentence pairs load with data.format: text, tsv or jsonl (README, Data)"
                  if Path(cfg.path).is_dir() else "")
        raise DataError(f"data.path={cfg.path!r}: datasets could not build a dataset from it "
                        f"({detail[:300]}){advice}") from err
    except RuntimeError as err:
        if LOADING_SCRIPT_REFUSED not in str(err):
            raise  # not a known data problem: reported as an internal error
        raise DataError(_loading_script_advice(cfg, script=str(err).rpartition(" ")[2])) from None
    except (OSError, ValueError) as err:  # not found, no network (a ConnectionError), bad config name or revision
        offline = (" HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set, so only your HF cache was looked at: unset it to "
                   f"download the dataset, or {_local_files_hint(cfg)}."
                   if _hub_offline() and isinstance(err, ConnectionError) else "")
        raise DataError(f"cannot load hub dataset data.path={cfg.path!r}, data.hub_config={cfg.hub_config!r}"
                        f"{f', data.revision={cfg.revision!r}' if cfg.revision else ''}: "
                        f"{type(err).__name__}: {str(err).rstrip('.')}.{offline}") from None
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _loading_script_advice(cfg: DataConfig, script: str) -> str:
    """Why a dataset defined by a loading script `script` does not load, and what to do instead."""
    import datasets

    local = (", with data.path set to the dataset's hub name rather than this local folder"
             if Path(cfg.path).is_dir() else "")
    return (f"data.path={cfg.path!r}: this dataset is defined by a loading script ({script}), which the installed "
            f"datasets {datasets.__version__} no longer runs. If the dataset has a Parquet conversion on the hub, load "
            f"that: data.revision: {PARQUET_CONVERSION}, data.hub_config: the configuration's folder there "
            f"('default' if it has only one){local}; or export the dataset to local files and "
            "use data.format: text, tsv or jsonl (see README, Data)")


def _pair_columns(dataset: datasets.Dataset, cfg: DataConfig, split_name: str) -> list[str]:
    """The columns that hold a split's pairs: `["translation"]` of {lang: text} dicts (first choice), or
    `[src_lang, tgt_lang]`, a text column per language."""
    if "translation" in dataset.column_names:
        feature = dataset.features["translation"]  # a `Translation` feature or a struct of strings
        languages = [str(lang) for lang in getattr(feature, "languages", None) or
                     (list(feature) if isinstance(feature, dict) else [])]
        missing = [f"data.{side}_lang={lang!r}" for side, lang in (("src", cfg.src_lang), ("tgt", cfg.tgt_lang))
                   if lang not in languages]
        if missing:
            raise DataError(f"{' and '.join(missing)} not in the translation column of hub dataset {cfg.path!r} "
                            f"(available: {', '.join(languages)})")
        return ["translation"]
    columns = [cfg.src_lang, cfg.tgt_lang]
    if not all(column in dataset.column_names for column in columns):
        raise DataError(f"data.path: hub dataset {cfg.path!r} split {split_name!r} has neither a 'translation' "
                        f"column nor columns {cfg.src_lang!r} and {cfg.tgt_lang!r} (data.src_lang, data.tgt_lang); "
                        f"columns found: {', '.join(dataset.column_names)}. data.format: hub reads a 'translation' "
                        "column of {language: text} dicts, or one text column per language named by "
                        "data.src_lang and data.tgt_lang")
    for column in columns:
        feature = dataset.features[column]
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise DataError(f"hub dataset {cfg.path!r} split {split_name!r}: column {column!r} holds {feature}, "
                            "not text (one sentence per row)")
    return columns


def _hub_chunks(dataset: datasets.Dataset, cfg: DataConfig, split_name: str, columns: list[str]) -> Iterator[PairChunk]:
    """Stripped (src, tgt) chunks from the `columns` of `_pair_columns`, read from the memory-mapped Arrow table."""
    table = dataset.with_format("arrow").select_columns(columns)
    for start in range(0, len(dataset), CHUNK_ROWS):
        batch = table[start:start + CHUNK_ROWS]  # a pyarrow Table: ~50x faster than row access
        # A `translation` row is already a {lang: text} record; text columns give {src_lang: .., tgt_lang: ..}.
        rows = batch["translation"].to_pylist() if columns == ["translation"] else batch.to_pylist()
        pairs = [pair_from_record(row, cfg.src_lang, cfg.tgt_lang, where=f"{cfg.path} {split_name} row {start + i}")
                 for i, row in enumerate(rows)]
        yield [s for s, _ in pairs], [t for _, t in pairs]

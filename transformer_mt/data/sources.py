"""Parallel text as `SplitSource`s, streams of pair chunks: from local files (text, tsv, jsonl, TMX, maybe
gzipped; all streamed) or a Hugging Face Hub dataset (or a folder saved from one)."""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import logging
import os
import re
import socket
import sys
import threading
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit
from xml.parsers.expat import ErrorString

from transformer_mt.config.schema import DataConfig
from transformer_mt.core.errors import DataError

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
# The names a split's local files may start with (`dev.en`, `validation.tsv`, ...).
LOCAL_SPLIT_NAMES = {"train": ("train",), "valid": ("valid", "dev", "validation"), "test": ("test",)}
CHUNK_ROWS = 50_000  # rows per chunk; read when a stream starts, so tests can shrink it
READ_CHUNK_BYTES = 4 << 20
HUB_VALID_NAMES = ("validation", "valid", "dev")
# How `datasets` refuses a dataset defined by a loading script (a RuntimeError).
LOADING_SCRIPT_REFUSED = "Dataset scripts are no longer supported"
PARQUET_CONVERSION = "refs/convert/parquet"  # the hub's branch of Parquet files made from a dataset
PROBE_TIMEOUT_S = 5.0

Pair = tuple[str, str]
PairChunk = tuple[list[str], list[str]]  # stripped source and target strings of consecutive rows


@dataclass(frozen=True)
class SplitSource:
    """One split's origin: how to stream it, and a key that changes whenever its content may have."""

    description: str  # the files, or the Hub dataset and split, for log lines
    key: str  # paths, sizes and modification times of the files, or the Hub dataset's fingerprint
    chunks: Callable[[], Iterator[PairChunk]]  # a fresh stream of the split's rows, `CHUNK_ROWS` at a time


def local_sources(cfg: DataConfig) -> dict[str, SplitSource | None]:
    """The sources of train, valid and test in the directory `data.path` (None: no such split), from file metadata;
    a `.tmx` or `.tmx.gz` file as `data.path` is the training split alone."""
    directory = Path(cfg.path)
    if directory.is_file():
        if not is_tmx(directory):
            raise DataError(f"data.path: {cfg.path!r} is a file; expected a directory (data.format: {cfg.format}) "
                            "or a .tmx or .tmx.gz file")
        return {"train": _file_source([directory], _local_chunks("tmx", cfg, [directory])), "valid": None,
                "test": None}
    if not directory.is_dir():
        raise DataError(f"data.path: {cfg.path!r} is not a directory (data.format: {cfg.format})")
    sources = {split: _local_split(cfg, directory, split) for split in SPLITS}
    if sources["train"] is None:
        expected = [f"{directory / name} (or {directory / name}.gz)" for name in _local_file_names(cfg, "train")]
        raise DataError(f"no training data: expected {' and '.join(expected)} (data.format: {cfg.format})")
    return sources


def _local_split(cfg: DataConfig, directory: Path, split: str) -> SplitSource | None:
    """The files of `split` in `directory`, under any of its `LOCAL_SPLIT_NAMES`; None when there are none."""
    found: dict[str, list[Path | None]] = {}  # name -> each of its files (None: missing), for the names in use
    for name in LOCAL_SPLIT_NAMES[split]:
        files = [_find_file(directory / file_name) for file_name in _local_file_names(cfg, name)]
        if any(f is not None for f in files):
            found[name] = files
    if not found:
        return None
    if len(found) > 1:
        in_use = ", ".join(str(f) for files in found.values() for f in files if f is not None)
        raise DataError(f"ambiguous {split} split: {directory} has files named {_one_of(found, 'and')} "
                        f"({in_use}); tmt reads the {split} split from {_one_of(LOCAL_SPLIT_NAMES[split], 'or')} "
                        "and does not guess which: remove or rename all but one")
    [(name, files)] = found.items()
    missing = [directory / file_name for file_name, f in zip(_local_file_names(cfg, name), files) if f is None]
    if missing:
        raise DataError(f"{split} split: {missing[0]} (or {missing[0]}.gz) not found, "
                        f"but {next(f for f in files if f is not None)} exists")
    present = [f for f in files if f is not None]
    return _file_source(present, _local_chunks(cfg.format, cfg, present))


def _file_source(files: list[Path], chunks: Callable[[], Iterator[PairChunk]]) -> SplitSource:
    """A split read from `files`, keyed by their resolved paths, sizes and modification times (cheap, and
    changes when a file does)."""
    key = "\n".join(f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}" for path in files)
    return SplitSource(", ".join(map(str, files)), hashlib.blake2b(key.encode("utf-8"), digest_size=16).hexdigest(),
                       chunks)


def _one_of(names: Iterable[str], conjunction: str) -> str:
    """`valid.*, dev.* or validation.*`."""
    patterns = [f"{name}.*" for name in names]
    return f"{', '.join(patterns[:-1])} {conjunction} {patterns[-1]}"


def _local_file_names(cfg: DataConfig, name: str) -> list[str]:
    """The files (before an optional `.gz`) of a split named `name` (`train`, `dev`, ...) in `cfg.format`."""
    if cfg.format == "text":
        return [f"{name}.{cfg.src_lang}", f"{name}.{cfg.tgt_lang}"]
    return [f"{name}.{cfg.format}"]


def _find_file(path: Path) -> Path | None:
    """Return `path` or `path.gz`, whichever exists; None if neither; error if both."""
    gz_path = path.with_name(path.name + ".gz")
    for candidate in (path, gz_path):
        if candidate.is_dir():
            raise DataError(f"{candidate} is a directory, not a data file")
    if path.is_file() and gz_path.is_file():
        raise DataError(f"both {path} and {gz_path} exist; remove one so it is clear which to read")
    return path if path.is_file() else gz_path if gz_path.is_file() else None


def _local_chunks(file_format: str, cfg: DataConfig, files: list[Path]) -> Callable[[], Iterator[PairChunk]]:
    if file_format == "text":
        return lambda: iter_aligned_files(files[0], files[1], CHUNK_ROWS)
    pairs = {"tsv": _tsv_pairs, "jsonl": _jsonl_pairs, "tmx": _tmx_pairs}[file_format]
    return lambda: _rechunk(pairs(files[0], cfg.src_lang, cfg.tgt_lang), CHUNK_ROWS)


def is_tmx(path: Path) -> bool:
    """Whether a file's name says TMX: `.tmx` or `.tmx.gz`, in any case."""
    return path.name.lower().endswith((".tmx", ".tmx.gz"))


class _Reader:
    """A binary file, maybe gzipped, read in blocks: counts the bytes and the "\\n"s read so far, and names
    the file and where it broke (line, uncompressed byte) when it cannot be read on."""

    def __init__(self, path: Path):
        self.path, self.bytes, self.lines = path, 0, 0
        try:
            self.file = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
        except OSError as err:
            raise DataError(f"{path}: cannot read ({err})") from None

    def read(self, size: int | None = None) -> bytes:
        try:
            block = self.file.read(size or READ_CHUNK_BYTES)
        except (OSError, EOFError, zlib.error) as err:  # not gzip, a truncated or damaged .gz, a disk error
            raise DataError(f"{self.path}: cannot read from line {self.lines + 1} on (uncompressed byte "
                            f"{self.bytes}): {err}") from None
        self.bytes += len(block)
        self.lines += block.count(b"\n")
        return block

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def iter_lines(path: Path) -> Iterator[list[str]]:
    """Lines of a UTF-8 file, maybe gzipped, in chunks of a few MB: split on "\\n", without "\\n" or
    "\\r\\n" and a starting byte-order mark; an encoding error names its line."""
    lines_before = 0  # "\n"s in the chunks yielded so far, for error messages
    partial: list[bytes] = []  # the start of a line that goes on in the next block: holds no "\n"
    with _Reader(path) as f:
        while block := f.read():
            if lines_before == 0 and not partial:  # the first block
                refuse_cr_line_breaks(path, block)
            cut = block.rfind(b"\n") + 1
            if cut == 0:
                partial.append(block)
                continue
            data = b"".join([*partial, block[:cut]])
            partial = [block[cut:]] if cut < len(block) else []
            yield _decode_lines(path, data, lines_before)
            lines_before = f.lines  # every "\n" read so far: `partial` holds none
        if partial:  # the last line has no "\n"
            yield _decode_lines(path, b"".join(partial), lines_before)


def refuse_cr_line_breaks(source: Path | str, first_block: bytes) -> None:
    """Refuse text whose lines end in "\\r" alone, judged on its first block (`source`: the file, or "stdin")."""
    if b"\n" not in first_block and b"\r" in first_block[:-1]:
        raise DataError(f"{source}: its lines end in a carriage return (\\r) alone, which tmt does not read as a "
                        "line break (it splits on \\n or \\r\\n); convert them first, e.g. with tr '\\r' '\\n'")


def _decode_lines(path: Path, data: bytes, lines_before: int) -> list[str]:
    """The lines of `data` (whole lines of `path` after its first `lines_before`), without "\\r\\n" or "\\n"."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        lineno = lines_before + data.count(b"\n", 0, err.start) + 1
        raise DataError(f"{path}:{lineno}: not valid UTF-8 ({err.reason})") from None
    if lines_before == 0:
        text = text.removeprefix("\ufeff")  # a byte-order mark is not text
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the newline that ends the last line starts no new one
    return [line.removesuffix("\r") for line in lines]


def read_stream_lines(stream: Iterable[bytes], name: str) -> list[str]:
    """Every line of a binary stream (stdin), as `read_lines` reads a file."""
    lines = []
    for number, raw in enumerate(stream, start=1):
        if number == 1:
            refuse_cr_line_breaks(name, raw)
        lines.append(decode_line(raw, name, number))
    return lines


def decode_line(raw: bytes, name: str, number: int) -> str:
    """Line `number` (from 1) of `name` as text, without its line break (and, for the first, a byte-order mark)."""
    try:
        line = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as err:
        raise DataError(f"{name} line {number}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
    return line.removeprefix("\ufeff") if number == 1 else line  # a byte-order mark is not text


def read_lines(path: Path) -> list[str]:
    """All lines of a (small) UTF-8 file, as `iter_lines` reads them."""
    return [line for chunk in iter_lines(path) for line in chunk]


def iter_aligned_files(src_path: Path, tgt_path: Path, chunk_rows: int = CHUNK_ROWS) -> Iterator[PairChunk]:
    """Pair line i of `src_path` with line i of `tgt_path` (both stripped), `chunk_rows` at a time."""
    src_lines = chain.from_iterable(iter_lines(src_path))
    tgt_lines = chain.from_iterable(iter_lines(tgt_path))
    rows = 0
    while True:
        src, tgt = list(islice(src_lines, chunk_rows)), list(islice(tgt_lines, chunk_rows))
        if len(src) != len(tgt):
            n_src = rows + len(src) + sum(1 for _ in src_lines)
            n_tgt = rows + len(tgt) + sum(1 for _ in tgt_lines)
            raise DataError(f"{src_path} has {n_src} lines but {tgt_path} has {n_tgt}; "
                            "aligned files need one line per sentence pair")
        if not src:
            return
        rows += len(src)
        yield [line.strip() for line in src], [line.strip() for line in tgt]


def read_aligned_files(src_path: Path, tgt_path: Path) -> list[Pair]:
    """All pairs of two (small) aligned files, e.g. a test set given on the command line."""
    return [pair for src, tgt in iter_aligned_files(src_path, tgt_path) for pair in zip(src, tgt)]


def _rechunk(pairs: Iterator[Pair], chunk_rows: int) -> Iterator[PairChunk]:
    while chunk := list(islice(pairs, chunk_rows)):
        yield [s for s, _ in chunk], [t for _, t in chunk]


def _numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line of `path`, numbered from 1."""
    return enumerate(chain.from_iterable(iter_lines(path)), start=1)


def _tsv_pairs(path: Path, src_lang: str, tgt_lang: str) -> Iterator[Pair]:
    """`source<TAB>target` lines, verbatim (no quoting, no NA values); a blank line is an empty pair."""
    for lineno, line in _numbered_lines(path):
        if not line.strip():
            yield "", ""
            continue
        fields = line.split("\t")
        if len(fields) != 2:
            raise DataError(f"{path}:{lineno}: expected source<TAB>target (one tab), found {len(fields) - 1} tabs")
        pair = fields[0].strip(), fields[1].strip()
        if lineno == 1 and (pair[0].lower(), pair[1].lower()) in (
                (src_lang.lower(), tgt_lang.lower()), ("source", "target"), ("src", "tgt")):
            logger.warning("%s:1 looks like a header row (%s<TAB>%s); tmt reads every line as a sentence "
                           "pair, so remove it if it is one", path, *pair)
        yield pair


def _jsonl_pairs(path: Path, src_lang: str, tgt_lang: str) -> Iterator[Pair]:
    """`{"translation": {src: .., tgt: ..}}` or `{src: .., tgt: ..}` lines; blank lines are skipped."""
    for lineno, line in _numbered_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
        if isinstance(record, dict) and isinstance(record.get("translation"), dict):
            record = record["translation"]
        yield pair_from_record(record, src_lang, tgt_lang, where=f"{path}:{lineno}")


XML_LANG = "{http://www.w3.org/XML/1998/namespace}lang"
# Inline elements of a TMX segment whose content is markup of the original document, not text.
TMX_CODES = frozenset({"bpt", "ept", "it", "ph", "ut"})


def _tmx_pairs(path: Path, src_lang: str, tgt_lang: str) -> Iterator[Pair]:
    """The source and target `<seg>` of each `<tu>`, its `<tuv>`s matched by `xml:lang` (or TMX 1.1's `lang`)
    case-insensitively and by primary subtag (`en-US` is `en`); a `<tu>` without both languages is skipped.
    Streamed: each `<tu>` is dropped from the tree once read."""
    wanted = src_lang.lower().replace("_", "-"), tgt_lang.lower().replace("_", "-")
    seen: set[str] = set()  # the languages of the file, for the error when none matches
    skipped = pairs = 0
    body = None
    with _Reader(path) as f:
        try:
            for event, element in ET.iterparse(f, events=("start", "end")):
                if event == "start":
                    if element.tag == "body":
                        body = element
                    continue
                if element.tag != "tu":
                    continue
                segs: list[str | None] = [None, None]
                for tuv in element.iter("tuv"):
                    lang = (tuv.get(XML_LANG) or tuv.get("lang") or "").lower().replace("_", "-")
                    seen.add(lang)
                    for side, code in enumerate(wanted):
                        if segs[side] is None and code in (lang, lang.split("-")[0]):
                            seg = tuv.find("seg")
                            segs[side] = "" if seg is None else _seg_text(seg)
                if segs[0] is None or segs[1] is None:
                    skipped += 1
                else:
                    pairs += 1
                    yield (one_line(segs[0], src_lang, str(path)), one_line(segs[1], tgt_lang, str(path)))
                element.clear()
                if body is not None:
                    body.clear()  # the read <tu>s leave the tree: memory stays that of one
        except ET.ParseError as err:
            line, column = err.position
            raise DataError(f"{path}:{line}: not valid TMX ({ErrorString(err.code)} at column "
                            f"{column + 1})") from None
    if skipped:
        found = ", ".join(sorted(seen - {""})) or "none"
        if not pairs:
            raise DataError(f"{path}: no <tu> has both data.src_lang={src_lang!r} and data.tgt_lang={tgt_lang!r} "
                            f"(the xml:lang of its <tuv>s: {found})")
        logger.warning("%s: skipped %d <tu>(s) without both %s and %s", path, skipped, src_lang, tgt_lang)


def _seg_text(seg: ET.Element) -> str:
    """A `<seg>`'s text: its inline elements' text (`<hi>`, `<sub>`) but not the original's codes (`<bpt>`, `<ph>`, ...)."""
    parts = [seg.text or ""]
    for child in seg:
        if child.tag not in TMX_CODES:
            parts.append(_seg_text(child))
        parts.append(child.tail or "")
    return "".join(parts)


# Line breaks inside a record's text (JSONL, hub rows): a sentence stays on one line.
LINE_BREAKS = re.compile(r"\s*[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]+\s*")


def pair_from_record(record: Any, src_lang: str, tgt_lang: str, where: str) -> Pair:
    """The source and target strings of a {lang: text} mapping, stripped, line breaks made spaces (null: "")."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with keys {src_lang!r} and {tgt_lang!r}")
    for key, lang in (("data.src_lang", src_lang), ("data.tgt_lang", tgt_lang)):
        if lang not in record:
            raise DataError(f"{where}: missing key {lang!r} ({key}); keys found: {', '.join(map(str, record))}")
        if not isinstance(record[lang], (str, type(None))):
            raise DataError(f"{where}: {lang!r} must be a string, got {type(record[lang]).__name__}")
    return one_line(record[src_lang], src_lang, where), one_line(record[tgt_lang], tgt_lang, where)


def one_line(text: str | None, key: str, where: str) -> str:
    """A record's text field (`key`) stripped, on one line (null: ""), refused at `where` if not Unicode."""
    text = LINE_BREAKS.sub(" ", text or "").strip()
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # JSON's "\ud83d" escape: half of an emoji, cut off
        raise DataError(f"{where}: {key!r} is not valid Unicode ({err.reason} at character {err.start})") from None
    return text


# --- Hugging Face Hub datasets ------------------------------------------------------------------

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
            f"train.{cfg.src_lang}/train.{cfg.tgt_lang} (guide: Data, \"Formats\")")


def _hub_offline() -> bool:
    """True when the environment tells `datasets` to use only its local cache."""
    true_values = {"1", "ON", "YES", "TRUE"}  # as datasets.config.ENV_VARS_TRUE_VALUES
    return any(os.environ.get(name, "").upper() in true_values for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _check_hub_reachable(cfg: DataConfig) -> None:
    """Fail in seconds when the Hub host cannot be reached (probed in a daemon thread: DNS may stall)."""
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
        advice = ("; local files of sentence pairs load with data.format: text, tsv or jsonl (guide: Data, \"Formats\")"
                  if Path(cfg.path).is_dir() else "")
        raise DataError(f"data.path={cfg.path!r}: datasets could not build a dataset from it "
                        f"({detail[:300]}){advice}") from err
    except RuntimeError as err:
        if LOADING_SCRIPT_REFUSED not in str(err):
            raise  # not a known data problem: reported as an internal error
        local = (", with data.path set to the dataset's hub name rather than this local folder"
                 if Path(cfg.path).is_dir() else "")
        raise DataError(f"data.path={cfg.path!r}: this dataset is defined by a loading script "
                        f"({str(err).rpartition(' ')[2]}), which the installed datasets {datasets.__version__} no "
                        f"longer runs. If the dataset has a Parquet conversion on the hub, load that: data.revision: "
                        f"{PARQUET_CONVERSION}, data.hub_config: the configuration's folder there ('default' if it "
                        f"has only one){local}; or export the dataset to local files and use data.format: text, "
                        "tsv or jsonl (guide: Data, \"Formats\")") from None
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


def _pair_columns(dataset: datasets.Dataset, cfg: DataConfig, split_name: str) -> list[str]:
    """The columns of a split's pairs: `["translation"]` ({lang: text}), else `[src_lang, tgt_lang]` (text)."""
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

"""scripts/prepare_tatoeba.py: the documented split of manythings.org's file, which tmt then reads."""

import gzip
import importlib.util
import io
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO
from transformer_mt.config.loading import load_config
from transformer_mt.data.sources import local_sources

SCRIPT = REPO / "scripts" / "prepare_tatoeba.py"
spec = importlib.util.spec_from_file_location("prepare_tatoeba", SCRIPT)
prepare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prepare)

# manythings' layout: English, Italian, attribution; CRLF; repeats and odd spacing on purpose.
LINES = [f"Sentence  {i % 40}.\tFrase {i}.\tCC-BY 2.0 (France) Attribution: tatoeba.org #{i}" for i in range(120)]
LINES += ["Sentence  1.\tFrase 1.\tCC-BY", "Hi.\t\tCC-BY", " Hi. \t Ciao! \tCC-BY"]


def read(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


@pytest.fixture
def zipped(tmp_path: Path) -> Path:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("ita.txt", "\r\n".join(LINES) + "\r\n")
        archive.writestr("_about.txt", "about")
    path = tmp_path / "ita-eng.zip"
    path.write_bytes(buffer.getvalue())
    return path


def test_pairs_are_cleaned_and_split_by_english_sentence_into_files_tmt_reads(zipped: Path, tmp_path: Path):
    out = tmp_path / "tatoeba"
    assert prepare.main(["--source", str(zipped), "--out", str(out), "--test-size", "10", "--valid-size", "12"]) == 0
    splits = {split: list(zip(read(out / f"{split}.en{'.gz' if split == 'train' else ''}"),
                              read(out / f"{split}.it{'.gz' if split == 'train' else ''}")))
              for split in ("train", "valid", "test")}
    every = [pair for pairs in splits.values() for pair in pairs]
    assert len(every) == len(set(every)) == 121  # 120 + "Ciao!"; the repeat and the empty side dropped
    assert ("Sentence 1.", "Frase 1.") in every and ("Hi.", "Ciao!") in every  # whitespace collapsed, stripped
    english = {split: {en for en, _ in pairs} for split, pairs in splits.items()}
    assert not english["train"] & english["test"] and not english["train"] & english["valid"]
    assert not english["valid"] & english["test"]
    assert 10 <= len(splits["test"]) < 10 + 3 and 12 <= len(splits["valid"]) < 12 + 3  # whole groups of 3
    for pairs in splits.values():  # the file's order kept within each split
        numbers = [int(it.split()[1].rstrip(".")) for _, it in pairs if it.startswith("Frase")]
        assert numbers == sorted(numbers)
    cfg = load_config(REPO / "configs" / "tatoeba-en-it-cpu.yaml", [f"data.path={out}"])
    assert all(source is not None for source in local_sources(cfg.data).values())


def test_the_split_is_the_same_for_the_same_seed_and_another_for_another(zipped: Path, tmp_path: Path):
    runs = []
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        prepare.main(["--source", str(zipped), "--out", str(tmp_path / name), "--test-size", "10",
                      "--valid-size", "10", "--seed", seed])
        runs.append((tmp_path / name / "test.en").read_text(encoding="utf-8"))
    assert runs[0] == runs[1] != runs[2]


def test_it_never_writes_into_a_folder_that_holds_files(zipped: Path, tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep", encoding="utf-8")
    with pytest.raises(SystemExit, match="not empty"):
        prepare.main(["--source", str(zipped), "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]

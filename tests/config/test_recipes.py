"""The published recipes in configs/: each loads, says how to point it at the data, and keeps
the quality settings docs/results/ reports (shared vocabulary, tied embeddings, beam 5)."""

from pathlib import Path

import pytest

from tests.helpers import REPO
from transformer_mt.config.loading import load_config

RECIPES = sorted(p for p in (REPO / "configs").glob("*.yaml") if p.stem not in {"demo", "noisy-demo", "en-it"})


def test_the_corpus_recipes_are_all_there():
    names = {p.stem for p in RECIPES}
    assert names >= {"multi30k-en-de", "multi30k-en-de-cpu", "tatoeba-en-it", "tatoeba-en-it-cpu"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_loads_documents_its_data_override_and_decodes_with_beam_5(path: Path, tmp_path: Path):
    header = "".join(line for line in path.read_text("utf-8").splitlines(keepends=True) if line.startswith("#"))
    assert f"--config configs/{path.name}" in header and "--set data.path=" in header
    cfg = load_config(path, [f"data.path={tmp_path}"])  # any copy of the corpus, as the header says
    assert cfg.data.path == str(tmp_path)
    assert cfg.name == path.stem
    assert cfg.tokenizer.joint and cfg.model.share_embeddings and cfg.model.tie_output
    assert cfg.decode.beam_size == 5 and cfg.train.label_smoothing == 0.1 and cfg.train.weight_decay > 0
    assert cfg.train.average_last > 0 and cfg.train.test_at_end
    if path.stem.endswith("-cpu"):
        assert cfg.train.device == "cpu"
    expected_tokenize = "none" if path.stem.startswith("multi30k") else "13a"  # tok/ text vs raw text
    assert cfg.train.bleu_tokenize == expected_tokenize

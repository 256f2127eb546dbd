import json
from pathlib import Path

import pytest
import torch

from tests.helpers import SOURCES, encode_pairs, make_run
from transformer_mt.core.errors import UsageError
from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID
from transformer_mt.decode.hf_export import export_hf
from transformer_mt.decode.translator import Translator

# Short caps, so that some translations end at their cap and others with EOS before it.
CAP = {"max_len_a": 0.5, "max_len_b": 2}


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def load_folder(transformers, folder: Path, trust_remote_code: bool = True):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=trust_remote_code)
    return tokenizer, model.eval()


def tmt_translate(run_dir: Path, beam: int, **decode) -> list[str]:
    translator = Translator.from_run(run_dir, device="cpu", engine="torch")
    translator.set_decoding(**decode)
    return translator.translate(SOURCES, beam_size=beam)


def hf_translate(tokenizer, model, beam: int, **generate) -> list[str]:
    batch = tokenizer(SOURCES, return_tensors="pt", padding=True)  # one batch: per-sentence caps matter
    with torch.no_grad():
        ids = model.generate(**batch, num_beams=beam, **generate)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("beam", [1, 4])
def test_transformers_generate_equals_tmt_translate(transformers, tmp_path: Path, norm: str, beam: int):
    make_run(tmp_path / "run", norm, True)
    export_hf(tmp_path / "run", tmp_path / "hf")
    tokenizer, model = load_folder(transformers, tmp_path / "hf")
    assert type(model).__name__ == {"pre": "PegasusForConditionalGeneration", "post": "MarianMTModel"}[norm]

    for alpha in (0.6, 2.0):  # the run's default, and one that ranks long hypotheses far higher
        expected = tmt_translate(tmp_path / "run", beam, length_penalty=alpha, **CAP)
        assert hf_translate(tokenizer, model, beam, length_penalty=alpha, **CAP) == expected
    assert len(set(expected)) > 1


def test_the_exported_network_computes_tmts_log_probs(transformers, tmp_path: Path):
    model, tokenizers = make_run(tmp_path / "run", "post", True)
    export_hf(tmp_path / "run", tmp_path / "hf")
    _, hf_model = load_folder(transformers, tmp_path / "hf", trust_remote_code=False)
    src_ids, tgt_in_ids, _ = encode_pairs(tokenizers)
    with torch.no_grad():
        logits = model(src_ids, tgt_in_ids, pack=False).view(*tgt_in_ids.shape, -1)  # (B, T, V)
        hf_logits = hf_model(input_ids=src_ids, attention_mask=src_ids != PAD_ID, decoder_input_ids=tgt_in_ids).logits
    real = tgt_in_ids != PAD_ID
    logits[..., [PAD_ID, BOS_ID]] = torch.finfo(logits.dtype).min  # what tmt's search never emits
    log_probs, hf_log_probs = logits.log_softmax(-1)[real], hf_logits.log_softmax(-1)[real]  # (N, V)
    allowed = torch.ones(log_probs.shape[1], dtype=torch.bool)
    allowed[[PAD_ID, BOS_ID]] = False
    torch.testing.assert_close(hf_log_probs[:, allowed], log_probs[:, allowed], atol=1e-5, rtol=0)
    assert (hf_log_probs[:, ~allowed] < -1000).all()

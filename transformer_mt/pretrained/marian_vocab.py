"""How a Marian (OPUS-MT) vocabulary's ids become tmt's.

tmt fixes PAD, UNK, BOS, EOS at ids 0-3 (`data/tokenization.py`); Marian puts `</s>` at 0, `<unk>`
at 1 and `<pad>` last, and starts decoding from `<pad>`. tmt's ids are Marian's four special roles
first, then every other Marian piece in Marian's order: one more id than Marian has, since BOS
(Marian's decoder start) and PAD are then two ids of one Marian row."""

from __future__ import annotations

from dataclasses import dataclass

from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID, UNK_ID


@dataclass(frozen=True)
class MarianVocab:
    """`rows[t]`: the Marian id whose weights (embedding, output row, logit bias) tmt id `t` takes."""

    rows: tuple[int, ...]
    pad: int
    unk: int
    eos: int

    @classmethod
    def of(cls, size: int, *, pad: int, unk: int, eos: int, decoder_start: int) -> MarianVocab:
        """The order for a Marian vocabulary of `size` ids with these special ids."""
        if len({pad, unk, eos}) != 3 or not all(0 <= i < size for i in (pad, unk, eos, decoder_start)):
            raise ValueError(f"special ids pad={pad} unk={unk} eos={eos} decoder_start={decoder_start} "
                             f"do not fit a vocabulary of {size}")
        special = {PAD_ID: pad, UNK_ID: unk, BOS_ID: decoder_start, EOS_ID: eos}
        rest = [i for i in range(size) if i not in (pad, unk, eos)]
        return cls(tuple(special[t] for t in range(len(special))) + tuple(rest), pad, unk, eos)

    def __len__(self) -> int:
        return len(self.rows)

    def tmt_ids(self) -> list[int]:
        """For each Marian id, the tmt id a tokenizer gives its piece (`<pad>` is PAD, never BOS)."""
        ids = [0] * (len(self.rows) - 1)
        for t, m in enumerate(self.rows):
            if t != BOS_ID or m not in (self.pad, self.unk, self.eos):  # BOS shares a row: PAD keeps the id
                ids[m] = t
        ids[self.pad], ids[self.unk], ids[self.eos] = PAD_ID, UNK_ID, EOS_ID
        return ids

"""Word alignments read off cross-attention: each target word's pieces linked to the source word of
the piece the decoder attended to most, as Pharaoh links (`0-0 1-2`: source word - target word)."""

from __future__ import annotations

from collections.abc import Sequence

# The decoder layer whose attention aligns by default: the second to last, which gave the demo run's
# hand-aligned test pairs the lowest alignment error rate (docs/guides/translating.md#word-alignments).
DEFAULT_LAYER = -2


def alignment_layer(layer: int | None, n_layers: int) -> int:
    """The decoder layer (0 the first) that `layer` names (None: `DEFAULT_LAYER`, or the only one)."""
    return max(DEFAULT_LAYER, -n_layers) % n_layers if layer is None else layer % n_layers


def word_links(weights: Sequence[Sequence[float]], src_words: Sequence[int | None],
               tgt_words: Sequence[int | None]) -> list[tuple[int, int]]:
    """The (source word, target word) links of one sentence, sorted. `weights` (T + 1, S + 1) is
    where the decoder looked for each target piece then EOS; `src_words` and `tgt_words` the word of
    each source and target piece (None: EOS, a tag, spaces). A target piece with a word is linked
    through the source piece with a word that it attended to most; EOS never links."""
    candidates = [s for s, word in enumerate(src_words[:len(weights[0]) - 1]) if word is not None]  # not EOS
    if not candidates:
        return []
    links = set()
    for row, tgt_word in zip(weights, tgt_words):
        if tgt_word is not None:
            links.add((src_words[max(candidates, key=row.__getitem__)], tgt_word))
    return sorted(links)


def pharaoh(links: Sequence[tuple[int, int]]) -> str:
    """Links in Pharaoh format, as fast_align and eflomal write them: `0-0 1-2 2-1`."""
    return " ".join(f"{src}-{tgt}" for src, tgt in links)

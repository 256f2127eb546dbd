"""What one request to `tmt serve` may ask for (`Limits`) and its checks against them: the body's size
as it arrives, then the number of sentences, their characters and tokens, the beam and the n-best list."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_sentences: int
    max_beam: int
    max_tokens: int  # source tokens per sentence (model.max_len - 1: room for its EOS)
    default_beam: int
    max_sentence_characters: int  # more cannot fit in max_tokens tokens: refused before tokenizing
    max_body_bytes: int


# A character of a sentence in a JSON body takes at most 6 bytes (`\u00e8`, as json.dumps escapes it);
# 1 KiB more holds the rest of the request.
JSON_CHARACTER_BYTES, JSON_OVERHEAD_BYTES = 6, 1024


def largest_request_bytes(max_sentences: int, max_sentence_characters: int) -> int:
    """The body of the largest request the other limits take, every character escaped: the default
    body limit, which refuses no request the others take and nothing larger."""
    return max_sentences * max_sentence_characters * JSON_CHARACTER_BYTES + JSON_OVERHEAD_BYTES


def sentence_character_bound(tokenizers, max_tokens: int) -> int:
    """The most characters `max_tokens` source tokens can spell: every character of a sentence, spaces
    included (Metaspace), belongs to one token, of at most the longest token's length (NFC aside)."""
    return max_tokens * max(len(piece) for piece in tokenizers.src.get_vocab(with_added_tokens=True))


class RequestError(Exception):
    """A request the server refuses: its HTTP status and one line saying why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def read_body(request, limit: int) -> bytes:
    """The request's body, refused (413) as soon as it is known to pass `limit` bytes: by its announced
    length before any of it is read, else while it arrives (uvicorn discards what follows)."""
    announced = request.headers.get("content-length")
    if announced is not None and announced.isdigit() and int(announced) > limit:
        raise RequestError(413, f"the request body is {int(announced):,} bytes; this server takes at most "
                                f"{limit:,} (tmt serve --max-body-bytes)")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise RequestError(413, f"the request body is more than {limit:,} bytes; this server takes at most "
                                    f"{limit:,} (tmt serve --max-body-bytes)")
        parts.append(part)
    return b"".join(parts)


def check_request(asked, translator, limits: Limits):
    """The request's decoding `Options` and source tokens, or a `RequestError` naming what is too much.
    A sentence longer than `limits.max_sentence_characters` is refused before it is tokenized."""
    from transformer_mt.serve.batcher import Options

    if len(asked.sentences) > limits.max_sentences:
        raise RequestError(413, f"sentences: {len(asked.sentences)} sentences; this server takes at most "
                                f"{limits.max_sentences} a request (tmt serve --max-sentences)")
    beam = limits.default_beam if asked.beam_size is None else asked.beam_size
    if beam > limits.max_beam:
        raise RequestError(422, f"beam_size: {beam} is above this server's largest, {limits.max_beam} "
                                "(tmt serve --max-beam)")
    if asked.n_best > beam:
        raise RequestError(422, f"n_best: {asked.n_best} is more than beam search keeps with beam_size {beam}; "
                                f"ask for beam_size {asked.n_best} or more")
    for number, sentence in enumerate(asked.sentences):
        try:
            sentence.encode("utf-8")
        except UnicodeEncodeError as err:
            raise RequestError(422, f"sentences[{number}]: not text (a lone surrogate "
                                    f"\\u{ord(sentence[err.start]):04x})") from None
    sentences = [sentence.strip() for sentence in asked.sentences]
    for number, sentence in enumerate(sentences):
        if len(sentence) > limits.max_sentence_characters:
            longest = limits.max_sentence_characters // limits.max_tokens
            raise RequestError(413, f"sentences[{number}]: {len(sentence):,} characters; this model translates at "
                                    f"most {limits.max_sentence_characters:,} (model.max_len - 1 tokens of at most "
                                    f"{longest} characters)")
    from transformer_mt.core.errors import UsageError

    try:  # a multilingual model's tag counts as a token
        lengths = [len(ids) for ids in translator.source_ids(sentences, asked.target_lang, "target_lang")]
    except UsageError as err:  # an unknown or missing target language
        raise RequestError(422, str(err)) from None
    for number, length in enumerate(lengths):
        if length > limits.max_tokens:
            raise RequestError(413, f"sentences[{number}]: {length} tokens; this model translates at most "
                                    f"{limits.max_tokens} (model.max_len - 1)")
    options = Options(beam, asked.n_best, asked.scores or asked.n_best > 1, asked.target_lang, asked.alignments)
    return options, sum(lengths) + len(lengths)  # each with its EOS

"""What one request to `tmt serve` may ask for (`Limits`) and its checks against them: the body's size
as it arrives, then the number of sentences, their characters and tokens (and their prefixes' and
constraints'), the beam and the n-best list."""

from __future__ import annotations

from dataclasses import dataclass

from transformer_mt.core.errors import UsageError


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_sentences: int
    max_beam: int
    max_tokens: int  # source tokens per sentence (model.max_len - 1: room for its EOS)
    default_beam: int
    max_sentence_characters: int  # more cannot fit in max_tokens tokens: refused before tokenizing
    max_body_bytes: int
    max_prefix_characters: int  # as max_sentence_characters, in target tokens; also a sentence's constraints'


# A character of a sentence in a JSON body takes at most 6 bytes (`\u00e8`, as json.dumps escapes it);
# a sentence with a prefix, `{"source": "", "prefix": ""}, ` around them, 30 more; its constraints
# `, "constraints": []` 19 more and `"", ` 4 a term; 1 KiB more holds the rest of the request.
JSON_CHARACTER_BYTES, JSON_SENTENCE_BYTES, JSON_OVERHEAD_BYTES = 6, 30, 1024
JSON_CONSTRAINTS_BYTES, JSON_TERM_BYTES = 19, 4


def largest_request_bytes(max_sentences: int, max_sentence_characters: int, max_prefix_characters: int,
                          max_terms: int = 0) -> int:
    """The body of the largest request the other limits take, every character escaped, every sentence
    with a prefix and (`max_terms` > 0) that many constraints: the default body limit, which refuses no
    request the others take and nothing larger."""
    sentence = (max_sentence_characters + max_prefix_characters) * JSON_CHARACTER_BYTES + JSON_SENTENCE_BYTES
    if max_terms:
        sentence += (max_prefix_characters * JSON_CHARACTER_BYTES + JSON_CONSTRAINTS_BYTES
                     + max_terms * JSON_TERM_BYTES)
    return max_sentences * sentence + JSON_OVERHEAD_BYTES


def character_bound(tokenizer, max_tokens: int) -> int:
    """The most characters `max_tokens` tokens of `tokenizer` can spell: every character of a sentence,
    spaces included (Metaspace), belongs to one token, of at most the longest token's length (NFC aside)."""
    return max_tokens * max(len(piece) for piece in tokenizer.get_vocab(with_added_tokens=True))


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


def check_request(asked, translator, limits: Limits, glossary=None):
    """The request's decoding `Options`, its sentences, their prefixes ("" none), the terms each
    translation must contain (`glossary`'s matches, then the sentence's own `constraints`; None:
    none) and their source tokens, or a `RequestError` naming what is too much. A sentence (a prefix,
    a sentence's constraints together) longer than `limits.max_sentence_characters`
    (`max_prefix_characters`) is refused before it is tokenized; a prefix must leave room under its
    sentence's length cap (`Translator.prefix_problem`), and so must the terms
    (`Translator.terms_problem`), which need beam search on the torch engine (`constraints_problem`)."""
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
    items = [(item, "", []) if isinstance(item, str) else (item.source, item.prefix, item.constraints)
             for item in asked.sentences]
    sentences = _texts([source for source, _, _ in items], "sentences[{}]", limits.max_sentence_characters, limits)
    prefixes = _texts([prefix for _, prefix, _ in items], "sentences[{}].prefix", limits.max_prefix_characters,
                      limits)
    own = [_texts(terms, f"sentences[{number}].constraints[{{}}]", limits.max_prefix_characters, limits)
           for number, (_, _, terms) in enumerate(items)]
    for number, terms in enumerate(own):
        _texts(["".join(terms)], f"sentences[{number}].constraints", limits.max_prefix_characters, limits)
    constraints = [(glossary.targets(sentence) if glossary else []) + terms for sentence, terms in zip(sentences, own)]
    try:  # a multilingual model's tag counts as a token
        src_ids = translator.source_ids(sentences, asked.target_lang, "target_lang")
    except UsageError as err:  # an unknown or missing target language
        raise RequestError(422, str(err)) from None
    for number, ids in enumerate(src_ids):
        if len(ids) > limits.max_tokens:
            raise RequestError(413, f"sentences[{number}]: {len(ids)} tokens; this model translates at most "
                                    f"{limits.max_tokens} (model.max_len - 1)")
    prefix_ids = translator.tokenizers.encode_tgt(prefixes) if any(prefixes) else [[] for _ in prefixes]
    if any(prefixes):
        for number, (ids, prefix) in enumerate(zip(src_ids, prefix_ids)):
            if problem := translator.prefix_problem(ids, prefix):
                raise RequestError(413, f"sentences[{number}].prefix: {problem}")
    if any(constraints):
        if problem := translator.constraints_problem(beam):
            raise RequestError(422, f"sentences[{next(i for i, c in enumerate(constraints) if c)}].constraints: "
                                    f"{problem}")
        for number, (text, ids, prefix, terms) in enumerate(zip(sentences, src_ids, prefix_ids, constraints)):
            if text and (problem := translator.terms_problem(ids, prefix, terms, beam)):
                raise RequestError(422, f"sentences[{number}].constraints: {problem}")
    options = Options(beam, asked.n_best, asked.scores or asked.n_best > 1, asked.target_lang, asked.alignments)
    return (options, sentences, prefixes, constraints if any(constraints) else None,
            sum(map(len, src_ids)) + len(src_ids))  # each with its EOS


def _texts(texts: list[str], where: str, max_characters: int, limits: Limits) -> list[str]:
    """`texts` stripped, or a `RequestError` at `where` (formatted with the index) for one that is
    not text or has more than `max_characters` characters (`max_tokens` tokens of the longest)."""
    for number, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise RequestError(422, f"{where.format(number)}: not text (a lone surrogate "
                                    f"\\u{ord(text[err.start]):04x})") from None
    stripped = [text.strip() for text in texts]
    for number, text in enumerate(stripped):
        if len(text) > max_characters:
            raise RequestError(413, f"{where.format(number)}: {len(text):,} characters; this model translates at "
                                    f"most {max_characters:,} (model.max_len - 1 tokens of at most "
                                    f"{max_characters // limits.max_tokens} characters)")
    return stripped

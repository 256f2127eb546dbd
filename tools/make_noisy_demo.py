"""Make transformer_mt/corpora/noisy_en_it: the demo corpus with the noise of a web corpus added, for the
data guide's "Cleaning a web corpus" and the tests of `data.filters`.

    python tools/make_noisy_demo.py            # writes transformer_mt/corpora/noisy_en_it

Its training split is the demo's 640 pairs, then (seeded, in random places) exact and near repeats,
untranslated and nearly untranslated targets, targets in another language, pairs whose target holds
several sentences, markup and URL-only lines, numbers that differ, broken characters and overlong
pairs. Validation and test are the demo's, clean.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "transformer_mt" / "corpora" / "demo_en_it"
OUT = DEMO.parent / "noisy_en_it"
# Targets in the wrong language (misaligned or untranslated crawl output).
FOREIGN = [
    "Ich habe heute keine Zeit, weil ich arbeiten muss.", "Wir fahren morgen mit dem Zug nach Berlin.",
    "Das Wetter ist heute sehr schön und warm.", "Meine Schwester wohnt seit drei Jahren in Hamburg.",
    "Kannst du mir bitte das Salz geben?", "Der Hund schläft den ganzen Tag im Garten.",
    "Je voudrais réserver une table pour ce soir.", "Nous avons visité le musée avec nos enfants.",
    "Il fait très froid dans cette maison en hiver.", "Elle lit toujours le journal le matin.",
    "Où se trouve la gare la plus proche, s'il vous plaît ?", "Mon frère travaille dans une grande banque.",
    "Mañana vamos a la playa con nuestros amigos.", "¿Dónde está la biblioteca de la universidad?",
    "Mi madre cocina muy bien los domingos.", "Los niños juegan en el parque después de la escuela.",
    "Eu gosto muito de ler livros à noite.", "A minha cidade fica perto do mar.",
]
URLS = ["https://www.example.com/it/contatti", "www.example.org", "info@example.com", "http://example.net/page?id=7"]


def noisy_pairs(pairs: list[tuple[str, str]], rng: random.Random) -> list[tuple[str, str]]:
    """`pairs` with each kind of noise added at random places."""
    noise = []
    noise += [rng.choice(pairs) for _ in range(40)]  # exact repeats
    for src, tgt in rng.sample(pairs, 20):  # repeats that differ in case, spaces or punctuation
        noise.append((src.upper() if len(src) < 30 else "  " + src.rstrip(".!?"), tgt.lower() + " "))
    for src, _ in rng.sample(pairs, 15):  # untranslated: the source again
        noise.append((src, src))
    for src, _ in rng.sample(pairs, 8):  # nearly untranslated: one word changed
        words = src.split()
        words[-1] = "ciao" + words[-1][-1] if not words[-1][-1].isalnum() else "ciao"
        noise.append((src, " ".join(words)))
    noise += [(src, rng.choice(FOREIGN)) for src, _ in rng.sample(pairs, len(FOREIGN))]  # another language
    for _ in range(12):  # a target of several sentences: misaligned paragraphs
        src = rng.choice(pairs)[0]
        noise.append((src, " ".join(tgt for _, tgt in rng.sample(pairs, 4))))
    for src, tgt in rng.sample(pairs, 10):  # markup
        noise.append(rng.choice([(f"<p>{src}</p>", f"<p>{tgt}</p>"), (src, f"{tgt}&nbsp;"),
                                 (f'<a href="/x">{src}</a>', tgt), (f"{src}<br/>", f"{tgt}<br/>")]))
    noise += [(url, url) if i % 2 else (url, rng.choice(pairs)[1]) for i, url in enumerate(URLS)]
    changed = [(src, tgt) for src, tgt in pairs if any(c.isdigit() for c in src) and any(c.isdigit() for c in tgt)]
    for src, tgt in rng.sample(changed, min(8, len(changed))):  # a number that differs
        noise.append((src, "".join(str((int(c) + 1) % 10) if c.isdigit() else c for c in tgt)))
    for i, (src, tgt) in enumerate(rng.sample(pairs, 8)):  # broken characters: a decoding error, a control one
        noise.append((src, re.sub("[àèéìòù]", "\ufffd", tgt) + " \ufffd") if i % 2 else (src + "\x07", tgt))
    for _ in range(4):  # overlong: a page of text on both sides
        sample = rng.sample(pairs, 40)
        noise.append((" ".join(src for src, _ in sample), " ".join(tgt for _, tgt in sample)))
    out = list(pairs)
    for pair in noise:
        out.insert(rng.randrange(len(out) + 1), pair)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    src = (DEMO / "train.en").read_text(encoding="utf-8").splitlines()
    tgt = (DEMO / "train.it").read_text(encoding="utf-8").splitlines()
    pairs = noisy_pairs(list(zip(src, tgt)), random.Random(args.seed))
    args.out.mkdir(parents=True, exist_ok=True)
    for lang, side in (("en", 0), ("it", 1)):
        (args.out / f"train.{lang}").write_text("".join(pair[side] + "\n" for pair in pairs), encoding="utf-8")
        for split in ("valid", "test"):
            shutil.copyfile(DEMO / f"{split}.{lang}", args.out / f"{split}.{lang}")
    print(f"{len(pairs)} training pairs ({len(pairs) - len(src)} noisy) in {args.out}")


if __name__ == "__main__":
    main()

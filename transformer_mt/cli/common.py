"""What the commands that translate with a run share (translate, evaluate, score, serve): the run the
options name, loading its `Translator`, outputs checked before a model loads and written atomically
after, and paths as messages show them."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from transformer_mt.core.errors import UsageError
from transformer_mt.core.files import check_parent_dir
from transformer_mt.core.run_layout import RunDir, latest_run


def load_translator(args: argparse.Namespace, constrained: bool = False):
    """The run's (or checkpoint's, or newest run's) `Translator` on --engine, else the run's
    decode.engine; --show-attention draws from the torch engine's model, which auto then picks; so do
    `constrained` translations (a glossary's terms), which CTranslate2 cannot make (said on stderr)."""
    from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID
    from transformer_mt.decode.translator import Translator, pick_engine
    from transformer_mt.runs.summary import training_now

    run_dir = run_dir_of(args)
    engine = args.engine
    if getattr(args, "show_attention", None):
        if engine == "ctranslate2":
            raise UsageError("--show-attention draws from the torch engine's model; leave out --engine ctranslate2")
        engine = "torch"
    if constrained and engine != "torch":
        if engine == "ctranslate2":
            raise UsageError("--engine ctranslate2 cannot force a glossary's terms (CTranslate2 has no lexical "
                             "constraints): leave out --engine, or use --engine torch")
        if pick_engine("auto", args.device) == "ctranslate2":
            print("tmt: translating with the torch engine: CTranslate2 cannot force a glossary's terms",
                  file=sys.stderr)
        engine = "torch"
    translator = Translator.from_run(run_dir, checkpoint=args.checkpoint, device=args.device, engine=engine)
    data = translator.cfg.data
    using = f"{shown(run_dir)} ({data.src_lang}->{data.tgt_lang}, {translator.checkpoint.name}"
    if (training := training_now(run_dir)) is not None:  # a better model is coming: say so, run given or not
        step, max_steps = training.get("step"), training.get("max_steps")
        at = f", at step {step} of {max_steps}" if isinstance(step, int) and isinstance(max_steps, int) else ""
        using += f" of step {translator.step}; still training{at}"
    if not (args.run or args.checkpoint):  # say which run answers: it may be of another language pair
        print(f"tmt: using {using}), the most recently updated run under runs/; choose another with --run DIR "
              "(`tmt runs` lists them)", file=sys.stderr)
    elif training is not None:
        print(f"tmt: using {using})", file=sys.stderr)
    chosen = {"length_penalty": args.length_penalty, "quantize": args.quantize, "target_lang": args.target_lang}
    translator.set_decoding(**{key: value for key, value in chosen.items() if value is not None})
    # A beam wider than the target tokens a hypothesis can continue with (all but PAD, BOS and EOS)
    # could not be filled at the first step, and a huge one runs out of memory.
    size = args.beam or translator.cfg.decode.beam_size
    vocabulary = translator.tokenizers.tgt.get_vocab_size()
    most = vocabulary - len((PAD_ID, BOS_ID, EOS_ID))
    if size > most:
        where = f"--beam {size}" if args.beam else f"the run's decode.beam_size={size} (choose another with --beam)"
        raise UsageError(f"{where}: beam search keeps at most {most} hypotheses with this run's target vocabulary "
                         f"of {vocabulary} tokens (all but PAD, BOS and EOS)")
    return translator


def shown(path: Path) -> str:
    """`path` as messages show it: relative to the working folder when it lies under it (as the
    paths users type), else absolute; the same file reads the same however it was reached."""
    absolute = Path(os.path.abspath(path))
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


def check_output(path: Path | None, option: str = "--output", inputs: dict[str, Path | None] | None = None) -> None:
    """Refuse, before translating rather than after, an output that cannot be a file or that is
    one of the command's `inputs` (option -> path): writing it would destroy what was read, or
    that lies under a file (`in.txt/out.txt`). Creates nothing: the writer makes the folder."""
    if path is None:
        return
    if path.is_dir():
        raise UsageError(f"{option} {path} is a directory; give a file name")
    for name, source in (inputs or {}).items():
        if source is not None and path.exists() and source.exists() and os.path.samefile(path, source):
            raise UsageError(f"{option} {path} is the {name} file; writing it would destroy the input")
    check_parent_dir(path, option)


def run_dir_of(args: argparse.Namespace) -> Path:
    """The run --run or --checkpoint names, else the most recently updated run under ./runs."""
    if args.checkpoint:
        if args.checkpoint.resolve().parent.name != RunDir.CHECKPOINTS:
            raise UsageError(f"--checkpoint {args.checkpoint}: give a checkpoint inside a run's checkpoints/ "
                             "folder (the run's tokenizers and config are found from there)")
        return args.checkpoint.resolve().parent.parent  # <run>/checkpoints/<file>.pt
    return args.run or latest_run(Path("runs"))


def check_not_kept(path: Path | None, option: str, run_dir: Path) -> None:
    """Refuse an output that would replace a file the run keeps (`RunDir.keeps`): a checkpoint,
    its tokenizers or config written over would leave the run unusable."""
    if path is not None and RunDir(run_dir).keeps(path):
        raise UsageError(f"{option} {path} is part of the run {run_dir} (its checkpoints, tokenizers, config, caches "
                         "or records); writing it would break the run: give a file outside them")

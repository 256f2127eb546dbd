"""What several test files build: tiny configs, corpora, models and runs, and the ways they read a run."""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from transformer_mt.cli import main as cli
from transformer_mt.config.loading import config_from_dict, save_config
from transformer_mt.config.schema import Config, ModelConfig, config_to_dict
from transformer_mt.core.errors import TrainingStopped
from transformer_mt.data.batching import pad_sequences
from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID, TokenizerPair, train_tokenizers
from transformer_mt.model.transformer import Transformer
from transformer_mt.runs.checkpoint import checkpoint_state, save_atomic
from transformer_mt.runs.run_dir import prepare_run_dir
from transformer_mt.train.trainer import Trainer, train

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
# For subprocesses: this checkout first (not an installed copy), then the caller's own path
# (on the GPU machine, the wheels carried for packages its image lacks).
PYTHONPATH = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])

# A tiny parallel corpus the tests can overfit: short, repetitive, with accents and apostrophes.
TINY_PAIRS = [
    ("Good morning.", "Buongiorno."),
    ("Good evening.", "Buonasera."),
    ("Thank you very much.", "Grazie mille."),
    ("Where is the station?", "Dov'è la stazione?"),
    ("The coffee is hot.", "Il caffè è caldo."),
    ("The city is beautiful.", "La città è bella."),
    ("I am tired.", "Sono stanco."),
    ("Why are you here?", "Perché sei qui?"),
    ("We eat bread.", "Mangiamo il pane."),
    ("She reads a book.", "Lei legge un libro."),
    ("He drinks water.", "Lui beve acqua."),
    ("The man is tall.", "L'uomo è alto."),
]
SOURCES = [src for src, _ in TINY_PAIRS]
TARGETS = [tgt for _, tgt in TINY_PAIRS]

# The special ids of the models built without tokenizers below.
PAD, BOS, EOS = 0, 2, 3
TINY_V, RANDOM_V = 30, 40  # tiny_model's and random_model's vocabularies


# --- configs, corpora and the CLI --------------------------------------------------------------

def write_corpus(directory: Path, pairs: dict[str, list[tuple[str, str]]], src: str = "en", tgt: str = "it") -> Path:
    """Write aligned `{split}.{lang}` files for each split and return the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, split_pairs in pairs.items():
        (directory / f"{split}.{src}").write_text("".join(s + "\n" for s, _ in split_pairs), encoding="utf-8")
        (directory / f"{split}.{tgt}").write_text("".join(t + "\n" for _, t in split_pairs), encoding="utf-8")
    return directory


def tiny_config(data_dir: Path, **sections) -> Config:
    """A tiny seeded model config (d_model=16 unless overridden) over a local corpus."""
    raw = {
        "name": "tiny",
        "seed": 3,
        "data": {"format": "text", "path": str(data_dir), "valid_size": 2, "test_size": 2},
        "tokenizer": {"vocab_size": 200, "min_frequency": 1},
        "model": {"d_model": 16, "n_heads": 2, "n_layers": 2, "d_ff": 32, "dropout": 0.1, "max_len": 64},
        "train": {"max_steps": 6, "batch_tokens": 64, "lr": 1e-3, "warmup_steps": 2, "log_every_steps": 1,
                  "eval_every_steps": 3, "save_every_steps": 3, "eval_max_sentences": 0, "precision": "fp32",
                  "device": "cpu", "attention_figures": False},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values} if isinstance(values, dict) else values
    return config_from_dict(raw)


def run_cli(args: list[str], monkeypatch, capsys, cwd: Path, stdin: bytes | None = None) -> tuple[int, str, str]:
    """Run `tmt ARGS` in-process (what the console script calls) in `cwd`: (exit code, stdout, stderr)."""
    monkeypatch.chdir(cwd)
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        code = cli.main(args)
    finally:  # cli.main logs to this test's captured stderr, which is closed after the test
        root.handlers = handlers
        root.setLevel(level)  # not `root.level =`: that keeps the loggers' cached INFO-enabled answers
    out, err = capsys.readouterr()
    return code, out, err


def tmt(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run `python -m transformer_mt ARGS` in a subprocess with a bare environment, as a user would."""
    return subprocess.run([sys.executable, "-m", "transformer_mt", *args], cwd=cwd, input=stdin,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                               "PYTHONPATH": PYTHONPATH})


# --- models without tokenizers -----------------------------------------------------------------

def tiny_model(seed: int = 0, vocab_size: int = TINY_V, **overrides) -> Transformer:
    """A seeded Transformer of d_model 16, 2 heads, 2 layers, in eval mode, over `vocab_size` ids."""
    torch.manual_seed(seed)
    cfg = ModelConfig(**{"d_model": 16, "n_heads": 2, "n_layers": 2, "d_ff": 32, "dropout": 0.0, "max_len": 32,
                         **overrides})
    return Transformer(cfg, vocab_size, vocab_size, PAD).eval()


def random_model(seed: int) -> Transformer:
    """A tiny model whose sentences end at different steps: its output projection is scaled up."""
    model = tiny_model(seed, RANDOM_V, max_len=48)
    with torch.no_grad():  # make EOS likely enough that sentences end at different steps
        model.output_proj.weight.mul_(4.0)
    return model


def random_sources(seed: int, batch: int = 6, max_len: int = 9, min_len: int = 1) -> torch.Tensor:
    """Random source rows for random_model, each ending in EOS, padded to the longest."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len, (batch,), generator=gen).tolist()
    rows = [torch.randint(4, RANDOM_V, (n,), generator=gen).tolist() + [EOS] for n in lengths]
    src = torch.full((batch, max(map(len, rows))), PAD)
    for i, row in enumerate(rows):
        src[i, : len(row)] = torch.tensor(row)
    return src  # (B, S) with padding


def random_prefixes(seed: int, batch: int, max_len: int = 4) -> torch.Tensor:
    """Target prefixes for random_model's sentences: 0 (none) to max_len - 1 tokens each, the first
    sentence with the longest, padded with PAD: (B, max_len - 1) long."""
    gen = torch.Generator().manual_seed(seed + 1000)
    lengths = [max_len - 1] + torch.randint(0, max_len, (batch - 1,), generator=gen).tolist()
    prefixes = torch.full((batch, max_len - 1), PAD)
    for i, n in enumerate(lengths):
        prefixes[i, :n] = torch.randint(4, RANDOM_V, (n,), generator=gen)
    return prefixes


def random_terms(seed: int, batch: int, most: int = 2, longest: int = 3) -> torch.Tensor:
    """Terms for random_model's sentences: sentence b has b % (most + 1) terms of 1 to `longest` tokens,
    (B, most, longest) long padded with PAD."""
    gen = torch.Generator().manual_seed(seed + 2000)
    terms = torch.full((batch, most, longest), PAD)
    for b in range(batch):
        for n in range(b % (most + 1)):
            length = int(torch.randint(1, longest + 1, (1,), generator=gen))
            terms[b, n, :length] = torch.randint(4, RANDOM_V, (length,), generator=gen)
    return terms


def teacher_forced_log_prob(model: Transformer, src: torch.Tensor, ids: list[int], ended: bool) -> float:
    """The log-probability of `ids` (then EOS if `ended`) given src (S,) under the distribution the
    search draws from (PAD and BOS never generated), teacher-forced."""
    tgt = torch.tensor([[BOS] + ids])
    logits = model(src[None], tgt).float()  # (T, V)
    logits[:, PAD] = logits[:, BOS] = torch.finfo(logits.dtype).min
    log_probs = torch.log_softmax(logits, dim=-1)
    targets = ids + [EOS] if ended else ids
    return sum(log_probs[t, token].item() for t, token in enumerate(targets))


def assert_same_hypotheses(got, expected):
    """The same n-best lists, token for token, with the same log-probs and scores up to rounding
    (the reference drops finished sentences' rows, which changes the batch the products see)."""
    assert [[h.ids for h in hyps] for hyps in got] == [[h.ids for h in hyps] for hyps in expected]
    for hyps, reference in zip(got, expected):
        for h, e in zip(hyps, reference):
            assert h.log_prob == pytest.approx(e.log_prob, abs=1e-4)
            assert h.score == pytest.approx(e.score, abs=1e-4)


# --- runs ---------------------------------------------------------------------------------------

def make_trainer(tiny_corpus: Path, run: Path, **train) -> Trainer:
    """A Trainer on a new run over the tiny corpus: dropout 0 (attention runs in SDPA), no clipping, fp32."""
    cfg = tiny_config(tiny_corpus, model={"dropout": 0.0}, train={"clip_grad_norm": 0.0, **train})
    prepare_run_dir(run, resume=False, overwrite=False)
    return Trainer(cfg, run, progress=False)


def train_tiny_run(root: Path, run_dir: Path, **train_options) -> Path:
    """Train a tiny run in `run_dir` over the tiny pairs written to root/corpus; its config saved as root/tiny.yaml."""
    corpus = write_corpus(root / "corpus", {"train": TINY_PAIRS, "valid": TINY_PAIRS[:4], "test": TINY_PAIRS[4:6]})
    cfg = tiny_config(corpus, train=train_options)
    save_config(cfg, root / "tiny.yaml")
    prepare_run_dir(run_dir, resume=False, overwrite=False)
    train(cfg, run_dir, progress=False)
    return run_dir


def encode_pairs(tokenizers: TokenizerPair) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded (source + EOS, BOS + target, target + EOS) ids of the tiny pairs."""
    src = tokenizers.encode_src(SOURCES)
    tgt = tokenizers.encode_tgt(TARGETS)
    return (pad_sequences([ids + [EOS_ID] for ids in src], PAD_ID),
            pad_sequences([[BOS_ID] + ids for ids in tgt], PAD_ID),
            pad_sequences([ids + [EOS_ID] for ids in tgt], PAD_ID))


def make_run(run_dir: Path, norm: str, share: bool, **model) -> tuple[Transformer, TokenizerPair]:
    """A run directory (tokenizers + best.pt) holding a briefly trained tiny model.

    20 teacher-forced steps: enough that greedy outputs differ and some end with EOS before
    the cap, too few to learn every pair, so others run to the cap. Biases and LayerNorm
    parameters are perturbed first, so a misplaced one would change the outputs.
    """
    cfg = tiny_config(run_dir, tokenizer={"joint": share},
                      model={"norm": norm, "share_embeddings": share, "tie_output": share, "dropout": 0.0, **model})
    run_dir.mkdir(parents=True)
    tokenizers = train_tokenizers(cfg.tokenizer, SOURCES, TARGETS)
    tokenizers.save(run_dir)
    torch.manual_seed(0)
    model = Transformer(cfg.model, tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size(), PAD_ID)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.2 * torch.randn_like(param))
    src_ids, tgt_in_ids, tgt_out_ids = encode_pairs(tokenizers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(20):
        logits = model(src_ids, tgt_in_ids, pack=False)  # (B·T, V)
        loss = F.cross_entropy(logits, tgt_out_ids.flatten(), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    state = checkpoint_state(model.state_dict(), config_to_dict(cfg),
                             {"src_vocab_size": tokenizers.src.get_vocab_size(),
                              "tgt_vocab_size": tokenizers.tgt.get_vocab_size(), "pad_id": PAD_ID})
    (run_dir / "checkpoints").mkdir()
    save_atomic(state, run_dir / "checkpoints" / "best.pt")
    return model, tokenizers


def stop_at_first_validation(cfg, run_dir: Path, monkeypatch) -> None:
    """Train a new run in `run_dir` until SIGTERM arrives during its first validation: it saves a
    checkpoint at that step and stops, as under a scheduler's notice."""
    validate = Trainer.validate

    def signalled(self, writer):
        os.kill(os.getpid(), signal.SIGTERM)
        return validate(self, writer)

    prepare_run_dir(run_dir, resume=False, overwrite=False)
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "validate", signalled)
        with pytest.raises(TrainingStopped):
            train(cfg, run_dir, progress=False)


def read_scalars(run_dir: Path, tag: str) -> dict[int, float]:
    """The run's values of `tag` by step, as TensorBoard shows them after every resume.

    TensorBoard reads a folder's event files in name order, as text: `...<seconds>.<host>.<pid>.
    <counter>`. A run's own starts are separate processes, seconds apart; the starts of one test
    (in one process, or forked from one) can share a second and a counter, and an older file read
    after a newer one purges the newer one's steps. Here the files are read in the order they were
    written: by the time of their first event.
    """
    from tensorboard.compat.proto.event_pb2 import Event

    def written(path: Path) -> float:
        with open(path, "rb") as events:
            length = int.from_bytes(events.read(8), "little")  # a TFRecord: length, its CRC, the record
            events.read(4)
            return Event.FromString(events.read(length)).wall_time

    files = sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"), key=written)
    with tempfile.TemporaryDirectory() as ordered:
        for number, path in enumerate(files):
            shutil.copyfile(path, Path(ordered) / f"events.out.tfevents.{number:06d}")
        events = EventAccumulator(ordered)
        events.Reload()
        return {event.step: event.value for event in events.Scalars(tag)}


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder `name` that `build(folder)` fills once for the whole test session: the xdist workers
    share it (the first builds under a file lock, the others wait for it), so a slow fixture is not
    built again in each worker. Read-only to tests: a test that writes takes a copy."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    folder, done = root / name, root / f"{name}.built"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder

# --- processes of their own, started in a moment ---------------------------------------------

# No bytecode written: under a file-size limit Python would leave truncated .pyc files behind.
LIMITED_ENV = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": PYTHONPATH,
               "PYTHONDONTWRITEBYTECODE": "1"}


def forked(function, *, cwd: Path, env: dict[str, str] = LIMITED_ENV, limit: int | None = None,
           namespace: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    """`function()` in a child forked from this test process, its return value (or `sys.exit`'s; None:
    0) the exit code: a process of its own (its exit code or killing signal, limits, mounts, nothing it changes
    reaches this one), without the seconds a fresh interpreter takes to import torch, tmt and their
    libraries (imported here first). Its stdin is empty; stdout and stderr are returned as text.
    `limit`: files may not grow past `limit` bytes (`size_limited`); `namespace`: it runs as root in user
    and mount namespaces of its own (as `unshare -rm`), where `mount_tmpfs` mounts. What a fresh
    interpreter does itself (imports, start-up, the console script) is tested with `tmt` instead."""
    importlib.import_module("torch._dynamo")  # what an optimizer imports: imported once, here

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(out_r)
        os.close(err_r)
        _run_child(function, cwd, env, limit, namespace, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    try:
        out, err = _read_until_closed(out_r, err_r, deadline=time.monotonic() + timeout)
    except subprocess.TimeoutExpired:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise subprocess.TimeoutExpired(getattr(function, "__name__", "forked"), timeout) from None
    _, status = os.waitpid(pid, 0)
    return subprocess.CompletedProcess([getattr(function, "__name__", "forked")], os.waitstatus_to_exitcode(status),
                                       out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def _read_until_closed(*fds: int, deadline: float) -> list[bytes]:
    """Everything written to the pipes `fds` until every writer closed them."""
    import selectors

    chunks = {fd: [] for fd in fds}
    with selectors.DefaultSelector() as selector:
        for fd in fds:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            ready = selector.select(timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                for fd in fds:
                    os.close(fd)
                raise subprocess.TimeoutExpired("forked", 0)
            for key, _ in ready:
                data = os.read(key.fd, 65536)
                if data:
                    chunks[key.fd].append(data)
                else:
                    selector.unregister(key.fd)
                    os.close(key.fd)
    return [b"".join(chunks[fd]) for fd in fds]


def _run_child(function, cwd: Path, env: dict[str, str], limit: int | None, namespace: bool, out_w: int,
               err_w: int) -> None:
    """The forked child: made to look like a fresh process (standard streams on the pipes, default
    signals, the given environment, no logging handlers, none of the parent's exit handlers), then
    `function()`; it ends with os._exit, so nothing of the test process runs twice."""
    import atexit

    code = 70
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)
        sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1,
                                           closefd=False)
        atexit._clear()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGXFSZ, signal.SIGALRM):
            signal.signal(sig, signal.SIG_DFL)
        logging.root.handlers.clear()
        logging.root.setLevel(logging.WARNING)
        logging.Logger.manager._clear_cache()
        os.environ.clear()
        os.environ.update(env)
        if env.get("OMP_NUM_THREADS", "").isdigit():  # what a fresh process's torch reads at start
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        sys.dont_write_bytecode = True
        os.chdir(cwd)
        if namespace:
            _enter_namespaces()
        if limit is not None:
            size_limited(limit)()
        result = function()
        code = 0 if result is None else result
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code if isinstance(code, int) else 70)


def _libc_call(name: str, *args) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{name}: {os.strerror(number)}")


def _enter_namespaces() -> None:
    """Root in new user and mount namespaces, mounts private (what `unshare -rm` does)."""
    uid, gid = os.getuid(), os.getgid()
    _libc_call("unshare", 0x10000000 | 0x00020000)  # CLONE_NEWUSER | CLONE_NEWNS
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
    Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    _libc_call("mount", b"none", b"/", None, 1 << 14 | 1 << 18, None)  # MS_REC | MS_PRIVATE


def mount_tmpfs(folder: Path, size: str, fill: bool = False) -> None:
    """A tmpfs of `size` (e.g. "64k") at `folder`, in a child `forked` with `namespace`; `fill`: filled up
    by a file named `filler`."""
    folder.mkdir(exist_ok=True)
    _libc_call("mount", b"tmpfs", str(folder).encode(), b"tmpfs", 0, f"size={size}".encode())
    if fill:
        with open(folder / "filler", "wb", buffering=0) as filler:
            with contextlib.suppress(OSError):  # no space left
                while True:
                    filler.write(bytes(4096))


def run_tmt(*args: str) -> int:
    """`tmt ARGS` as the console script runs it, in this process (for `forked`): its exit code."""
    sys.argv = ["tmt", *args]
    try:
        cli.run()
    except SystemExit as stop:
        return stop.code
    return 0


def size_limited(limit: int):
    """A `preexec_fn`: files may not grow past `limit` bytes, and a write past it fails with EFBIG
    (SIGXFSZ ignored) instead of killing the process."""
    def limit_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return limit_files


def tmt_limited(*args: str, cwd: Path, limit: int) -> subprocess.CompletedProcess:
    """`tmt ARGS` as a user runs it under `ulimit -f` (in bytes), in a forked process."""
    return forked(lambda: run_tmt(*args), cwd=cwd, limit=limit)


def can_mount_a_small_filesystem() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                          capture_output=True).returncode == 0

"""Reading a tmt checkpoint without torch: the weights to translate with as numpy arrays.

`import torch` alone takes over a second, twice what `tmt translate "one sentence"` may take on
a CPU (docs/benchmarks.md); the numpy engine (`numpy_translator`) reads its checkpoint here.
`torch.save` writes a zip archive: `<prefix>/data.pkl`, a pickle whose tensors are
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` calls over persistent ids
`("storage", StorageType, key, location, numel)`, and each storage's raw little-endian bytes in
`<prefix>/data/<key>`. A restricted unpickler rebuilds the dict with lazy tensors, and only the
storages of the chosen weights are read (not the optimizer's). Anything this reader does not
know (another format, an unknown class or dtype, an old format version) raises
`UnsupportedCheckpoint`, and the caller goes back to `checkpoint.load_checkpoint`, whose
checks and messages stay the reference. tests/test_numpy_translation.py holds every array equal
to `torch.load`'s, bit for bit.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from transformer_mt.errors import CheckpointError

# 2: `nn.Linear` weights (out, in) named `weight`. 1: the same matrices stored (in, out) as `kernel`.
FORMAT_VERSION = 2
REQUIRED_KEYS = ("model", "config", "model_args", "format_version")

# torch's storage classes (as `torch.save` names them) and the numpy dtype of their bytes.
_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": np.uint16,  # widened to float32 when read (`_LazyTensor.array`)
    "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8,
    "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class UnsupportedCheckpoint(Exception):
    """This reader cannot read the file; `checkpoint.load_checkpoint` (torch) is to read it instead,
    and say what is wrong with it if anything is."""


def translation_weights(state: dict) -> tuple[dict, str]:
    """The weights to translate with from a loaded checkpoint, and which they are: its EMA's
    (`"ema"`, `train.ema_decay`) when it has them, else its trained weights (`"model"`)."""
    ema = state.get("ema")
    if ema:
        return ema["model"], "ema"
    return state["model"], "model"


def check_tokenizers(state: dict, fingerprint: str, path: Path, run_dir: Path) -> None:
    """Refuse a checkpoint trained with other tokenizers than the run's (`TokenizerPair.fingerprint`),
    say one copied from another run: its ids would mean other pieces, and its translations be
    garbage. Checkpoints from before the fingerprint was saved pass."""
    saved = state.get("tokenizers")
    if saved is not None and saved != fingerprint:
        raise CheckpointError(f"{path} was trained with other tokenizers than those of {run_dir} (a checkpoint of "
                              "another run?); use it with its own run directory")


def check_vocabulary(model_args: dict, src_size: int, tgt_size: int, run_dir: Path) -> None:
    """Refuse tokenizers whose vocabulary sizes (`src_size`, `tgt_size`) are not the checkpoint's."""
    if src_size != model_args["src_vocab_size"] or tgt_size != model_args["tgt_vocab_size"]:
        raise CheckpointError(f"{run_dir}: the tokenizer files do not match the checkpoint's vocabulary sizes")


@dataclass(frozen=True)
class TranslationState:
    """What translating needs of a checkpoint: its saved config, model arguments, tokenizer
    fingerprint (None in checkpoints older than it), step, and the chosen weights as float32."""

    config: dict
    model_args: dict
    tokenizers: str | None
    step: int
    which: str  # "ema" or "model", as `translation_weights` says
    weights: dict[str, np.ndarray]


def read_translation_state(path: Path) -> TranslationState:
    """The translation weights and settings of the checkpoint `path`, chosen as
    `Translator.from_run` chooses them, read without torch; `UnsupportedCheckpoint` for any
    file that `checkpoint.load_checkpoint` should read (or refuse) instead."""
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as err:  # missing, empty, legacy format, not torch's
        raise UnsupportedCheckpoint(f"not a zip archive ({err})") from None
    with archive:
        reader = _ArchiveReader(archive)
        state = reader.unpickle()
        if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
            raise UnsupportedCheckpoint("not a tmt checkpoint")
        if state["format_version"] != FORMAT_VERSION:
            raise UnsupportedCheckpoint(f"format version {state['format_version']!r}: torch's loader migrates it")
        weights, which = translation_weights(state)
        if not isinstance(weights, dict) or not all(isinstance(t, _LazyTensor) for t in weights.values()):
            raise UnsupportedCheckpoint("the weights are not a dict of tensors")
        arrays = {name: tensor.array(reader) for name, tensor in weights.items()}
    step = state.get("train_state", {}).get("step", -1)
    return TranslationState(state["config"], state["model_args"], state.get("tokenizers"), step, which, arrays)


@dataclass(frozen=True)
class _StorageRef:
    """A storage named by the pickle: its dtype, its file in the archive and its length."""

    dtype: type
    key: str
    numel: int


@dataclass(frozen=True)
class _LazyTensor:
    """A tensor of the pickle, read from its storage only when asked for (`array`)."""

    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def array(self, reader: _ArchiveReader) -> np.ndarray:
        """The tensor as a float32 array of its own (bf16, fp16 and fp64 converted as
        `load_state_dict` copies them into an fp32 model); an integer tensor is refused."""
        data = reader.storage(self.storage)
        itemsize = data.dtype.itemsize
        if any(n < 0 for n in (self.offset, *self.size, *self.stride)) or (
                self.size and min(self.size) > 0
                and self.offset + sum((n - 1) * s for n, s in zip(self.size, self.stride)) >= data.size):
            raise UnsupportedCheckpoint("a tensor lies outside its storage")
        view = np.lib.stride_tricks.as_strided(data[self.offset:], shape=self.size,
                                               strides=tuple(s * itemsize for s in self.stride), writeable=False)
        if self.storage.dtype is np.uint16:  # bf16: the upper half of a float32's bits
            return (view.astype(np.uint32) << 16).view(np.float32)
        if self.storage.dtype not in (np.float32, np.float16, np.float64):
            raise UnsupportedCheckpoint(f"weights of dtype {np.dtype(self.storage.dtype).name}")
        return np.array(view, dtype=np.float32)  # a copy, contiguous


def _rebuild_tensor(storage: _StorageRef, offset: int, size: tuple, stride: tuple, requires_grad: bool = False,
                    hooks: object = None, metadata: object = None) -> _LazyTensor:
    """What the pickle calls as `torch._utils._rebuild_tensor_v2`."""
    if not isinstance(storage, _StorageRef):
        raise UnsupportedCheckpoint("a tensor over something other than a storage")
    return _LazyTensor(storage, int(offset), tuple(map(int, size)), tuple(map(int, stride)))


class _StorageType:
    """What the pickle names as `torch.<X>Storage`: only the dtype it stands for is kept."""

    def __init__(self, dtype: type):
        self.dtype = dtype


class _Unpickler(pickle.Unpickler):
    """The weights-only subset of torch's pickles: plain containers, tensors and their storages;
    anything else (which could run code, or which this reader does not know) is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise UnsupportedCheckpoint(f"the pickle names {module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise UnsupportedCheckpoint(f"unknown persistent id {pid!r:.80}")
        return _StorageRef(pid[1].dtype, str(pid[2]), int(pid[4]))


class _ArchiveReader:
    """The pickle and the storages of one `torch.save` zip archive."""

    def __init__(self, archive: zipfile.ZipFile):
        self.archive = archive
        pickles = [name for name in archive.namelist() if name.endswith("/data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise UnsupportedCheckpoint("no single data.pkl in the archive")
        self.prefix = pickles[0][: -len("data.pkl")]
        byteorder = self._read("byteorder", missing=b"little")
        if byteorder != b"little":
            raise UnsupportedCheckpoint(f"byte order {byteorder!r}")
        self.storages: dict[str, np.ndarray] = {}

    def _read(self, name: str, missing: bytes | None = None) -> bytes:
        try:
            return self.archive.read(self.prefix + name)
        except KeyError:
            if missing is None:
                raise UnsupportedCheckpoint(f"{name} is missing from the archive") from None
            return missing
        except (OSError, zipfile.BadZipFile, EOFError, ValueError) as err:  # truncated or corrupt
            raise UnsupportedCheckpoint(f"{name}: {err}") from None

    def unpickle(self) -> object:
        try:
            return _Unpickler(io.BytesIO(self._read("data.pkl"))).load()
        except UnsupportedCheckpoint:
            raise
        except Exception as err:  # a corrupt pickle raises many types
            raise UnsupportedCheckpoint(f"data.pkl: {type(err).__name__}: {err}") from None

    def storage(self, ref: _StorageRef) -> np.ndarray:
        """The storage's elements, (numel,) of its dtype, read once."""
        if ref.key not in self.storages:
            raw = self._read(f"data/{ref.key}")
            itemsize = np.dtype(ref.dtype).itemsize
            if len(raw) != ref.numel * itemsize:
                raise UnsupportedCheckpoint(f"storage {ref.key}: {len(raw)} bytes for {ref.numel} elements")
            self.storages[ref.key] = np.frombuffer(raw, dtype=np.dtype(ref.dtype).newbyteorder("<"))
        return self.storages[ref.key]


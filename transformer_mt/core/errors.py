"""User-facing errors, each with the exit code the CLI returns (it prints the message, no traceback),
and `Problems`, a config's problems collected for one `ConfigError`."""

import signal


class TmtError(Exception):
    """A failure the user can act on (missing file, bad data, no checkpoint); exit code 1."""

    exit_code = 1


class UsageError(TmtError):
    """Bad command-line arguments or a run directory used the wrong way; exit code 2."""

    exit_code = 2


class ConfigError(UsageError):
    """One or more problems in the configuration, each prefixed by its dotted key; exit code 2."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)  # one: one line, as any other error
        super().__init__("invalid configuration:" + (f" {self.problems[0]}" if len(self.problems) == 1
                                                     else "".join(f"\n  {p}" for p in self.problems)))


class Problems:
    """The problems found in a config, each "dotted.key: what is wrong", in `found`; a check reading
    a key in `defaulted` (unusable, so replaced by its default; "": every key) reports nothing."""

    def __init__(self, defaulted: list[str] | tuple[str, ...] = ()):
        self.found: list[str] = []
        self.defaulted: list[str] = list(defaulted)

    def add(self, problem: str, *also_reads: str) -> None:
        """Report `problem` unless its key, or a key in `also_reads`, was defaulted."""
        keys = [problem.split(":")[0], *also_reads]
        if not any(key == bad or key.startswith(f"{bad}.") or not bad for key in keys for bad in self.defaulted):
            self.found.append(problem)

    def at_least(self, key: str, value: float | None, floor: float, note: str = "") -> bool:
        """Report `key` when `value` is below `floor` (None, an unset optional key, passes); True if it passes."""
        if value is None or value >= floor:
            return True
        self.add(f"{key}: must be at least {floor}{note}, got {value}")
        return False

    def fraction(self, key: str, value: float | None, note: str = "") -> None:
        """Report `key` unless `value` is in [0, 1) or None (unset)."""
        if value is not None and not 0 <= value < 1:
            self.add(f"{key}: must be in [0, 1){note}, got {value}")


class DataError(TmtError):
    """The corpus cannot be read or is unusable (missing file, misaligned lines, no pairs left)."""


class WriteError(TmtError):
    """A file could not be written (a full disk, a file-size limit, a quota, permissions): its name and why."""


class CheckpointError(TmtError):
    """A checkpoint or run directory is missing, corrupt or incompatible."""


class TrainingError(TmtError):
    """Training cannot go on: non-finite losses in a row, or out of memory again; exit code 1."""


class TrainingStopped(TmtError):
    """Training stopped on SIGINT/SIGTERM, as the user asked (not an error); exit code 128 + signal (130 for
    Ctrl-C). Its message starts with `interrupted(signal_number)`."""

    def __init__(self, message: str, signal_number: int):
        super().__init__(message)
        self.exit_code = 128 + signal_number


class Terminated(KeyboardInterrupt):
    """SIGTERM outside the training loop, raised where the program is as Ctrl-C raises
    KeyboardInterrupt; exit code 143."""

    exit_code = 128 + 15


def interrupted(signal_number: int) -> str:
    """How every command says it was stopped: "interrupted" (Ctrl-C), "interrupted by SIGTERM"."""
    return "interrupted" if signal_number == signal.SIGINT else f"interrupted by {signal.Signals(signal_number).name}"


def error_line(err: TmtError) -> str:
    """The line the CLI ends with for `err`: a stop the user asked for is not called an error."""
    return f"tmt: {err}" if isinstance(err, TrainingStopped) else f"tmt: error: {err}"


def missing_from_rank0(path: object) -> DataError:
    """The error of a torchrun rank that does not find what rank 0 prepared for it (`path`)."""
    return DataError(f"{path} is missing: rank 0 prepares the run's data there and the other processes read it; "
                     "on several machines, --run-dir must be on a filesystem they all share")

"""Where telemetry goes: a JSONL file that is always written, W&B, and one fan-out.

Every sink takes whole rows (one ``dict`` per optimizer step, plain values) on log steps.
W&B is imported only when a :class:`WandbSink` starts, and runs offline unless asked.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..config import require_choice
from .experts import EXPERTS_IDLE_IDS

__all__ = [
    "JSONL_NAME",
    "BadLine",
    "FanOut",
    "JsonlSink",
    "Sink",
    "SinkFailures",
    "TelemetryLog",
    "WANDB_MODES",
    "WandbSink",
    "decode_value",
    "encode_value",
    "read_jsonl",
    "read_telemetry",
]

JSONL_NAME = "telemetry.jsonl"
# W&B's modes, as WandbSink (and the CLI's telemetry.wandb) take them.
WANDB_MODES = ("offline", "online", "disabled")


class Sink(Protocol):
    def write(self, rows: Sequence[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def encode_value(value: Any) -> Any:
    """Strict-JSON value: non-finite floats become the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def decode_value(value: Any) -> Any:
    """Inverse of :func:`encode_value`."""
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return value


def _ends_mid_line(path: Path) -> bool:
    """Whether the file's last byte is not a newline (a row cut off by a kill or a full disk)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except OSError:
        return False


class JsonlSink:
    """Appends one JSON object per optimizer step to ``path``; each write reaches the file
    before it returns.

    Append mode: a resumed run continues the same file (the report supersedes the rows a
    resume re-runs), on a new line when the file ends in a torn row. The file is opened on the
    first write, so constructing the sink creates nothing; it is opened without following a
    symbolic link (``O_NOFOLLOW``: a link planted in a received run directory is never written
    through) and readable by its owner only (0600, as the run's other files). Writes are
    unbuffered: a write that fails (a full disk) raises at once, and the next write starts on a
    new line, so a torn line stays one line that the reader skips. :meth:`sync` puts what was
    written on the disk (``fsync``): the telemetry does so at every checkpoint.

    A file deleted, moved or replaced under a running sink is noticed at the next write and said
    once (a warning): deleted from a directory that is still there, a new file is started at
    ``path``; when the directory itself is gone (the run directory moved or deleted), the rows go
    on into the open file, wherever it went, and nothing is created at the old path.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._file = None
        self._torn = False
        self._identity: tuple[int, int] | None = None
        self._gone_said = False

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(self.path, flags, 0o600)
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o600)  # a file of an earlier version was 0644
        self._file = os.fdopen(fd, "ab", buffering=0)
        st = os.fstat(fd)
        self._identity = (st.st_dev, st.st_ino)
        self._torn = self._torn or _ends_mid_line(self.path)  # a kill left a torn last line

    def _check_still_there(self) -> None:
        """Whether ``path`` is still the open file; say it once when it is not."""
        try:
            st = os.lstat(self.path)
            same = (st.st_dev, st.st_ino) == self._identity
        except OSError:
            same = False
        if same:
            return
        if self.path.parent.is_dir():  # the file alone was deleted or replaced: start a new one here
            warnings.warn(
                f"{self.path} was deleted or replaced during the run; a new one is started there with the rows "
                "written before (read back from the open file)",
                RuntimeWarning,
                stacklevel=3,
            )
            old = self._file
            earlier = os.pread(old.fileno(), os.fstat(old.fileno()).st_size, 0)
            old.close()
            self._file = None
            self._open()
            self._write_bytes(earlier)
        elif not self._gone_said:  # the run directory moved or went: keep writing into the open file
            self._gone_said = True
            warnings.warn(
                f"{self.path.parent} was moved or deleted during the run; telemetry rows go on into the open "
                f"file (wherever it moved), and nothing is created at {self.path}",
                RuntimeWarning,
                stacklevel=3,
            )

    def write(self, rows: Sequence[dict[str, Any]]) -> None:
        if not rows:
            return
        if self._file is None:
            self._open()
        else:
            self._check_still_there()
        text = "".join(json.dumps({k: encode_value(v) for k, v in row.items()}, allow_nan=False) + "\n" for row in rows)
        self._write_bytes((b"\n" if self._torn else b"") + text.encode("utf-8"))

    def _write_bytes(self, data: bytes) -> None:
        self._torn = True  # until the whole chunk is written
        view = memoryview(data)
        while view:
            written = self._file.write(view)
            view = view[written or 0 :]
        self._torn = False

    def sync(self) -> None:
        """Put every row written so far on the disk (``fsync``)."""
        if self._file is not None:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass
class BadLine:
    """A line of a telemetry file that is not a row (torn by a kill or a full disk, or garbage)."""

    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


@dataclass
class TelemetryLog:
    """A telemetry file as read: its rows, the lines skipped, and how many rows a resume superseded."""

    path: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: list[BadLine] = field(default_factory=list)
    superseded: int = 0
    # values dropped from rows that were kept: a key whose value is not what the writer writes
    # there (a number; text for TEXT_KEYS), one entry per line
    bad_values: list[BadLine] = field(default_factory=list)

    def warnings(self) -> list[str]:
        """One message per skipped line and per line with dropped values, naming the file and
        the line number."""
        return [f"{self.path}: {bad}, skipped" for bad in self.bad_lines] + [
            f"{self.path}: {bad}, dropped" for bad in self.bad_values
        ]


# the keys whose values the writers log as text; every other value is a number
TEXT_KEYS = ("train/dominant_grad_source",)
TEXT_PREFIXES = (EXPERTS_IDLE_IDS,)


def _typed(number: int, row: dict[str, Any]) -> tuple[dict[str, Any], BadLine | None]:
    """``row`` with only the values of the types the writers log (a file from elsewhere is data:
    a list, an object, null or a stray string where a number belongs made the report raise)."""
    kept, dropped = {}, []
    for key, value in row.items():
        number_like = isinstance(value, (int, float)) and not isinstance(value, bool)
        text = isinstance(value, str) and (key in TEXT_KEYS or key.startswith(TEXT_PREFIXES))
        if number_like or text:
            # an integer past float64's exact range (no writer logs one): a float, as numpy reads it
            kept[key] = float(value) if number_like and isinstance(value, int) and abs(value) > 2**53 else value
        else:
            dropped.append(f"{key!r} ({type(value).__name__})")
    if not dropped:
        return kept, None
    more = f" and {len(dropped) - 3} more" if len(dropped) > 3 else ""
    return kept, BadLine(number, f"values of the wrong type: {', '.join(dropped[:3])}{more}")


def _parse_lines(path: str | os.PathLike) -> tuple[list[tuple[int, dict[str, Any]]], list[BadLine]]:
    rows, bad = [], []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                bad.append(BadLine(number, "not UTF-8 text (garbage)"))
                continue
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                torn = not raw.endswith(b"\n") or line.startswith("{")
                what = "a torn row (cut off mid-write)" if torn else "not JSON (garbage)"
                bad.append(BadLine(number, f"{what}: {exc.msg} at column {exc.colno}"))
                continue
            if not isinstance(obj, dict):
                bad.append(BadLine(number, f"not a row: a JSON {type(obj).__name__}, expected an object"))
                continue
            rows.append((number, {k: decode_value(v) for k, v in obj.items()}))
    return rows, bad


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a telemetry JSONL file in the order written, with non-finite values decoded back
    to floats. Lines that are not rows (torn, garbage) are skipped with a warning naming the
    line; rows a resume re-ran are all kept (see :func:`read_telemetry`)."""
    rows, bad = _parse_lines(path)
    for b in bad:
        warnings.warn(f"{path}: {b}, skipped", RuntimeWarning, stacklevel=2)
    return [row for _, row in rows]


def read_telemetry(path: str | os.PathLike) -> TelemetryLog:
    """The rows of a run's telemetry, each step once.

    Lines that are not rows are skipped and listed in ``bad_lines``; in the rows kept, values of
    a type the writers never log there (anything but a number; text only under ``TEXT_KEYS`` and
    ``TEXT_PREFIXES``) are dropped and each such line listed in ``bad_values``. A row whose
    ``step`` is not past the previous row's starts a new attempt of those steps (a resume from a
    checkpoint older than the last row written): the earlier rows from that step on are
    superseded, so each step counts once, with the values of the attempt the run continued from.
    """
    parsed, bad = _parse_lines(path)
    log = TelemetryLog(Path(path), bad_lines=bad)
    rows = log.rows
    for number, row in parsed:
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
            log.bad_lines.append(BadLine(number, "a row without a numeric 'step'"))
            continue
        row, dropped = _typed(number, row)
        if dropped is not None:
            log.bad_values.append(dropped)
        while rows and rows[-1]["step"] >= step:
            rows.pop()
            log.superseded += 1
        rows.append(row)
    log.bad_lines.sort(key=lambda b: b.line)
    return log


class WandbSink:
    """Logs rows to a W&B run; offline by default (no account, no network: ``wandb sync`` later).

    Args:
        run_dir: where W&B writes its run (``<run_dir>/wandb/offline-run-*``).
        project: the W&B project.
        mode: ``"offline"`` (default), ``"online"`` or ``"disabled"``; ``WANDB_MODE`` in the
            environment is not consulted: pass what you want.
        step_key: the row key used as W&B's x-axis (defined as the step metric).
        **init_kwargs: passed to ``wandb.init`` (name, config, tags, ...).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        project: str = "lightning_fp8state",
        mode: str = "offline",
        step_key: str = "step",
        **init_kwargs: Any,
    ) -> None:
        require_choice("mode", mode, WANDB_MODES)
        self.run_dir = Path(run_dir)
        self.project, self.mode, self.step_key = project, mode, step_key
        self.init_kwargs = init_kwargs
        self.run = None

    def _start(self):
        import wandb  # noqa: PLC0415  (lazy: W&B is heavy and optional at import time)

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=self.project, dir=str(self.run_dir), mode=self.mode, **self.init_kwargs)
        self.run.define_metric(self.step_key)
        self.run.define_metric("*", step_metric=self.step_key)
        return self.run

    def write(self, rows: Sequence[dict[str, Any]]) -> None:
        run = self.run or self._start()
        for row in rows:
            run.log(dict(row))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


@dataclass
class SinkFailures:
    """The failed writes of one sink: how many, the steps whose rows it lost, the last error."""

    sink: str
    count: int = 0
    rows_lost: int = 0
    first_step: Any = None
    last_step: Any = None
    last_error: str = ""

    def __str__(self) -> str:
        steps = f"steps {self.first_step}..{self.last_step}" if self.first_step is not None else "rows"
        return (
            f"telemetry sink {self.sink} failed {self.count} time(s) and lost {self.rows_lost} row(s) "
            f"({steps}); last error: {self.last_error}"
        )


class FanOut:
    """One sink that writes to many. A failing sink is reported at every failure (a warning
    naming the steps whose rows it lost) and the others still get the rows: a logger that
    breaks mid-run must not silence the JSONL, and a full disk must not go unnoticed.
    :meth:`failure_report` sums the failures up for the end of the run."""

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks = list(sinks)
        self.failures: dict[int, SinkFailures] = {}

    def write(self, rows: Sequence[dict[str, Any]]) -> None:
        for sink in self.sinks:
            try:
                sink.write(rows)
            except Exception as exc:  # one broken sink must not silence the others
                self._failed(sink, rows, exc)

    def _failed(self, sink, rows: Sequence[dict[str, Any]], exc: Exception) -> None:
        f = self.failures.setdefault(id(sink), SinkFailures(type(sink).__name__))
        steps = [r.get("step") for r in rows if r.get("step") is not None]
        f.count += 1
        f.rows_lost += len(rows)
        if steps:
            f.first_step = steps[0] if f.first_step is None else f.first_step
            f.last_step = steps[-1]
        f.last_error = repr(exc)
        where = f"steps {steps[0]}..{steps[-1]}" if steps else f"{len(rows)} row(s)"
        warnings.warn(
            f"telemetry sink {f.sink} failed to write {where} ({len(rows)} row(s) lost; failure {f.count} "
            f"of this sink): {exc!r}",
            RuntimeWarning,
            stacklevel=3,
        )

    def sync(self) -> None:
        """Each sink that keeps a file puts it on the disk (a failure is reported as a write's)."""
        for sink in self.sinks:
            sync = getattr(sink, "sync", None)
            if sync is None:
                continue
            try:
                sync()
            except Exception as exc:  # noqa: BLE001  (as in write: one sink's failure is reported, not raised)
                self._failed(sink, [], exc)

    def failure_report(self) -> list[str]:
        """One line per sink that failed during the run (empty when none did)."""
        return [str(f) for f in self.failures.values()]

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # a sink that cannot close (a full disk) is one more failure
                self._failed(sink, [], exc)

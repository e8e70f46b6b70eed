"""How ``fsdp-ckpt`` reports to its user: the one-line failure, byte sizes, the progress bar.

:class:`CliError` carries the exit code; ``checkpoint.tool.cli.main`` turns it (and
any other exception) into the single ``fsdp-ckpt: error: ...`` line.
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["EXIT_CANNOT_RUN", "EXIT_FOUND_PROBLEMS", "PROG", "CliError", "Progress", "human_bytes", "process_rank"]

PROG = "fsdp-ckpt"
EXIT_FOUND_PROBLEMS = 1
EXIT_CANNOT_RUN = 2


class CliError(Exception):
    """A failure to report as one line; ``exit_code`` says which kind."""

    def __init__(self, message: str, exit_code: int = EXIT_CANNOT_RUN) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.50 KiB"``: binary units, whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def process_rank() -> int:
    """This process's rank under ``torchrun`` (``RANK``), 0 otherwise."""
    return int(os.environ.get("RANK", "0"))


class Progress:
    """A one-line byte progress bar on stderr: only on a TTY, only on rank 0."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.done = label, max(total, 1), 0
        self.enabled = enabled and sys.stderr.isatty() and process_rank() == 0
        self.start = time.perf_counter()
        self._last = 0.0

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.2 or self.done >= self.total):
            self._last = now
            rate = self.done / max(now - self.start, 1e-9)
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * 30)
            sys.stderr.write(
                f"\r{self.label} [{bar:<30}] {frac:6.1%} {human_bytes(self.done)} / "
                f"{human_bytes(self.total)} {human_bytes(rate)}/s"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")

"""`Progress`: bytes read or pinned while a session opens, shown where a terminal is attached.

Opening a session over tens of GB reads every block from the checkpoint (or copies it from the
module into pinned memory), which takes seconds to minutes. The host store calls a callback once
per group (`HostStore.prepare`'s ``progress``); `Progress` turns those calls into a tqdm bar when
tqdm is importable (it comes with diffusers and huggingface_hub), else into one self-rewriting
stderr line, and ends with the total time and rate. It shows nothing when stderr is not a terminal
(logs, pipes, tests), when the work is under `MIN_BYTES`, or when ``TORCHFERRY_PROGRESS=0``; and
``TORCHFERRY_PROGRESS=1`` forces it on, on any stream and at any size. Writing to the terminal never
fails the session: an ``OSError`` from the stream turns the display off.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

__all__ = ["MIN_BYTES", "Progress", "forced", "wanted"]

#: Work below this many bytes opens quickly: no progress is shown for it.
MIN_BYTES = 256 * 2**20
#: The plain line is rewritten at most this often (seconds).
_EVERY_S = 0.25


def _setting(environ: Mapping[str, str] | None) -> str:
    env = os.environ if environ is None else environ
    return env.get("TORCHFERRY_PROGRESS", "").strip()


def forced(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``TORCHFERRY_PROGRESS=1`` asks for progress everywhere, whatever the size of the work."""
    return _setting(environ) == "1"


def wanted(stream: TextIO | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether progress shows on ``stream`` (default stderr): on a terminal, unless the env says otherwise."""
    setting = _setting(environ)
    if setting in ("0", "1"):
        return setting == "1"
    out = sys.stderr if stream is None else stream
    try:
        return out.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class Progress:
    """A progress display for ``what`` (``"reading weights"``); call it with each group's bytes, then `close`.

    ``stream`` defaults to stderr; ``use_tqdm=None`` uses tqdm when importable. The display starts
    with the first call (which says the total) and only if `wanted` and the total reaches
    ``min_bytes`` (any total when ``enabled`` is left to the environment and it is `forced`).
    """

    def __init__(
        self,
        what: str,
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        use_tqdm: bool | None = None,
        min_bytes: int = MIN_BYTES,
    ) -> None:
        self.what = what
        self.stream = sys.stderr if stream is None else stream
        self.enabled = wanted(self.stream) if enabled is None else enabled
        self.use_tqdm = use_tqdm
        self.min_bytes = 0 if enabled is None and forced() else min_bytes
        self.done = 0
        self.total = 0
        self._bar: Any = None
        self._start = 0.0
        self._shown = 0.0
        self._live = False

    def __call__(self, nbytes: int, total: int) -> None:
        """``nbytes`` more of ``total`` bytes are done."""
        if not self._live and self.done == 0:
            self._begin(total)
        self.done += nbytes
        if not self._live:
            return
        try:
            if self._bar is not None:
                self._bar.update(nbytes)
            else:
                now = time.perf_counter()
                if now - self._shown >= _EVERY_S or self.done >= self.total:
                    self._shown = now
                    self._line(now, end="")
        except OSError:
            self._live = False

    def _begin(self, total: int) -> None:
        self.total = total
        self._start = time.perf_counter()
        if not self.enabled or total < self.min_bytes:
            return
        self._live = True
        if self.use_tqdm is not False:
            try:
                tqdm = importlib.import_module("tqdm").tqdm
            except ImportError:
                if self.use_tqdm:
                    raise
            else:
                self._bar = tqdm(
                    total=total,
                    desc=f"torchferry: {self.what}",
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1024,
                    file=self.stream,
                    leave=True,
                )

    def _line(self, now: float, end: str) -> None:
        elapsed = now - self._start
        share = self.done / self.total if self.total else 1.0
        rate = self.done / elapsed / 1e9 if elapsed > 0 else 0.0
        self.stream.write(
            f"\rtorchferry: {self.what}: {_gib(self.done)} of {_gib(self.total)} ({share:.0%}) "
            f"in {elapsed:.1f} s, {rate:.2f} GB/s{end}"
        )
        self.stream.flush()

    def close(self) -> None:
        """End the display (a final line with the time taken); idempotent."""
        if not self._live:
            return
        self._live = False
        try:
            if self._bar is not None:
                self._bar.close()
            else:
                self._line(time.perf_counter(), end="\n")
        except OSError:
            pass

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

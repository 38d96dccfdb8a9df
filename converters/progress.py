"""Progress bars on stderr for the long conversion steps (tqdm, a dependency of gguf), or nothing."""

from __future__ import annotations

from typing import TextIO


class Progress:
    """``with Progress(stream, total, "profile") as bar: bar.update()``; silent when ``stream`` is None."""

    def __init__(self, stream: TextIO | None, total: int, desc: str, unit: str = "it") -> None:
        self._bar = None
        if stream is not None:
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm comes with gguf
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(
                    total=total,
                    desc=f"  {desc}",
                    unit=unit,
                    file=stream,
                    leave=True,
                    dynamic_ncols=True,
                    mininterval=0.5,
                )

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def set_postfix(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def add_total(self, n: int) -> None:
        if self._bar is not None:
            self._bar.total += n
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

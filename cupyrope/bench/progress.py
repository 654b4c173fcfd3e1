"""The progress of a sweep: a tqdm bar over its cases when tqdm is installed (the bench extra
brings it), and the notes the sweep prints on the way, above the bar or on stderr without one."""

from __future__ import annotations

import sys

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - depends on the install
    tqdm = None


class Progress:
    """A bar of ``total`` cases (hidden when not ``enabled``; none without tqdm); a context
    manager that closes it."""

    def __init__(self, total: int, *, enabled: bool = True):
        self._bar = (tqdm(total=total, unit="case", dynamic_ncols=True, disable=not enabled)
                     if tqdm is not None else None)

    def case(self, description: str) -> None:
        """Name the case now running."""
        if self._bar is not None:
            self._bar.set_description(description)

    def done(self) -> None:
        """Count one case as finished, whatever its outcome."""
        if self._bar is not None:
            self._bar.update()

    def note(self, text: str) -> None:
        """Print ``text`` on stderr without breaking the bar."""
        if self._bar is not None:
            # tqdm.write clears the bar, prints the line and redraws the bar below it.
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

"""Progress bars over segments: with a total, and so an ETA, wherever the amount of work can be known.

A list knows its length and `--limit` bounds the work; a corpus of files does not say how many segments it holds
until it is read, so `segment_bar` counts them in a background thread (reading only: no tokenisation, a small
fraction of the work) and gives the bar its total once the count is done; a run that reads its whole input before
the count is done ends its bar (`finish`) on the number it read. Standard input and pipes are read once, so a run
from them shows a count without a total until it ends.
"""
from __future__ import annotations

import threading

from ..corpus import Corpus


def known_total(segments) -> int | None:
    """The number of segments, when it is known without reading them."""
    return len(segments) if hasattr(segments, "__len__") else None


def count_in_background(segments, bar) -> threading.Thread | None:
    """Count the segments of a re-readable `Corpus` in a daemon thread and set `bar.total` to the count (None and
    nothing done for other inputs, or one with a stream: standard input or a pipe, which can be read once)."""
    if not isinstance(segments, Corpus) or segments.has_streams:
        return None

    def count():
        n = 0
        try:
            for _ in segments:
                n += 1
        except Exception:  # the run itself reports a bad input; the bar just keeps counting without a total
            return
        bar.total = n
        if bar.last_print_t >= bar.start_t + bar.delay:  # drawn already (without its total): draw it again
            bar.refresh()

    thread = threading.Thread(target=count, name="attnkit-count-segments", daemon=True)
    thread.start()
    return thread


FIRST_DRAW_S = 1e-3  # the bar is first drawn at its first update, not at its creation


def bar_class():
    """tqdm, drawn first at the first update (a bar drawn at its creation, before the background count gave it
    its total, left a stray "0seg" line in logs) and at 100% once, when it closes with the run's mean rate (the
    last update drew 100% with the recent rate, then closing drew it again with another)."""
    from tqdm.auto import tqdm

    class SegmentBar(tqdm):
        def update(self, n=1):
            if not self.disable and self.total is not None and self.n + n >= self.total:
                self.n += n  # the last step: drawn by close
                return None
            return super().update(n)

        def finish(self):
            """Close the bar of a run that read its whole input: its total is the number of segments taken, whether
            or not the background count has given it yet (so a short run ends on "n/n" whatever the count's
            thread is doing). An interrupted run calls `close` alone and keeps the total it had."""
            self.total = self.n
            self.close()

        def close(self):
            if not self.disable and self.last_print_t < self.start_t + self.delay:
                self.last_print_t = self.start_t + self.delay  # never drawn yet (a short run): close draws it once
            super().close()

    return SegmentBar


def segment_bar(label: str, segments, *, total: int | None = None, initial: int = 0, file=None):
    """A bar (`bar_class`) named `label` counting segments (`seg`), with a total from `total`, the input's length,
    or a count in the background."""
    total = total if total is not None else known_total(segments)
    bar = bar_class()(total=total, initial=initial, unit="seg", desc=label, dynamic_ncols=True, delay=FIRST_DRAW_S,
                      file=file)
    bar.counter = count_in_background(segments, bar) if total is None else None  # the thread, for tests to join
    return bar


__all__ = ["bar_class", "count_in_background", "known_total", "segment_bar"]

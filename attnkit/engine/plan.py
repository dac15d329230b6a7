"""Segments → planned batches: length-sorted inside bounded windows of the input stream.

A global sort by length wastes the least padding but needs the whole corpus in memory. Instead the stream is
cut into consecutive windows of `window` segments; each window is sorted longest first (by characters, stable)
and cut into batches. Memory is bounded by one window, and padding stays close to a global sort once a window
holds a few thousand segments (bench/pipeline.py measures it).

Characters are a rough measure of tokens: short sentences sorted by characters pad far more than sorted by tokens
(docs/pipeline.md has the figures). The tokens are only known after tokenising, and tokenising happens after the
plan (in worker processes, on Ray workers). So a `grouped` plan joins consecutive batches of a window's character
order into units (`group_batches`: at most GROUP_BATCHES batches and about GROUP_CHARS characters; batches of one
sample are not joined, having no padding to save); a unit is tokenised as one, and its forwards run its samples
sorted by tokens, `batch_size` at a time (`attnkit.engine.forward.length_batches`), which pads little more than a
sort by tokens. The unit is what the engines plan, tokenise, sum and checkpoint; which samples share a forward
depends only on the unit's text, so every engine still runs the same forwards.

The plan is a pure function of the segment stream, `batch_size` and `window`: every engine (the in-process
loop, tokenisation workers, several devices, Ray) measures exactly the same batches, so per-sample features —
and therefore the sums — agree, and a resumed run continues at a batch boundary of the same plan. A window is
also the unit of work and of resume for the Ray engine (a "shard", attnkit/engine/ray/).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..errors import AttnkitError, arg, check_int
from ..features import DEFAULT_WINDOW
from ..tokens import Segment


@dataclass(frozen=True)
class PlannedBatch:
    """One batch of the plan. `index` counts batches from the start of the run, `start` counts the segments
    planned before it, `window` is the window (shard) it was cut from."""

    index: int
    start: int
    window: int
    segments: list
    positions: tuple = ()  # where each segment stands in the input stream (0-based)
    # samples per forward: a unit of a grouped plan holds several batches' segments (the module docstring)
    batch_size: int | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.segments)

    @property
    def n_forwards(self) -> int:
        """The forwards it runs: several for a unit of a grouped plan."""
        return 1 if self.batch_size is None else -(-len(self.segments) // self.batch_size)


def take_forwards(items: Iterator, forwards: int, *, at_least: int = 1, planned=lambda item: item) -> list:
    """The next items of `items` until their forwards (`PlannedBatch.n_forwards` of `planned(item)`) reach
    `forwards`, and at least `at_least` of them; fewer where `items` ends first."""
    out, n = [], 0
    while (n < forwards or len(out) < at_least) and (item := next(items, None)) is not None:
        out.append(item)
        n += planned(item).n_forwards
    return out


def segment_chars(segment: Segment) -> int:
    """A segment's characters; an image (attnkit.corpus.images.ImageItem) counts as its nominal `chars`."""
    if isinstance(segment, str):
        return len(segment)
    return segment.chars if hasattr(segment, "chars") else sum(len(x) for x in segment)


def check_plan_settings(batch_size: int, window: int) -> None:
    """Refuse a batch size or window that is not a positive integer."""
    check_int(batch_size, "batch_size")
    check_int(window, "window")


def windows(segments: Iterable[Segment], window: int) -> Iterator[list]:
    """Consecutive cuts of `window` segments (the last one may be shorter)."""
    it = iter(segments)
    while True:
        chunk = list(itertools.islice(it, window))
        if not chunk:
            return
        yield chunk


def window_order(segments: list) -> list[int]:
    """Positions of a window's segments, longest first (stable)."""
    return sorted(range(len(segments)), key=lambda i: -segment_chars(segments[i]))


def batches_of_window(segments: list, batch_size: int) -> list[list]:
    """A window's segments longest first (stable), cut into batches of `batch_size`."""
    ordered = [segments[i] for i in window_order(segments)]
    return [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]


GROUP_BATCHES = 8  # batches of a window's character order joined into one unit of a grouped plan
GROUP_CHARS = 64 * 1024  # and about this much text at most (a unit of long texts is a single batch)


def group_batches(batch_chars: list[int]) -> list[int]:
    """How many of consecutive batches (of `batch_chars` characters each) each unit takes: at most GROUP_BATCHES,
    and more than one only while the unit's text stays within GROUP_CHARS. Units hold whole batches, so a unit's
    forwards are as many as its batches, and only a window's last forward may be smaller."""
    out, i = [], 0
    while i < len(batch_chars):
        n, chars = 1, batch_chars[i]
        while n < GROUP_BATCHES and i + n < len(batch_chars) and chars + batch_chars[i + n] <= GROUP_CHARS:
            chars += batch_chars[i + n]
            n += 1
        out.append(n)
        i += n
    return out


def plan_window(segments: list, batch_size: int, *, window_index: int, first_batch: int,
                start: int, grouped: bool = False) -> list[PlannedBatch]:
    """The planned batches (with `grouped`, units: the module docstring) of one window whose first batch is
    number `first_batch` and whose first segment is number `start` of the plan (and of the input stream: windows
    are consecutive cuts of it)."""
    order = window_order(segments)
    cuts = list(range(0, len(order), batch_size))
    if grouped and batch_size > 1:  # (forwards of one sample have no padding to save)
        chars = [sum(segment_chars(segments[j]) for j in order[i:i + batch_size]) for i in cuts]
        taken = itertools.accumulate(group_batches(chars), initial=0)
        cuts = [cuts[k] for k in taken if k < len(cuts)]
    out = []
    for i, end in zip(cuts, cuts[1:] + [len(order)]):
        idx = order[i:end]
        out.append(PlannedBatch(first_batch + len(out), start + i, window_index, [segments[j] for j in idx],
                                tuple(start + j for j in idx), batch_size))
    return out


def plan_batches(segments: Iterable[Segment], batch_size: int, window: int = DEFAULT_WINDOW, *,
                 skip_segments: int = 0, grouped: bool = False) -> Iterator[PlannedBatch]:
    """Yield the plan's batches (with `grouped`, its units) in order, leaving out the first `skip_segments`
    segments of the plan (a resume point, which must fall on a batch boundary of this plan)."""
    check_plan_settings(batch_size, window)
    n_batches = n_segments = 0
    for w, chunk in enumerate(windows(segments, window)):
        planned = plan_window(chunk, batch_size, window_index=w, first_batch=n_batches, start=n_segments,
                              grouped=grouped)
        for pb in planned if n_segments + len(chunk) > skip_segments else ():  # else finished before
            if pb.start < skip_segments:
                if pb.end > skip_segments:
                    raise AttnkitError(f"resume point {skip_segments} is not a batch boundary of this plan "
                                       f"(was {arg('batch_size')} or {arg('window')} changed?)")
                continue
            yield pb
        n_batches += len(planned)
        n_segments += len(chunk)
    if skip_segments > n_segments:
        raise AttnkitError(f"resume point {skip_segments} lies past the end of the corpus ({n_segments} segments)")

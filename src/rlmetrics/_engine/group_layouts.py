"""What every rank of a process group knows alike: the layouts agreed over it, and the
padded buffer sizes that follow.

A step's collective must have the same size on every rank, or the backend pairs the
wrong messages (gloo aborts the process). A tracker's own cache (the layout it last
agreed over a group) cannot decide that size: a tracker created or unpickled on one rank
only has none, and one rank's tracker may cache another layout than its peers'.

``GroupLayouts`` holds, per process group and process (not per tracker), the layouts
agreed over the group most recently. Every rank changes it at the same points of the
same collective sequence (an agreement, whose union every rank computes alike, and a
step whose reduced tail every rank reads alike), so it is the same on every rank of
the group whatever their trackers cache. A step's buffers are padded to the largest
of these layouts, and the layout each rank packed travels in the buffer's last
``TAIL`` floats: a rank without a usable layout packs none and marks its buffer, so
every rank sees the mismatch in the reduced tail and agrees again, together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rlmetrics._engine.layout import BufferLayout
from rlmetrics.kinds.base import MetricRecords

TAIL = 3  # a packed buffer's last floats: [schema changed, layout hash, -layout hash]
RECENT = 8  # layouts kept per group: trackers that share a group keep their own


@dataclass(frozen=True)
class Sizes:
    """A group's padded buffer sizes (the largest of its recent layouts'): every rank
    packs ``[SUM | pad | MAX | logged | pad | tail]``, gathered whole, or with NaN counts
    of the MAX part inserted (``packing.with_nan_counts``) reduced as an
    all_reduce(SUM) of ``sums + maxes`` floats and an all_reduce(MAX) of ``maxes``.

    Attributes:
        sums: the SUM part's length, [SUM | pad].
        maxes: the MAX part's length, [MAX | logged | pad | tail].
    """

    sums: int = 0
    maxes: int = TAIL


def layout_sizes(layout: BufferLayout) -> Sizes:
    """The unpadded sizes of ``layout``'s buffer."""
    return Sizes(layout.num_sums, layout.num_maxes + len(layout.placements) + TAIL)


class GroupLayouts:
    """The layouts this process agreed over one group, newest first (at most
    ``RECENT``), and the padded buffer sizes every rank of the group uses."""

    def __init__(self) -> None:
        self.layouts: list[BufferLayout] = []
        self.sizes = Sizes()

    def use(self, layout: BufferLayout) -> None:
        """Record that every rank of the group agreed on (or reduced a step in)
        ``layout``: it moves to the front; the oldest layout beyond ``RECENT`` drops.

        ``sizes`` is replaced only when the set of layouts changes, so a packing can
        tell whether its padding still holds by identity.
        """
        layouts = self.layouts
        if layouts and layouts[0] is layout:
            return
        digest = layout.digest
        others = [known for known in layouts if known.digest != digest]
        self.layouts = [layout, *others][:RECENT]
        if len(others) == len(layouts):  # a new member (the oldest may have dropped)
            every = [layout_sizes(known) for known in self.layouts]
            self.sizes = Sizes(max(s.sums for s in every), max(s.maxes for s in every))

    def holds(self, layout: BufferLayout) -> bool:
        """Whether ``layout``'s buffer fits the group's padded sizes."""
        own, padded = layout_sizes(layout), self.sizes
        return own.sums <= padded.sums and own.maxes <= padded.maxes

    def guess(self, accumulators: Mapping[str, MetricRecords]) -> BufferLayout | None:
        """For a tracker with no layout of its own: the newest recent layout that fits
        its metrics (the peers' likely one; a wrong guess costs one agreement), or None."""
        return next((layout for layout in self.layouts if layout.fits(accumulators)), None)

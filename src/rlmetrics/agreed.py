"""What every rank of a process group knows alike (the layouts agreed over it), and how
one rank packs a step into buffers of the group's padded sizes (``Plan``).

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
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import Accumulator
from rlmetrics.layout import Layout
from rlmetrics.packing import Packing, with_nan_counts
from rlmetrics.table import Table

TAIL = 3  # a packed buffer's last floats: [schema changed, layout hash, -layout hash]
RECENT = 8  # layouts kept per group: trackers that share a group keep their own


@dataclass(frozen=True)
class Sizes:
    """A group's padded buffer sizes (the largest of its recent layouts').

    Attributes:
        gather: the length of the one-gather buffer, [SUM | MAX | logged | pad | tail].
        sums: the length of the pair's all_reduce(SUM) part, [SUM | NaN counts | pad].
        maxes: the length of the pair's all_reduce(MAX) part, [MAX | logged | pad | tail].
    """

    gather: int = TAIL
    sums: int = 0
    maxes: int = TAIL


def layout_sizes(layout: Layout) -> Sizes:
    """The unpadded sizes of ``layout``'s buffers."""
    sums, maxes, slots = layout.num_sums, layout.num_maxes, len(layout.placements)
    return Sizes(sums + maxes + slots + TAIL, sums + maxes, maxes + slots + TAIL)


class GroupLayouts:
    """The layouts this process agreed over one group, newest first (at most
    ``RECENT``), and the padded buffer sizes every rank of the group uses."""

    def __init__(self) -> None:
        self.layouts: list[Layout] = []
        self.sizes = Sizes()

    def use(self, layout: Layout) -> None:
        """Record that every rank of the group agreed on (or reduced a step in)
        ``layout``: it moves to the front; the oldest layout beyond ``RECENT`` drops.

        ``sizes`` is replaced only when the set of layouts changes, so a packing plan
        can tell whether its padding still holds by identity.
        """
        layouts = self.layouts
        if layouts and layouts[0] is layout:
            return
        digest = layout.digest
        others = [known for known in layouts if known.digest != digest]
        self.layouts = [layout, *others][:RECENT]
        if len(others) == len(layouts):  # a new member (the oldest may have dropped)
            every = [layout_sizes(known) for known in self.layouts]
            self.sizes = Sizes(
                max(s.gather for s in every),
                max(s.sums for s in every),
                max(s.maxes for s in every),
            )

    def holds(self, layout: Layout) -> bool:
        """Whether ``layout``'s buffers fit the group's padded sizes."""
        own, padded = layout_sizes(layout), self.sizes
        return own.gather <= padded.gather and own.sums <= padded.sums and own.maxes <= padded.maxes

    def guess(self, accumulators: Mapping[str, Accumulator]) -> Layout | None:
        """For a tracker with no layout of its own: the newest recent layout that fits
        its metrics (the peers' likely one; a wrong guess costs one agreement), or None."""
        return next((layout for layout in self.layouts if layout.fits(accumulators)), None)


@dataclass(eq=False)
class Plan:
    """How this rank packs a step: its layout (None: it has none the group may share)
    and accumulators in layout order (None where it logged nothing), the group's padded
    sizes, the logged marks and the tail that end the MAX part, and (made on first use)
    the ``Packing`` of the buffer it packs (the gather's, or with ``pair`` the pair's)."""

    layout: Layout | None
    accs: list[Any]
    sizes: Sizes
    logged: list[float]
    tail: list[float]  # [schema changed, layout hash, -layout hash]
    logged_all: bool  # this rank logged every name of the layout
    version: int = -1  # the tracker table's row version the plan was made for
    packing: Packing | None = None
    pair: bool = False

    def max_end(self, max_part: int) -> np.ndarray:
        """What follows the MAX slots up to ``max_part`` floats: the logged marks, the
        padding, the tail."""
        num_maxes = 0 if self.layout is None else self.layout.num_maxes
        end = np.zeros(max_part - num_maxes)
        end[: len(self.logged)] = self.logged
        end[-TAIL:] = self.tail
        return end

    def pack(self, table: Table, device: torch.device, pair: bool) -> Tensor:
        """The gather's buffer [SUM | MAX | logged | pad | tail], ``sizes.gather``
        floats; or the pair's [SUM | NaN counts | pad | MAX | logged | pad | tail], the
        all_reduce(SUM) part ``sizes.sums`` floats, the all_reduce(MAX) part
        ``sizes.maxes``."""
        layout, sizes = self.layout, self.sizes
        if layout is None:
            end = self.max_end(sizes.sums + sizes.maxes if pair else sizes.gather)
            return torch.from_numpy(end).to(device)
        max_part = sizes.maxes if pair else sizes.gather - layout.num_sums
        if self.packing is None or self.pair != pair:
            self.packing = Packing.make(layout, self.accs, table, self.max_end(max_part))
            self.pair = pair
        packed = self.packing.pack(table, device)
        if not pair:
            return packed
        packed = with_nan_counts(packed, layout)
        additive = layout.num_sums + layout.num_maxes  # and the NaN counts
        if additive == sizes.sums:
            return packed
        pad = packed.new_zeros(sizes.sums - additive)
        return torch.cat((packed[:additive], pad, packed[additive:]))

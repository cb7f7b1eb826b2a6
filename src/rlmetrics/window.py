"""Windows: several steps' metrics merged exactly and reported with one sync.

Log every k steps; an asynchronous trainer's several local updates per logged step; a
validation pass spread over training steps. Each ``Window.step()`` takes this process's
step state from the tracker (``Tracker.state()``: one host transfer, no collective) and
merges it into the open window; when the window closes, one ``compute`` over the process
group reports it: every value equals what one step over the window's data would report.

Time order matters for kinds whose new value replaces the old (``last``): merging two
ranks' states treats their values as copies that must agree, but two steps' values are
old and new. The window keeps, per replacing metric, the latest step in which this rank
logged a value, and syncs it under that step's age; the report takes the youngest any
rank sent, so ``last`` is the value of the window's last step that logged it, even
when ranks logged it in different steps (see docs/windows.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from rlmetrics._engine.packing import ReducedStep
from rlmetrics._engine.sync import as_timeout, should_sync
from rlmetrics._window_keys import Decoded, decode, empty_state, latest_of, window_key
from rlmetrics.errors import MalformedStateError, RejectedInputError
from rlmetrics.kinds import MetricState
from rlmetrics.state import TrackerState, checked_load
from rlmetrics.tracker import Tracker

WINDOW_VERSION = 1


class Window:
    """Merge ``every`` steps of a tracker's metrics and report them once, exactly.

    Call ``step()`` where you would call ``tracker.compute()``: it moves the step's
    metrics out of the tracker (the tracker starts the next step empty) and returns the
    window's metrics when this step closes it, None otherwise. Every rank of the group
    must call ``step()`` and ``flush()`` equally often: a report is a collective.

    Args:
        tracker: the tracker the steps are logged into (not a prefixed view).
        every: the steps per window; None reports only at ``flush()`` (an asynchronous
            trainer's variable number of updates per logged step).
        group: the process group of the report's sync (see ``Tracker.compute``).
        timeout: seconds (or a timedelta) after which a missing rank raises.
        sync: False reports this process's window only.
        per_step: also report each step's own values (``per_step_values``): True for
            every metric, or metric names (a name ending in "/" selects a prefix).

    Attributes:
        num_steps: the steps taken since the window was created (checkpointed).
        per_step_values: after a report, one dict per step of the reported window (in
            order), each what ``tracker.compute()`` would have reported at that step
            for the ``per_step`` metrics; synced in the report's one collective. Empty
            without ``per_step``.

    Examples:
        >>> from rlmetrics import Tracker, Window
        >>> t = Tracker()
        >>> w = Window(t, every=2)
        >>> t.mean("loss", [1.0, 2.0]); t.last("lr", 0.1)
        >>> w.step() is None
        True
        >>> t.mean("loss", 6.0); t.last("lr", 0.2)
        >>> w.step()
        {'loss': 3.0, 'lr': 0.2}
    """

    def __init__(
        self,
        tracker: Tracker,
        every: int | None,
        *,
        group: Any = None,
        timeout: float | timedelta | None = None,
        sync: bool = True,
        per_step: bool | Iterable[str] = False,
    ) -> None:
        if not isinstance(tracker, Tracker):
            hint = "; pass the view's .tracker" if hasattr(tracker, "tracker") else ""
            name = type(tracker).__name__
            raise TypeError(f"Window(tracker=...) expects a Tracker, got {name}{hint}")
        self.tracker = tracker
        self.every = _check_every(every)
        self.group, self.timeout, self.sync = group, timeout, sync
        self._selected = _selector(per_step)
        # the report's own tracker: the user's keeps logging the next steps meanwhile
        self._reporter = Tracker(
            empty=tracker.empty, nonfinite=tracker.nonfinite, quantiles=_quantiles(tracker)
        )
        self.num_steps = 0
        self.per_step_values: list[dict[str, float]] = []
        self._clear()

    def _clear(self) -> None:
        """An empty open window."""
        self._num_open = 0  # steps in the open window
        self._merged = TrackerState()  # the window's states of non-replacing kinds
        self._latest: dict[str, tuple[int, MetricState]] = {}  # replacing: (step, state)
        self._per_step: list[TrackerState] = []
        self._kinds: dict[str, str] = {}
        self._num_rejected = 0
        self._rejected_message = ""

    def __len__(self) -> int:
        """The steps in the open window."""
        return self._num_open

    def step(self) -> dict[str, float] | None:
        """End a step: merge the tracker's metrics into the window and reset the tracker.

        Returns:
            The window's metrics (every rank the same) when this step closes it, else
            None.

        Raises:
            RejectedInputError: at the report, on every rank, when a log call of the
                window was rejected (see ``Tracker.compute``) or dropped at the fold (a
                logged tensor changed in place, a call with ``by=`` that could not be
                split), or a metric logged as another kind than earlier in the window,
                on any rank. ``step()`` itself raises for none of them, so every rank
                counts the step and the ranks' windows close together; those calls were
                dropped and the window is kept: ``flush()`` then reports everything else.
        """
        # the step is added and the tracker reset in one hold of the tracker's lock
        # (Tracker.take_state), so a call another thread makes is in this step or the next
        self._take_step()
        self.num_steps += 1
        if self.every is not None and self._num_open >= self.every:
            return self.flush()
        return None

    def _take_step(self) -> None:
        """Add the tracker's step to the window and reset the tracker, in one hold of its
        lock (``Tracker.take_state``), without the calls its fold dropped
        (``ModifiedInputError``, ``by=`` calls) or its state rejected, and without the
        metrics logged as another kind than earlier in the window: those are counted and
        their reasons kept for the report, which raises on every rank (see ``step``).
        Raising here instead would skip the step on this rank only: its window would
        close a step later than its peers', and their reports would pair different
        steps."""
        reasons: list[str] = []
        added = False

        def add(state: TrackerState) -> None:
            nonlocal added
            added = True
            state = self._without_changed_kinds(state, reasons)
            if reasons:
                self._num_rejected += 1
                self._rejected_message = " Then: ".join(reasons)
            self._add(state)

        for attempt in range(3):  # the fold's errors, then the rejected calls, then the rest
            try:
                self.tracker._take_state(add)
                return
            except ValueError as error:
                if added or attempt == 2:  # not this step's inputs
                    raise
                reasons.append(str(error))

    def _add(self, state: TrackerState) -> None:
        """Merge one step's state into the open window (nothing changes if it raises)."""
        index = self._num_open
        kinds = {name: self.tracker.kind(metric.kind) for name, metric in state.metrics.items()}
        replaced = {n: m for n, m in state.metrics.items() if kinds[n].keeps_latest}
        merged = self._merged.merge(
            TrackerState({n: m for n, m in state.metrics.items() if n not in replaced})
        )
        latest = dict(self._latest)
        for name, metric in replaced.items():
            latest[name] = latest_of(latest.get(name), index, metric, kinds[name], name)
        self._merged, self._latest = merged, latest
        for name, kind in kinds.items():
            self._kinds[name] = kind.name
        if self._selected is not None:
            selected = {n: m for n, m in state.metrics.items() if self._selected(n)}
            self._per_step.append(TrackerState(selected))
        self._num_open += 1

    def _without_changed_kinds(self, state: TrackerState, reasons: list[str]) -> TrackerState:
        """``state`` without the metrics whose kind differs from the one they have earlier
        in the window (a window merges a name's steps, so a name keeps one kind); a
        reason for each is added to ``reasons``, for the report to raise."""
        changed = [
            name
            for name, metric in state.metrics.items()
            if self._kinds.get(name, metric.kind) != metric.kind
        ]
        if not changed:
            return state
        reasons += (
            f"metric {name!r} is kind {state.metrics[name].kind!r} in the window's step "
            f"{self._num_open} but {self._kinds[name]!r} in an earlier step, and was dropped "
            "from the step (a window keeps one kind per name: flush() the window before "
            "changing it)"
            for name in changed
        )
        return TrackerState({n: m for n, m in state.metrics.items() if n not in changed})

    def flush(self, reset: bool = True) -> dict[str, float]:
        """Report the open window now (the steps taken so far; ``{}`` when none was
        logged), with one sync over the group, and start a new window. Metrics logged
        since the last ``step()`` stay in the tracker. Every rank must call it.

        Args:
            reset: False keeps the window open (later steps add to it).

        Raises:
            RejectedInputError: as in ``step()``.
        """
        decoded = decode(self._synced(), self._num_open)
        if decoded.num_rejected:
            self._report_rejected(decoded)
        window = self._results(decoded.window)
        per_step = [self._results(states) for states in decoded.per_step]
        self.per_step_values = per_step if self._selected is not None else []
        if reset:
            self._clear()
        return window

    def _synced(self) -> dict[str, MetricState]:
        """The open window's parts (``_encoded``) merged over the group by the sync that
        ``Tracker.compute`` runs (one collective in a steady state), as states: their
        results are computed under the user's names (``_results``), not the parts'."""
        as_timeout(self.timeout)  # a bad timeout raises even where nothing syncs
        reporter = self._reporter
        reporter.reset()
        reporter.sum(window_key("r", "rejected"), float(self._num_rejected))
        reporter.merge(self._encoded())  # folds the count too: the reporter holds no records
        if self.sync and should_sync(self.group):
            return reporter._synced_step(self.group, self.timeout).states()
        return dict(reporter.state().metrics)

    def _results(self, states: Mapping[str, MetricState]) -> dict[str, float]:
        """The values of states under the user's names, as ``Tracker.compute`` reports
        them: with its check that two metrics report different keys (``x`` as dist
        reports ``x/p50``), and ``last``'s disagreement warning naming the metric.

        Raises:
            ValueError: two metrics report the same key.
        """
        if not states:
            return {}
        reporter = self._reporter
        return ReducedStep.from_states(states, reporter.kind).results(empty=reporter.empty)

    def reset(self) -> None:
        """Drop the open window without reporting it (no collective)."""
        self._clear()

    def state(self) -> TrackerState:
        """The open window on this process as one state, merged in time order (a
        replacing kind holds its latest value, with the window's non-finite count):
        what a driver merges across workers, as it merges their steps' states. No
        collective."""
        metrics = dict(self._merged.metrics)
        for name, (_, metric) in self._latest.items():
            metrics[name] = metric
        return TrackerState(dict(sorted(metrics.items())))

    def _report_rejected(self, decoded: Decoded) -> None:
        """Raise on every rank; the window stays open without the rejected calls."""
        message = self._rejected_message or (
            "log calls were rejected or dropped on another rank (its error names them)"
        )
        self._num_rejected, self._rejected_message = 0, ""
        raise RejectedInputError(
            f"Window: {decoded.num_rejected:g} step(s) of the window had rejected or dropped "
            f"calls (this rank: {message}); flush() reports the rest of the window"
        )

    def _encoded(self) -> TrackerState:
        """The open window as the reporter's metrics: each name under a key that says
        which part of the report it is (see ``rlmetrics._window_keys``)."""
        metrics: dict[str, MetricState] = {}
        for name, metric in self._merged.metrics.items():
            metrics[window_key("w", name)] = metric
        for name, (index, metric) in self._latest.items():
            kind = self.tracker.kind(metric.kind)
            nonfinite = metric.num_nonfinite  # the window's count, whatever step it is in
            metrics[window_key("w", name)] = empty_state(kind, nonfinite)
            if index >= 0:  # keyed by its age (steps before the window's last), so a
                # metric logged every step keeps one key however long the window is
                value = dataclasses.replace(metric, num_nonfinite=0.0)
                metrics[window_key(f"l{self._num_open - 1 - index}", name)] = value
        for index, state in enumerate(self._per_step):
            for name, metric in state.metrics.items():
                metrics[window_key(f"s{index}", name)] = metric
        return TrackerState(dict(sorted(metrics.items())))

    # -- checkpointing ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The open window (plain python and numpy), for a checkpoint."""
        latest = TrackerState({name: metric for name, (_, metric) in self._latest.items()})
        return {
            "version": WINDOW_VERSION,
            "num_steps": self.num_steps,
            "num_open": self._num_open,
            "merged": self._merged.to_dict(),
            "latest": latest.to_dict(),
            "latest_steps": {name: index for name, (index, _) in self._latest.items()},
            "per_step": [state.to_dict() for state in self._per_step],
            "num_rejected": self._num_rejected,
            "rejected_message": self._rejected_message,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore an open window saved by ``state_dict()`` (a resumed run continues
        it). ``every`` and ``per_step`` stay this window's.

        Raises:
            TypeError: ``state_dict`` is not a dict.
            MalformedStateError: (a ``ValueError``) the dict is not a window's
                ``state_dict()`` of this version, or is damaged: a key missing, unknown
                or of the wrong type, a metric that does not fit its kind (see
                ``Tracker.load_state_dict``); the message names the key and the metric.
                Everything is checked first: the window is left unchanged.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                "Window.load_state_dict(state_dict): expected the dict that "
                f"Window.state_dict() returns, got {type(state_dict).__name__}"
            )
        version = state_dict.get("version")
        if type(version) is not int or version != WINDOW_VERSION:
            raise MalformedStateError(
                f"malformed state_dict['version']: expected a Window.state_dict() of version "
                f"{WINDOW_VERSION}, got version {version!r}"
            )
        missing = sorted(_WINDOW_KEYS - state_dict.keys())
        unknown = sorted(map(repr, state_dict.keys() - _WINDOW_KEYS))
        if missing or unknown:
            raise MalformedStateError(
                f"malformed state_dict: not a Window.state_dict() (missing keys {missing}, "
                f"unknown keys {unknown})"
            )
        num_steps, num_open, num_rejected = (
            _count(state_dict, key) for key in ("num_steps", "num_open", "num_rejected")
        )
        message = state_dict["rejected_message"]
        if not isinstance(message, str):
            raise MalformedStateError(
                f"malformed state_dict['rejected_message']: expected a str, got "
                f"{type(message).__name__}"
            )
        merged = TrackerState.from_dict(state_dict["merged"], where="state_dict['merged']")
        latest = TrackerState.from_dict(state_dict["latest"], where="state_dict['latest']")
        saved_steps = state_dict["per_step"]
        if not isinstance(saved_steps, list) or len(saved_steps) > num_open:
            raise MalformedStateError(
                f"malformed state_dict['per_step']: expected a list of at most num_open="
                f"{num_open} states, got {saved_steps!r:.200}"
            )
        per_step = [
            TrackerState.from_dict(s, where=f"state_dict['per_step'][{i}]")
            for i, s in enumerate(saved_steps)
        ]
        steps = _latest_steps(state_dict["latest_steps"], latest, num_open)
        kinds = self._checked_kinds(merged, latest, per_step)
        self._clear()
        self.num_steps, self._num_open = num_steps, num_open
        self._merged = merged
        self._latest = {name: (steps[name], metric) for name, metric in latest.metrics.items()}
        if self._selected is not None:  # steps saved without per-step values: none
            self._per_step = [TrackerState()] * (num_open - len(per_step)) + per_step
        self._kinds = kinds
        self._num_rejected, self._rejected_message = num_rejected, message

    def _checked_kinds(
        self, merged: TrackerState, latest: TrackerState, per_step: list[TrackerState]
    ) -> dict[str, str]:
        """Each saved name's kind name, after checking every saved metric against the
        tracker's kinds: a replacing kind's state is in ``latest``, any other's in
        ``merged``, and a name keeps one kind in every part."""
        kinds: dict[str, str] = {}
        # (where, state, whether its kinds replace: None for a step's, which has both)
        parts: list[tuple[str, TrackerState, bool | None]] = [
            ("state_dict['merged']", merged, False),
            ("state_dict['latest']", latest, True),
        ]
        parts += [(f"state_dict['per_step'][{i}]", s, None) for i, s in enumerate(per_step)]
        for where, state, replacing in parts:
            for name, kind in checked_load(state, self.tracker.kind, where).items():
                at = f"malformed {where}['metrics'][{name!r}]"
                if replacing is not None and kind.keeps_latest != replacing:
                    belongs = "latest" if kind.keeps_latest else "merged"
                    raise MalformedStateError(
                        f"{at}: a {kind.name!r} state belongs in state_dict[{belongs!r}]"
                    )
                if kinds.setdefault(name, kind.name) != kind.name:
                    raise MalformedStateError(
                        f"{at}: kind {kind.name!r}, but {kinds[name]!r} elsewhere in the window"
                    )
        saved = merged.metrics.keys() | latest.metrics.keys()
        return {name: kind for name, kind in kinds.items() if name in saved}


_WINDOW_KEYS = frozenset(
    {
        "version",
        "num_steps",
        "num_open",
        "merged",
        "latest",
        "latest_steps",
        "per_step",
        "num_rejected",
        "rejected_message",
    }
)


def _count(state_dict: Mapping[str, Any], key: str) -> int:
    """``state_dict[key]``, checked to be an int >= 0."""
    value = state_dict[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedStateError(
            f"malformed state_dict[{key!r}]: expected an int >= 0, got {value!r:.200}"
        )
    return value


def _latest_steps(steps: object, latest: TrackerState, num_open: int) -> dict[str, int]:
    """Per replacing metric, the window's step its value is from (-1: none yet)."""
    where = "malformed state_dict['latest_steps']"
    if not isinstance(steps, Mapping) or steps.keys() != latest.metrics.keys():
        raise MalformedStateError(
            f"{where}: expected a step per metric of state_dict['latest'] "
            f"({sorted(latest.metrics)}), got {steps!r:.200}"
        )
    for name, step in steps.items():
        if isinstance(step, bool) or not isinstance(step, int) or not -1 <= step < num_open:
            raise MalformedStateError(
                f"{where}[{name!r}]: expected a step in [-1, num_open={num_open}), got {step!r}"
            )
    return dict(steps)


def _check_every(every: object) -> int | None:
    if every is None:
        return None
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"Window(every=...) must be an int >= 1 or None, got {every!r}")
    return every


def _selector(per_step: bool | Iterable[str]) -> Any:
    """A name -> bool test for ``per_step`` (None: no per-step values)."""
    if per_step is True:
        return lambda name: True
    if per_step is False or per_step is None:
        return None
    if isinstance(per_step, str):
        raise TypeError(
            f"Window(per_step=...) takes True or a collection of names, got the string "
            f"{per_step!r}; wrap it in a list"
        )
    names = frozenset(per_step)
    prefixes = tuple(name for name in names if name.endswith("/"))
    return lambda name: name in names or name.startswith(prefixes)


def _quantiles(tracker: Tracker) -> tuple[float, ...]:
    """The quantiles the tracker's ``dist`` reports, for the reporter to report too."""
    return tuple(tracker.kind("dist").quantiles)  # type: ignore[attr-defined]


__all__ = ["WINDOW_VERSION", "Window"]

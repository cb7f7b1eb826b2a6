"""Single-controller metrics: workers return ``tracker.state()``, the driver merges.

In a Ray trainer the driver owns the loop and a worker group of data-parallel ranks
does the work. Metrics can reach the driver two ways, with the same numbers:

* **collective**: the workers form a torch.distributed group and call
  ``tracker.compute()``; every worker returns the same dict.
* **driver merge**: every worker returns ``tracker.state()`` (small, picklable) next to
  its result; the driver merges the states with ``TrackerState.merge`` (the one merge
  used between micro-batches, ranks and containers) and computes the dict.

Given the states in rank order, the driver merge gives exactly what ``compute()`` over
the workers' group gives: the same keys, and every value bit for bit (the collective
adds the gathered states in rank order too). Only in groups too large for the one
gather (``rlmetrics._engine.sync.GATHER_LIMIT``) does the collective all-reduce, and then
sums over more than two workers may differ in the last bit (its own summation order).

Replicas (tensor/pipeline-parallel copies of a data-parallel rank) return the same
state as their source; mark them with ``replicas`` (one bool per worker, True: a copy)
so they are not counted twice.

Trust: states travel pickled, by Ray, between the driver and its own workers only;
this module unpickles nothing from outside the cluster.

Importing this module imports Ray; ``import rlmetrics`` never does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

try:
    import ray
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "rlmetrics.integrations.ray needs Ray, an optional extra: pip install 'rlmetrics[ray]'"
    ) from error

from rlmetrics.kinds.dist import DEFAULT_QUANTILES
from rlmetrics.state import TrackerState
from rlmetrics.tracker import EMPTY_POLICIES, Tracker

__all__ = [
    "call_and_merge",
    "collect",
    "compute_states",
    "init_ray",
    "merge_states",
    "with_metrics",
]


# -- driver side: merging ---------------------------------------------------------------
def merge_states(
    states: Sequence[TrackerState], replicas: Sequence[bool] | None = None
) -> TrackerState:
    """Merge workers' states, skipping replicas, with ``TrackerState.merge_all``.

    Args:
        states: one state per worker, in rank order (the order decides the last bits
            of std and of a dist's mean/std, exactly as rank order does in a collective).
        replicas: one bool per worker; True marks a tensor/pipeline-parallel copy whose
            state its source already contributes. None: no replicas.

    Raises:
        TypeError: a state is not a ``TrackerState`` (the message names its index).
        ValueError: ``replicas`` has the wrong length, or marks every worker; or a
            metric has different kinds in two states.
    """
    states = list(states)
    for index, state in enumerate(states):
        if not isinstance(state, TrackerState):
            raise TypeError(f"state {index} is a {type(state).__name__}, not a TrackerState")
    return TrackerState.merge_all(states, replicas)


def compute_states(
    states: TrackerState | Sequence[TrackerState],
    *,
    replicas: Sequence[bool] | None = None,
    empty: str = "omit",
    quantiles: Sequence[float] = DEFAULT_QUANTILES,
) -> dict[str, float]:
    """The dict ``Tracker(empty=..., quantiles=...).compute()`` over the group would give.

    Args:
        states: one merged state, or one state per worker in rank order.
        replicas: see ``merge_states``.
        empty: "omit" leaves empty metrics out; "nan" reports them as NaN.
        quantiles: the quantiles ``dist`` metrics report (the workers' Tracker's).

    Examples:
        >>> a, b = Tracker(), Tracker()
        >>> a.mean("loss", 1.0, weight=1.0); b.mean("loss", 3.0, weight=3.0)
        >>> compute_states([a.state(), b.state()])
        {'loss': 2.5}
    """
    if empty not in EMPTY_POLICIES:
        raise ValueError(
            f"compute_states(empty=...) must be one of {EMPTY_POLICIES}, got {empty!r}"
        )
    if isinstance(states, TrackerState):
        states = [states]
    return merge_states(states, replicas).compute(empty=empty, quantiles=quantiles)


# -- worker side ----------------------------------------------------------------------
def with_metrics(result: Any, tracker: Tracker, *, reset: bool = True) -> tuple[Any, TrackerState]:
    """What a worker method returns: ``(result, tracker.take_state())``: the step's
    state, and the tracker reset for the next step at once (``reset=False``:
    ``tracker.state()``, the tracker kept), so a call another thread logs meanwhile
    lands in this step or the next.

    Example (inside a Ray actor)::

        def train_step(self, batch):
            loss = self.update(batch, self.tracker)
            return with_metrics({"loss": loss}, self.tracker)

    Raises:
        ValueError: a tensor log call was rejected (see ``Tracker.state``); the tracker
            is not reset.
    """
    return result, tracker.take_state() if reset else tracker.state()


# -- driver side: worker groups -------------------------------------------------------
def call_and_merge(
    actors: Sequence[Any],
    method_name: str,
    *args: Any,
    replicas: Sequence[bool] | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> tuple[list[Any], TrackerState]:
    """Call ``method_name(*args, **kwargs)`` on every actor and merge their states.

    Each method returns ``(result, tracker_state)`` (see ``with_metrics``) or a bare
    ``TrackerState`` (its result is None). For per-worker arguments, submit the calls
    yourself and pass the refs to ``collect``.

    Returns:
        (results in actor order, the merged state): ``state.compute()`` or
        ``compute_states(state, quantiles=...)`` gives the dict.

    Raises:
        Exception: the first worker error, as Ray raises it (an instance of the
            worker's exception class when Ray can make one), with a note naming the
            worker index. Nothing is merged.
        TimeoutError: ``timeout`` seconds passed before every worker returned.
    """
    refs = [getattr(actor, method_name).remote(*args, **kwargs) for actor in actors]
    return collect(refs, replicas=replicas, timeout=timeout, what=repr(method_name))


def collect(
    refs: Sequence[Any],
    *,
    replicas: Sequence[bool] | None = None,
    timeout: float | None = None,
    what: str = "call",
) -> tuple[list[Any], TrackerState]:
    """Wait for one ObjectRef per worker, split each into (result, state), merge.

    Fails fast: the first worker error to arrive is raised at once (a worker blocked in
    a collective with the failed one would otherwise hold the driver until its
    timeout). See ``call_and_merge`` for the shapes, errors and return value.
    """
    outputs = _wait_all(list(refs), timeout, what)
    pairs = [_split_output(index, output) for index, output in enumerate(outputs)]
    return [result for result, _ in pairs], merge_states([s for _, s in pairs], replicas)


def _wait_all(refs: list[Any], timeout: float | None, what: str) -> list[Any]:
    deadline = None if timeout is None else time.monotonic() + timeout
    index_of = {ref: index for index, ref in enumerate(refs)}
    outputs: list[Any] = [None] * len(refs)
    pending = list(refs)
    while pending:
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready:
            missing = sorted(index_of[ref] for ref in pending)
            raise TimeoutError(
                f"rlmetrics.integrations.ray: {what} did not return within {timeout:g} s on "
                f"workers "
                f"{missing} of {len(refs)}"
            )
        index = index_of[ready[0]]
        try:
            outputs[index] = ray.get(ready[0])
        except Exception as error:
            error.add_note(
                f"rlmetrics.integrations.ray: raised by worker {index} of {len(refs)} in {what}"
            )
            raise
    return outputs


def _split_output(index: int, output: Any) -> tuple[Any, TrackerState]:
    if isinstance(output, TrackerState):
        return None, output
    if isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], TrackerState):
        return output
    raise TypeError(
        f"worker {index} returned a {type(output).__name__}; expected (result, TrackerState) "
        "or a TrackerState (see rlmetrics.integrations.ray.with_metrics)"
    )


# -- starting Ray -----------------------------------------------------------------------
def init_ray(address: str | None = None, *, num_cpus: int | None = None, **kwargs: Any) -> None:
    """Connect to a Ray cluster, or start a local one; nothing if Ray is already up.

    Args:
        address: a cluster to join ("auto", "ray://host:10001", ...); None uses
            ``RAY_ADDRESS`` when set, else starts Ray locally.
        num_cpus: CPUs of a local Ray (None: all); must be None with an address.
        kwargs: passed to ``ray.init`` (a local Ray also gets ``include_dashboard=False``
            unless given).

    Ray's own security defaults apply: a new local Ray enables token authentication
    (and writes ``~/.ray/auth_token``) unless ``RAY_AUTH_MODE`` says otherwise.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        if num_cpus is not None:
            raise ValueError(f"init_ray: num_cpus={num_cpus!r} cannot be set with an address")
        ray.init(address=address, **kwargs)
        return
    kwargs.setdefault("include_dashboard", False)
    ray.init(num_cpus=num_cpus, **kwargs)

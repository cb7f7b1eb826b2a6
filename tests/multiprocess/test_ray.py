"""rlmetrics.integrations.ray: the driver merge of worker states equals compute() over their group.

One local Ray (2 CPUs) for the whole module; its 2 actors form a real gloo group, so
one call returns both paths: each worker's collective ``compute()`` and its ``state()``.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch

from rlmetrics import Tracker, TrackerState

from gloo_ranks import free_port
from helpers import log_every_kind, run_python
from local_ray import local_ray

try:
    import ray
except ImportError:  # the import-guard test below still runs
    ray = None

needs_ray = pytest.mark.skipif(
    ray is None, reason="ray is not installed (pip install 'rlmetrics[ray]')"
)
WORLD = 2


# -- what each rank logs ---------------------------------------------------------------
def log_random(tracker: Tracker, rank: int, seed: int) -> None:
    """Every kind, a rank's random share in random micro-batches (some empty), large
    offsets (std exactness), masks, and names only some ranks or pieces log."""
    rng = np.random.default_rng(seed)
    size = 41
    value = rng.normal(1e3, 3.0, size)
    weight = rng.integers(0, 4, size).astype(np.float64)
    mask = rng.random(size) < 0.7
    share = np.array_split(rng.permutation(size), WORLD)[rank]
    cuts = np.sort(np.random.default_rng(seed + 1 + rank).integers(0, len(share) + 1, 3))
    batch = {"value": value, "weight": weight, "mask": mask}
    for piece in np.split(share, cuts):
        log_every_kind(tracker, batch, piece)
        for i in piece[:2].tolist():
            tracker.mean("m/floats", float(value[i]), weight=float(weight[i]))
    if rank == 0:
        tracker.max("only/rank0", float(seed))
        tracker.std("only/rank0_std", torch.from_numpy(value[:5]))


def log_edges(tracker: Tracker, rank: int, seed: int) -> None:
    """NaN in max/min, `last` disagreement, empty metrics, names on one rank only."""
    tracker.max("nan/max", torch.tensor([1.0, math.nan]) if rank == 1 else 5.0)
    tracker.min("nan/min", math.nan if rank == 0 else 1.0)
    tracker.mean("nan/mean", torch.tensor([1.0, math.inf if rank else 2.0]))
    tracker.last("last/agree", 1e-3)
    tracker.last("last/disagree", 0.1 * (rank + 1))
    tracker.mean("empty/mean", torch.ones(3), weight=torch.zeros(3))
    tracker.dist("empty/dist", torch.ones(3), mask=torch.zeros(3, dtype=torch.bool))
    if rank == 0:
        tracker.max("empty/max_rank0", torch.ones(2), mask=torch.zeros(2))
    if rank == 1:
        tracker.sum("empty/sum_rank1", 1.0, mask=0.0)
        tracker.sum("one/sum", torch.arange(4.0))
        tracker.dist("one/dist", torch.arange(7.0) * seed)
    tracker.dist("both/dist", torch.tensor([3.0, 1.0]) + rank)


def log_replicated(tracker: Tracker, rank: int, seed: int) -> None:
    """Every rank logs the same data (tensor-parallel copies of one data-parallel rank)."""
    tracker.sum("tokens", 10.0)
    tracker.mean("loss", torch.tensor([1.0, 2.0, 4.0]))
    tracker.dist("len", torch.tensor([5.0, 1.0]))


SCENARIOS: dict[str, Callable[[Tracker, int, int], None]] = {
    "random": log_random,
    "edges": log_edges,
    "replicated": log_replicated,
}


class Worker:
    """A data-parallel rank: a gloo group with its peers, a fresh Tracker per call."""

    def __init__(self, rank: int, world: int, port: int) -> None:
        import torch.distributed as tdist

        torch.set_num_threads(1)
        tdist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        self.rank = rank

    def ready(self) -> int:
        return self.rank

    def step(self, scenario: str, seed: int, options: dict) -> tuple[dict, TrackerState]:
        """Both paths at once: (collective compute() over the group, this rank's state)."""
        from rlmetrics.integrations.ray import with_metrics

        tracker = Tracker(**options)
        SCENARIOS[scenario](tracker, self.rank, seed)
        collective = tracker.compute(reset=False, timeout=30)
        return with_metrics(collective, tracker)

    def fail(self, failing_rank: int, others_sleep: float = 0.0) -> tuple[int, TrackerState]:
        tracker = Tracker()
        tracker.sum("calls", 1.0)
        if self.rank == failing_rank:
            raise ValueError(f"boom on rank {self.rank}")
        time.sleep(others_sleep)
        return self.rank, tracker.state()

    def sleep(self, seconds: float) -> TrackerState:
        time.sleep(seconds)
        return TrackerState()

    def bad_output(self) -> dict:
        return {"rank": self.rank}


# -- helpers ---------------------------------------------------------------------------
def assert_bitwise(actual: dict[str, float], expected: dict[str, float]) -> None:
    """Same keys in the same order, every value the same float64 (NaN equals NaN)."""
    assert list(actual) == list(expected)
    for key, value in expected.items():
        got = actual[key]
        same = (math.isnan(got) and math.isnan(value)) or struct.pack("<d", got) == struct.pack(
            "<d", value
        )
        assert same, (key, got, value)


def both_paths(
    actors: list, scenario: str, seed: int = 0, **options: Any
) -> tuple[dict, list[TrackerState], list]:
    """(the collective result, the workers' states in rank order, every output)."""
    from rlmetrics.integrations.ray import collect

    refs = [actor.step.remote(scenario, seed, options) for actor in actors]
    collectives, _ = collect(refs, timeout=120)
    states = [ray.get(ref)[1] for ref in refs]
    assert all(c == collectives[0] or _nan_equal(c, collectives[0]) for c in collectives)
    return collectives[0], states, collectives


def _nan_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a
    )


# -- the Ray session -------------------------------------------------------------------
@pytest.fixture(scope="module")
def actors() -> Iterator[list]:
    """The module's local Ray, with WORLD actors forming a gloo group."""
    with local_ray(num_cpus=2):
        worker = ray.remote(num_cpus=1)(Worker)
        port = free_port()
        handles = [worker.remote(rank, WORLD, port) for rank in range(WORLD)]
        ray.get([h.ready.remote() for h in handles], timeout=180)
        yield handles


@needs_ray  # runs before the module's Ray starts
def test_init_ray_refuses_num_cpus_with_an_address() -> None:
    from rlmetrics.integrations.ray import init_ray

    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process")
    with pytest.raises(ValueError, match="num_cpus=2 cannot be set with an address"):
        init_ray("auto", num_cpus=2)


# -- tests with actors -----------------------------------------------------------------
@needs_ray
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_driver_merge_equals_gloo_compute(actors: list, seed: int) -> None:
    from rlmetrics.integrations.ray import compute_states

    collective, states, _ = both_paths(actors, "random", seed)
    assert "only/rank0" in collective and "m/dist/p99" in collective
    assert_bitwise(compute_states(states), collective)
    one_process = Tracker()  # and both equal one process logging everything
    for rank in range(WORLD):
        log_random(one_process, rank, seed)
    for key, value in one_process.compute(sync=False).items():
        assert math.isclose(collective[key], value, rel_tol=1e-12, abs_tol=1e-9), key


@needs_ray
@pytest.mark.parametrize(
    "options",
    [{}, {"empty": "nan", "quantiles": (0.0, 0.25, 1.0)}, {"nonfinite": "skip"}],
    ids=["default", "empty-nan", "nonfinite-skip"],
)
def test_edge_cases_match_collective(
    actors: list, options: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlmetrics.integrations.ray import compute_states
    from rlmetrics.kinds import last

    monkeypatch.setattr(last, "_warned", set())  # a disagreement warns once until it ends
    with pytest.warns(RuntimeWarning, match="last/disagree"):
        collective, states, _ = both_paths(actors, "edges", 3, **options)
        kwargs = {k: v for k, v in options.items() if k != "nonfinite"}
        driver = compute_states(states, **kwargs)
    assert_bitwise(driver, collective)
    assert driver["last/agree"] == 1e-3
    assert math.isclose(driver["last/disagree"], 0.15)  # the mean, with a warning
    assert "one/sum" in driver and "both/dist/mean" in driver
    if options.get("nonfinite") == "skip":
        assert driver["nan/max"] == 5.0 and driver["nan/max/nonfinite_count"] == 1.0
        assert driver["nan/min"] == 1.0 and driver["nan/mean"] == 4.0 / 3.0
    else:
        assert math.isnan(driver["nan/max"]) and math.isnan(driver["nan/min"])
        assert driver["nan/mean"] == math.inf
    empty = [k for k in driver if k.startswith("empty/")]
    if options.get("empty") == "nan":
        assert all(math.isnan(driver[k]) for k in empty) and "empty/dist/p25" in empty
    else:
        assert empty == []


@needs_ray
def test_replicas_are_counted_once(actors: list) -> None:
    from rlmetrics.integrations.ray import call_and_merge, compute_states

    collective, states, _ = both_paths(actors, "replicated")
    assert collective["tokens"] == 20.0  # the collective over copies counts twice
    driver = compute_states(states, replicas=[False, True])
    assert driver == compute_states(states[:1])
    assert driver["tokens"] == 10.0 and driver["loss"] == 7.0 / 3.0
    assert (driver["len/mean"], driver["len/std"], driver["len/p50"]) == (3.0, 2.0, 3.0)
    results, state = call_and_merge(actors, "step", "replicated", 0, {}, replicas=[True, False])
    assert [r["tokens"] for r in results] == [20.0, 20.0]  # every result comes back
    assert state.compute() == driver


@needs_ray
def test_raising_worker_raises_its_error(actors: list) -> None:
    from rlmetrics.integrations.ray import call_and_merge

    start = time.monotonic()
    with pytest.raises(ValueError, match="boom on rank 1") as info:
        call_and_merge(actors, "fail", 1, others_sleep=3.0)
    assert time.monotonic() - start < 2.9  # fails fast, does not wait for worker 0
    assert any("worker 1 of 2" in note and "'fail'" in note for note in info.value.__notes__)
    results, state = call_and_merge(actors, "fail", -1, timeout=60)  # the group still works
    assert results == [0, 1] and state.compute() == {"calls": 2.0}


@needs_ray
def test_bad_output_and_timeout(actors: list) -> None:
    from rlmetrics.integrations.ray import call_and_merge

    with pytest.raises(TypeError, match=r"worker 0 returned a dict; expected \(result"):
        call_and_merge(actors, "bad_output")
    with pytest.raises(
        TimeoutError, match=r"'sleep' did not return within 0.2 s on workers \[0, 1\]"
    ):
        call_and_merge(actors, "sleep", 1.0, timeout=0.2)


# -- tests without actors --------------------------------------------------------------
def states_of(*loggers: Callable[[Tracker], None]) -> list[TrackerState]:
    out = []
    for log in loggers:
        tracker = Tracker()
        log(tracker)
        out.append(tracker.state())
    return out


@needs_ray
def test_merge_states_checks_its_inputs() -> None:
    from rlmetrics.integrations.ray import compute_states, merge_states

    a, b = states_of(lambda t: t.mean("x", 1.0), lambda t: t.max("x", 2.0))
    with pytest.raises(ValueError, match="metric 'x' is kind 'mean' in one state and 'max'"):
        merge_states([a, b])
    with pytest.raises(TypeError, match="state 1 is a dict, not a TrackerState"):
        merge_states([a, {"x": 1.0}])
    with pytest.raises(ValueError, match="replicas has 1 entries for 2 states"):
        merge_states([a, b], replicas=[True])
    with pytest.raises(ValueError, match="every state is marked as a replica"):
        merge_states([a, a], replicas=[True, True])
    with pytest.raises(ValueError, match=r"empty=\.\.\.\) must be one of"):
        compute_states([a], empty="zero")
    assert compute_states([]) == {} and merge_states([]) == TrackerState()
    assert compute_states(a) == {"x": 1.0}
    assert merge_states([a, b], replicas=[False, True]) == a


def test_import_rlmetrics_never_imports_ray() -> None:
    code = (
        "import sys\n"
        "import rlmetrics, rlmetrics.tracker, rlmetrics.state\n"
        "assert 'ray' not in sys.modules, 'import rlmetrics imported ray'\n"
        "sys.modules['ray'] = None  # as if ray were not installed\n"
        "try:\n"
        "    import rlmetrics.integrations.ray\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert "pip install 'rlmetrics[ray]'" in out.stdout

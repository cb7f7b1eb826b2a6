"""A training step with and without rlmetrics, inside TRL's and verl's own loops (CPU).

Run from the repository root (about 6 minutes on 2 cores; needs ``make .venv-trl/.ready
.venv-verl/.ready``):

    .venv/bin/python benchmarks/framework_overhead.py

Two contests, each part in its framework's venv (a subprocess, this tree's ``src``
first on PYTHONPATH, ``OMP_NUM_THREADS=1``):

* TRL: ``ExactGRPOTrainer`` against ``trl.GRPOTrainer``, TRL's own ``train()`` on the
  tests' tiny Qwen2 (``tests/integrations/trl/grpo_runs.py``: 8 completions per step,
  beta=0.04, num_iterations=2, a log every step), on 1 process (split 4x2) and on 2
  (torchrun, gloo; split 2x2). One launch per process count runs ``--rounds`` rounds of
  one run per trainer, the order swapped each round (plain, exact, exact, plain...).
  A step is the time from one ``on_step_begin`` to the next (a ``TrainerCallback``): the
  generation, the micro-batches, the optimizer step and the step's ``log()``; the first
  ``--warmup`` steps of each run are left out, ``--steps`` are kept.
* verl: ``update_actor`` of verl 0.9.1's ``ActorRolloutRefWorker(role="actor")`` on 2
  gloo ranks, as the verl suite runs it (``tests/integrations/verl/scenarios.py``: the
  tiny Qwen2, lr 0). The ranks start with ``VERL_USE_EXTERNAL_PLUGINS=none``: verl
  alone builds the first actor; then the integration is imported (``enable()``) and a
  second actor is built, an ``ExactTrainingWorker`` inside. The two actors update the
  same batch in turn (order swapped each round) for ``--warmup`` + ``--updates``
  rounds; each update's wall time on rank 0, after a barrier. Their ``actor/pg_loss``
  must agree (the same work is done). Inside the exact actor's updates the plugin's own
  work is timed too (its log calls and ``Tracker.compute_state``, see ``PluginClock``).

Each contender's median step (wall and process CPU time) over its kept steps, and the
ratio rlmetrics / framework alone: for TRL, of the median steps; for verl, whose rounds
pair one update of each on the same batch back to back, the median of the per-round
ratios (the ratio of the median updates is given beside it). Targets (issue 30): at
most 1.00 for TRL at 2 processes (ExactGRPOTrainer issues fewer collectives and host
reads), at most 1.02 for verl. ``--only trl`` or ``--only verl`` runs one part (its
own venv's python is used when it is the running one); ``--no-write`` prints without
writing RESULTS.md.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import json
import os
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRL_TESTS = ROOT / "tests" / "integrations" / "trl"
VERL_TESTS = ROOT / "tests" / "integrations" / "verl"
SUPPORT = ROOT / "tests" / "_support"
START, END = "<!-- framework_overhead:start -->", "<!-- framework_overhead:end -->"

TRL_SPLITS = {1: (4, 2), 2: (2, 2)}
"""Per process count, (per-device batch, accumulation steps) of the 8 completions."""
TRL_OPTIONS = {"beta": 0.04, "num_iterations": 2}
TARGETS = {("TRL", 1): None, ("TRL", 2): 1.00, ("verl", 2): 1.02}
"""Largest ratio rlmetrics / framework alone accepted (None: measured, no target)."""
VERL_SPLIT = "micro2"
"""The verl suite's split (scenarios.SPLITS) each update runs: micro-batches of 2."""


# ---------------------------------------------------------------- TRL, in .venv-trl


def trl_worker(job_path: str) -> None:
    """Run every run of the job in this process (one rank of the launch) and save this
    rank's step times: ``<out>/rank<r>.json``, one entry per run."""
    sys.path.insert(0, str(TRL_TESTS))
    import warnings

    import grpo_runs
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        PreTrainedTokenizerFast,
        TrainerCallback,
    )
    from trl import GRPOTrainer

    from rlmetrics.integrations.trl import ExactGRPOTrainer

    class StepClock(TrainerCallback):  # type: ignore[misc]
        """Wall and process CPU time at each ``on_step_begin``: a step is the span to
        the next one (the step's log included)."""

        def __init__(self) -> None:
            self.wall: list[float] = []
            self.cpu: list[float] = []

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.wall.append(time.perf_counter())
            self.cpu.append(time.process_time())

    job = json.loads(Path(job_path).read_text())
    model_dir = Path(job["model_dir"])
    out = []
    for run in job["runs"]:
        spec = grpo_runs.RunSpec(
            run["trainer"],
            run["per_device"],
            run["accumulation"],
            TRL_OPTIONS,
            max_steps=job["warmup"] + job["steps"] + 1,  # the last step ends the one before
        )
        base = ExactGRPOTrainer if spec.trainer == "exact" else GRPOTrainer
        prompts = grpo_runs.PROMPTS * 4
        clock = StepClock()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = base(
                model=AutoModelForCausalLM.from_pretrained(model_dir),
                reward_funcs=[grpo_runs.reward_vowels, grpo_runs.reward_short],
                args=grpo_runs.make_config(spec, str(Path(job["out"]) / "trainer")),
                train_dataset=Dataset.from_dict({"prompt": prompts}),
                processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir),
                callbacks=[clock],
            )
            trainer.train()
        kept = {key: getattr(clock, key)[job["warmup"] :] for key in ("wall", "cpu")}
        out.append({**run, **{key: per_step(times) for key, times in kept.items()}})
    rank = int(os.environ.get("RANK", "0"))
    (Path(job["out"]) / f"rank{rank}.json").write_text(json.dumps(out))
    grpo_runs.leave()


def per_step(stamps: list[float]) -> list[float]:
    """Seconds per step from each pair of steps: the time between every second
    ``on_step_begin``, halved. With num_iterations=2 one step of a pair generates and
    the other reuses the generations, so single steps fall into two groups and their
    median would sit between them; each pair holds one of each."""
    cycle = TRL_OPTIONS["num_iterations"]
    return [(b - a) / cycle for a, b in zip(stamps[::cycle], stamps[cycle::cycle], strict=False)]


def trl_order(rounds: int) -> list[str]:
    """Runs in a launch: a round per trainer pair, the order swapped each round."""
    pairs = [("plain", "exact") if r % 2 == 0 else ("exact", "plain") for r in range(rounds)]
    return [trainer for pair in pairs for trainer in pair]


def trl_timeout(runs: int, args: argparse.Namespace) -> float:
    """Seconds a launch of ``runs`` runs may take before it is killed: far more than a
    run needs on 2 shared cores (about 3 s a step, and a start), so that only a hang
    reaches it."""
    return 300.0 + runs * (60.0 + 30.0 * (args.warmup + args.steps + 1))


def trl_part(args: argparse.Namespace, python: str, tmp: Path) -> dict[str, Any]:
    """Both process counts (one launch each): per count, each trainer's step times."""
    sys.path.insert(0, str(TRL_TESTS))
    import grpo_runs

    env = _child_env(tmp)
    model_dir = tmp / "model"
    build = "import grpo_runs, sys; from pathlib import Path; "
    build += "grpo_runs.build_model_dir(Path(sys.argv[1]))"
    subprocess.run([python, "-c", build, str(model_dir)], env=env, check=True)
    results: dict[str, Any] = {"versions": _versions(python, env, "trl"), "runs": {}}
    for processes in args.processes:
        out = tmp / f"trl{processes}"
        out.mkdir()
        per_device, accumulation = TRL_SPLITS[processes]
        runs = [
            {"trainer": t, "per_device": per_device, "accumulation": accumulation}
            for t in trl_order(args.rounds)
        ]
        job = {"model_dir": str(model_dir), "out": str(out), "runs": runs}
        job |= {"warmup": args.warmup, "steps": args.steps}
        (out / "job.json").write_text(json.dumps(job))
        worker = [str(Path(__file__).resolve()), "--trl-worker", str(out / "job.json")]
        if processes == 1:
            command = [python, *worker]
        else:
            command = [
                *(python, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)),
                *("--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *worker),
            ]
        done = grpo_runs.run_launch(command, env, timeout=trl_timeout(len(runs), args))
        if done.returncode != 0:
            raise RuntimeError(f"TRL, {processes} processes:\n{done.stderr[-4000:]}")
        results["runs"][processes] = json.loads((out / "rank0.json").read_text())
    return results


# ---------------------------------------------------------------- verl, in .venv-verl


class PluginClock:
    """The plugin's own work inside each update of the exact actor, timed on the way:
    its log calls (``losses.log_micro_batch``, once per micro-batch) and the step's
    ``Tracker.compute_state``, which ``ExactTrainingWorker.train_mini_batch`` calls (the
    merge across ranks included, so a wait for the other rank is counted too). Two
    clock reads per timed call."""

    def __init__(self, worker: Any) -> None:
        from rlmetrics.integrations.verl import losses

        self.parts = {"log calls": 0.0, "compute": 0.0}
        self.samples: dict[str, list[float]] = {name: [] for name in self.parts}
        losses.log_micro_batch = self._timed(losses.log_micro_batch, "log calls")
        tracker = worker.metrics_tracker
        tracker.compute_state = self._timed(tracker.compute_state, "compute")

    def _timed(self, func: Any, part: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                self.parts[part] += time.perf_counter() - start

        return timed

    def end_update(self, keep: bool) -> None:
        for part, seconds in self.parts.items():
            if keep:
                self.samples[part].append(seconds)
            self.parts[part] = 0.0


def verl_rank(rank: int, world_size: int, port: int, model_path: str, settings: dict) -> dict:
    """One gloo rank (under ``gloo_ranks.run_ranks``): verl's actor, then the exact one,
    updating the same batch in turn; this rank's seconds per update of each."""
    import torch.distributed as dist
    from scenarios import (
        SPLITS,
        build_actor,
        driver_reduce,
        init_rank,
        make_batch,
        rank_slice,
        update_input,
    )

    init_rank(rank, world_size, port)
    loaded_by_verl = "rlmetrics.integrations.verl" in sys.modules
    actor_path = os.path.join(model_path, "actor")
    actors = {"verl": build_actor(actor_path)}
    import rlmetrics.integrations.verl as integration

    integration.enable()
    actors["rlmetrics"] = build_actor(actor_path)
    own = PluginClock(actors["rlmetrics"].actor)
    classes = {name: type(actor.actor).__name__ for name, actor in actors.items()}
    batch = rank_slice(make_batch(rows=settings["rows"]), rank, world_size)
    split = SPLITS[settings["split"]]
    times: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in actors}
    losses: dict[str, list[float]] = {name: [] for name in actors}
    profiles = {name: cProfile.Profile() for name in actors}
    profiling = settings["profile"] and rank == 0
    for index in range(settings["warmup"] + settings["updates"]):
        order = ("verl", "rlmetrics") if index % 2 == 0 else ("rlmetrics", "verl")
        for name in order:
            data = update_input(batch, split, world_size)
            dist.barrier()
            if profiling:
                profiles[name].enable()
            wall, cpu = time.perf_counter(), time.process_time()
            output = actors[name].update_actor(data)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if profiling:
                profiles[name].disable()
            if index >= settings["warmup"]:
                times[name]["wall"].append(wall)
                times[name]["cpu"].append(cpu)
            if name == "rlmetrics":
                own.end_update(keep=index >= settings["warmup"])
            losses[name].append(driver_reduce(output, "actor/")["actor/pg_loss"])
    result = {"times": times, "losses": losses, "classes": classes, "plugin": loaded_by_verl}
    result["own"] = own.samples
    if profiling:
        result["profiles"] = {name: profile_text(p) for name, p in profiles.items()}
    return result


def profile_text(profile: cProfile.Profile, top: int = 25) -> str:
    """The functions with the most cumulative time, then rlmetrics' own."""
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text).sort_stats("cumulative")
    stats.print_stats(top)
    stats.print_stats("rlmetrics", top)
    return text.getvalue()


def verl_worker(settings_path: str) -> None:
    """The verl part, in .venv-verl: 2 spawned gloo ranks; rank 0's times to JSON."""
    for folder in (SUPPORT, VERL_TESTS):
        sys.path.insert(0, str(folder))
    from scenarios import make_models

    from rlmetrics.distributed import free_port

    from gloo_ranks import ok_results, run_ranks

    settings = json.loads(Path(settings_path).read_text())
    model_path = os.path.join(settings["out"], "models")
    make_models(model_path)
    outcome = run_ranks(
        verl_rank, 2, free_port(), model_path, settings, timeout=1200.0, pg_timeout=600.0
    )
    results = ok_results(outcome)
    Path(settings["out"], "verl.json").write_text(json.dumps(results[0]))


def verl_part(args: argparse.Namespace, python: str, tmp: Path) -> dict[str, Any]:
    env = {**_child_env(tmp), "VERL_USE_EXTERNAL_PLUGINS": "none"}
    settings = {"out": str(tmp), "warmup": args.warmup, "updates": args.updates}
    settings |= {"rows": args.verl_rows, "split": VERL_SPLIT, "profile": args.profile}
    (tmp / "verl_settings.json").write_text(json.dumps(settings))
    command = [python, str(Path(__file__).resolve()), "--verl-worker"]
    done = subprocess.run(
        [*command, str(tmp / "verl_settings.json")], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"verl:\n{done.stderr[-4000:]}")
    result = json.loads((tmp / "verl.json").read_text())
    result["versions"] = _versions(python, env, "verl")
    check_verl(result)
    for name, text in result.pop("profiles", {}).items():
        print(f"verl, rank 0, {name}: cProfile of every update_actor\n{text}")
    return result


def check_verl(result: dict[str, Any]) -> None:
    """The contest is fair: verl's actor was built without the plugin, the other with
    ``ExactTrainingWorker``, and both computed the same losses."""
    assert not result["plugin"], "the plugin was loaded despite VERL_USE_EXTERNAL_PLUGINS=none"
    assert result["classes"] == {"verl": "TrainingWorker", "rlmetrics": "ExactTrainingWorker"}
    for a, b in zip(result["losses"]["verl"], result["losses"]["rlmetrics"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), result["losses"]


# ---------------------------------------------------------------- the driver


def _child_env(tmp: Path) -> dict[str, str]:
    """This tree's ``src`` and the benchmark's folder first; caches in ``tmp``."""
    path = [str(ROOT / "src"), str(TRL_TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "OMP_NUM_THREADS": "1",
        "HOME": str(tmp),
        "TMPDIR": str(tmp),
        "HF_HOME": str(tmp / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_AUTH_MODE": "disabled",
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _versions(python: str, env: dict[str, str], framework: str) -> dict[str, str]:
    code = (
        f"import json, platform, torch, {framework}; print(json.dumps({{'python': "
        f"platform.python_version(), 'torch': torch.__version__, "
        f"'{framework}': {framework}.__version__}}))"
    )
    done = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _python_for(module: str, given: str | None, venv: str) -> str:
    """``given``, else this interpreter when it has ``module``, else the repo's venv."""
    if given:
        return given
    if importlib.util.find_spec(module) is not None:
        return sys.executable
    return str(ROOT / venv / "bin" / "python")


Row = tuple[str, int, str, str, dict[str, list[float]], dict[str, list[float]]]


def rows_of(results: dict[str, Any]) -> list[Row]:
    """(framework, processes, framework's contender, rlmetrics', its times, ours)."""
    rows: list[Row] = []
    for processes, runs in results.get("trl", {}).get("runs", {}).items():
        pooled: dict[str, dict[str, list[float]]] = {}
        for run in runs:
            times = pooled.setdefault(
                run["trainer"], {"wall": [], "cpu": [], "runs": [], "steps": 0}
            )
            times["steps"] += len(run["wall"]) * TRL_OPTIONS["num_iterations"]
            times["wall"] += run["wall"]
            times["cpu"] += run["cpu"]
            times["runs"].append(statistics.median(run["wall"]))
        contenders = ("GRPOTrainer", "ExactGRPOTrainer")
        rows.append(("TRL", int(processes), *contenders, pooled["plain"], pooled["exact"]))
    if "verl" in results:
        times = results["verl"]["times"]
        names = ("verl `update_actor`", "with the plugin")
        exact = {**times["rlmetrics"], "own": results["verl"].get("own", {})}
        rows.append(("verl", 2, *names, times["verl"], exact))
    return rows


def ratio(row: Row) -> float:
    """The contest's ratio, with / without rlmetrics: for TRL's runs, of the median
    steps; for verl's paired rounds (one update of each, back to back, on the same
    batch), the median of the per-round ratios, which the machine's drift between
    rounds (larger than the effect on 2 shared cores) leaves alone."""
    plain, exact = row[4], row[5]
    if "runs" in plain:
        return statistics.median(exact["wall"]) / statistics.median(plain["wall"])
    return paired_ratio(plain, exact)


def paired_ratio(plain: dict[str, list[float]], exact: dict[str, list[float]]) -> float:
    return statistics.median(e / p for e, p in zip(exact["wall"], plain["wall"], strict=True))


def table(rows: list[Row]) -> list[str]:
    head = (
        "| framework | processes | without rlmetrics | steps | median ms | CPU ms | "
        "with rlmetrics | steps | median ms | CPU ms | ratio | target | verdict |"
    )
    lines = [head, "|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        framework, processes, plain_name, exact_name, plain, exact = row
        target = TARGETS[framework, processes]
        r = ratio(row)
        cells = [framework, str(processes)]
        for name, times in ((plain_name, plain), (exact_name, exact)):
            cells += [name, str(times.get("steps", len(times["wall"])))]
            cells += [f"{1e3 * statistics.median(times[k]):.1f}" for k in ("wall", "cpu")]
        cells += [f"{r:.3f}", "-" if target is None else f"≤ {target:.2f}"]
        cells.append("-" if target is None else ("met" if r <= target else "missed"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def verdict(rows: list[Row]) -> list[str]:
    """One line per contest, from the numbers: the ratio, and by how much a target is
    missed; the spread of the per-run medians where there are runs."""
    lines = []
    for row in rows:
        framework, processes, plain_name, exact_name, plain, exact = row
        r, target = ratio(row), TARGETS[framework, processes]
        where = f"{framework}, {processes} process{'es' if processes > 1 else ''}"
        how = "median step" if "runs" in plain else "median of the per-round ratios"
        text = f"- {where}: {exact_name} / {plain_name} = {r:.3f} ({how})"
        if target is not None:
            if r <= target:
                text += f", target ≤ {target:.2f} met"
            else:
                text += f", target ≤ {target:.2f} missed by {100 * (r / target - 1):.1f}%"
        cpu = statistics.median(exact["cpu"]) / statistics.median(plain["cpu"])
        text += f"; CPU time ratio {cpu:.3f}"
        if "runs" in plain:
            spans = [
                f"{name} {', '.join(f'{1e3 * m:.0f}' for m in times['runs'])} ms"
                for name, times in ((plain_name, plain), (exact_name, exact))
            ]
            text += f"; per-run medians: {'; '.join(spans)}"
        else:  # paired rounds: the ratio of the median updates too
            medians = statistics.median(exact["wall"]) / statistics.median(plain["wall"])
            text += f"; ratio of the median updates {medians:.3f}"
        if exact.get("own"):
            parts = ", ".join(
                f"{part} {1e3 * statistics.median(times):.1f} ms"
                for part, times in exact["own"].items()
            )
            text += f"; the plugin's own work per update (medians, rank 0): {parts}"
        lines.append(text + ".")
    return lines


def markdown(results: dict[str, Any], args: argparse.Namespace, loads: tuple[str, str]) -> str:
    sys.path.insert(0, str(Path(__file__).parent))
    from results_md import machine

    versions = {**results.get("trl", {}).get("versions", {})}
    versions |= results.get("verl", {}).get("versions", {})
    detail = ", ".join(f"{k} {versions[k]}" for k in ("trl", "verl") if k in versions)
    parts = []
    if "trl" in results:
        splits = ", ".join(f"{TRL_SPLITS[n][0]}x{TRL_SPLITS[n][1]} on {n}" for n in args.processes)
        parts.append(
            f"TRL `--rounds {args.rounds} --warmup {args.warmup} --steps {args.steps}`, split "
            f"(per process x accumulation) {splits} process(es), 8 completions per step, "
            f"{', '.join(f'{k}={v}' for k, v in TRL_OPTIONS.items())}, a log every step"
        )
    if "verl" in results:
        parts.append(
            f"verl `--warmup {args.warmup} --updates {args.updates} --verl-rows "
            f"{args.verl_rows}`, split {VERL_SPLIT} (micro-batches of 2 sequences), lr 0"
        )
    settings = "; ".join(parts)
    rows = rows_of(results)
    return "\n".join(
        [
            START,
            "## framework_overhead: a training step with and without rlmetrics, inside TRL "
            "and verl (`benchmarks/framework_overhead.py`)",
            "",
            "TRL's own `train()` with `ExactGRPOTrainer` against `GRPOTrainer` (step: "
            "`on_step_begin` to the next, its `log()` included; runs interleaved), and "
            "verl's `update_actor` with the plugin against verl alone "
            "(`VERL_USE_EXTERNAL_PLUGINS=none`; updates interleaved), tiny Qwen2 on the CPU.",
            "",
            f"Machine: {machine(f'{detail}, OMP_NUM_THREADS=1, gloo', loads)}. "
            f"Settings: {settings}.",
            "",
            "Median wall ms per step (CPU ms: process time of rank 0), ratio = with / "
            "without rlmetrics (TRL: of the median steps; verl: the median of the "
            "per-round ratios, each round one update of each on the same batch):",
            "",
            *table(rows),
            "",
            *verdict(rows),
            END,
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("trl", "verl"))
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], choices=(1, 2))
    parser.add_argument("--rounds", type=int, default=5, help="TRL runs per trainer")
    parser.add_argument("--steps", type=int, default=20, help="kept steps per TRL run (even)")
    parser.add_argument("--warmup", type=int, default=4, help="steps or updates left out")
    parser.add_argument("--updates", type=int, default=120, help="kept verl updates each")
    parser.add_argument("--verl-rows", type=int, default=16, help="sequences per update")
    parser.add_argument("--trl-python")
    parser.add_argument("--verl-python")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print verl's cProfile")
    parser.add_argument("--raw", help="also write every step time to this JSON file")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    parser.add_argument("--verl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps % TRL_OPTIONS["num_iterations"]:
        parser.error(f"--steps must be a multiple of {TRL_OPTIONS['num_iterations']}")
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    if args.verl_worker:
        return verl_worker(args.verl_worker)
    sys.path.insert(0, str(Path(__file__).parent))
    from results_md import load, write_section

    before = load()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "trl"):
            python = _python_for("trl", args.trl_python, ".venv-trl")
            (Path(tmp) / "trl").mkdir()
            results["trl"] = trl_part(args, python, Path(tmp) / "trl")
        if args.only in (None, "verl"):
            python = _python_for("verl", args.verl_python, ".venv-verl")
            (Path(tmp) / "verl").mkdir()
            results["verl"] = verl_part(args, python, Path(tmp) / "verl")
    if args.raw:
        Path(args.raw).write_text(json.dumps(results))
    text = markdown(results, args, (before, load()))
    print(text)
    if not args.no_write:
        write_section(text, START, END)


if __name__ == "__main__":
    main()

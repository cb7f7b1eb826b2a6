"""Collectives and host reads per logged step: trl.GRPOTrainer against ExactGRPOTrainer.

    .venv-trl/bin/python benchmarks/trl_syncs.py     # (make .venv-trl/.ready first)

Two processes (torchrun, gloo on 127.0.0.1) train the tests' tiny Qwen2 for 2 steps of
8 completions (beta=0.04, num_iterations=2, logging every step) at splits 4x1, 2x2 and
1x4 per process. Every torch.distributed collective and every host read of a tensor
(``item``, ``tolist``, ``bool``/``float``/``int`` of a tensor, ``numpy``, ``cpu``) is
counted by the trainer method it ran in: the loss (``_compute_loss``, once per
micro-batch), generation and scoring (once per generation batch), ``log``, and the rest
(transformers' Trainer: its NaN check of each micro-batch's loss, the loss gather per
log, the gradient norm). Counts are rank 0's, per logged step. On a CPU a host read
costs no device sync; on a GPU each one waits for the device.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "tests" / "integrations" / "trl"
sys.path.insert(0, str(RUNS))
sys.path.insert(0, str(Path(__file__).parent))

import grpo_runs  # noqa: E402, I001
from results_md import write_section  # noqa: E402

SPLITS = [(4, 1), (2, 2), (1, 4)]
STEPS = 4
OPTIONS = {"beta": 0.04, "num_iterations": 2}
PHASES = ("loss", "forward", "generation", "log", "other")
START, END = "<!-- trl_syncs:start -->", "<!-- trl_syncs:end -->"


def launch(out: Path) -> list[dict]:
    """One torchrun launch running every spec; rank 0's results, in spec order."""
    specs = [
        grpo_runs.RunSpec(trainer, p, a, OPTIONS, max_steps=STEPS)
        for trainer in ("plain", "exact")
        for p, a in SPLITS
    ]
    (out / "specs.json").write_text(json.dumps([vars(spec) for spec in specs]))
    model_dir = grpo_runs.build_model_dir(out / "model")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"),
        *("--master_addr", "127.0.0.1", "--master_port", str(port), str(RUNS / "run_dist.py")),
        *(str(out / "specs.json"), str(model_dir), str(out)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(out), "HF_HUB_OFFLINE": "1"}
    done = grpo_runs.run_launch(command, env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the TRL launch failed:\n{done.stderr[-4000:]}")
    return [grpo_runs.load(out / f"{i}-rank0.json") for i in range(len(specs))]


def table(results: list[dict]) -> str:
    """Per logged step, by phase: collectives / host reads. ``log()``'s column splits the
    first call (which agrees on the metric schema) from the later ones."""
    head = ["trainer", "split", *PHASES[:-2], "log() first", "log() later", "other"]
    rows = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for result in results:
        spec, counts = result["spec"], result["counts"]
        steps = spec["max_steps"]
        cells = ["GRPOTrainer" if spec["trainer"] == "plain" else "ExactGRPOTrainer"]
        cells.append(f"{spec['per_device']}x{spec['accumulation']}")
        for phase in PHASES[:-2]:
            cells.append(_pair(counts, phase, steps))
        training_logs = result["log_counts"][:steps]  # the last call is the run summary
        cells.append(_pair(training_logs[0], "log", 1))
        later = training_logs[1:]
        cells.append(" ".join(sorted({_pair(c, "log", 1) for c in later})))
        cells.append(_pair(counts, "other", steps))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


DRIFT_KEYS = (
    "entropy",
    "kl",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "loss",
)


def drift(results: list[dict]) -> str:
    """Steps 1 and 2 of the same runs: GRPOTrainer's value per split, ExactGRPOTrainer's
    (one value: equal for every split, which the tests assert to 1e-6)."""
    splits = [f"{p}x{a}" for p, a in SPLITS]
    plain = {_split(r): r["logs"] for r in results if r["spec"]["trainer"] == "plain"}
    exact = next(r["logs"] for r in results if r["spec"]["trainer"] == "exact")
    head = ["key", "step", *(f"GRPOTrainer {s}" for s in splits), "ExactGRPOTrainer (all)"]
    rows = ["| " + " | ".join(head) + " |", "|---|---:|" + "---:|" * (len(head) - 2)]
    for step in (1, 2):
        for key in DRIFT_KEYS:
            cells = [f"`{key}`", str(step)]
            cells += [f"{plain[s][step - 1][key]:.6f}" for s in splits]
            cells.append(f"{exact[step - 1][key]:.6f}")
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def reading(results: list[dict]) -> str:
    """The loss phase's collectives per logged step of each trainer, and the largest
    difference between splits of the same logged value, per trainer."""
    parts = []
    for trainer, label in (("plain", "GRPOTrainer"), ("exact", "ExactGRPOTrainer")):
        mine = [r for r in results if r["spec"]["trainer"] == trainer]
        loss = sorted(
            {r["counts"].get("loss/collectives", 0) / r["spec"]["max_steps"] for r in mine}
        )
        spread, where = 0.0, "-"
        for step in (1, 2):
            for key in DRIFT_KEYS:
                values = [r["logs"][step - 1][key] for r in mine]
                if max(values) - min(values) > spread:
                    spread, where = max(values) - min(values), f"`{key}` step {step}"
        span = f"{loss[0]:g}" if len(loss) == 1 else f"{loss[0]:g} to {loss[-1]:g}"
        parts.append(
            f"{label}: {span} "
            f"collectives per logged step in the loss, largest difference between splits "
            f"{spread:.2g} ({where})"
        )
    return "; ".join(parts) + "."


def _split(result: dict) -> str:
    return f"{result['spec']['per_device']}x{result['spec']['accumulation']}"


def _pair(counts: dict, phase: str, steps: int) -> str:
    collectives = counts.get(f"{phase}/collectives", 0) / steps
    reads = counts.get(f"{phase}/host_reads", 0) / steps
    return f"{collectives:g} / {reads:g}"


def main() -> None:
    import torch
    import trl

    with tempfile.TemporaryDirectory() as tmp:
        results = launch(Path(tmp))
    text = "\n".join(
        [
            START,
            "## trl_syncs: metric syncs of TRL's GRPOTrainer and ExactGRPOTrainer "
            "(`benchmarks/trl_syncs.py`)",
            "",
            "Collectives and host reads (a tensor's `item`, `tolist`, `bool`/`float`/`int`, "
            "`cpu`: each a device sync on a GPU) per logged step of rank 0, by trainer "
            "phase, and the logged values, at three splits of the same batch.",
            "",
            f"Machine: {os.cpu_count()} CPUs (nproc), {platform.machine()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}, trl {trl.__version__}, "
            f"2 processes (torchrun, gloo on 127.0.0.1), {date.today()}. Settings: "
            f"{STEPS} steps of 8 completions, split = per process x accumulation steps, "
            "beta=0.04, num_iterations=2, a log every step.",
            "",
            "Cells: collectives / host reads. loss: `_compute_loss` without the model's "
            "forward; forward: the model's; generation: `_generate_and_score_completions` "
            "without its forwards; other: transformers' Trainer.",
            "",
            table(results),
            "",
            "Logged values at steps 1 and 2, per split:",
            "",
            drift(results),
            "",
            reading(results),
            END,
        ]
    )
    print(text)
    write_section(text, START, END)


if __name__ == "__main__":
    main()

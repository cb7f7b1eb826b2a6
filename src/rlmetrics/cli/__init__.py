"""The command line: ``rlmetrics demo | train | audit | plot``.

Every training flag comes from a field of the config dataclasses in
``rlmetrics.trainer.config`` (its help text is the field's ``help`` metadata), so
``--help`` documents each one with its default.
"""

from __future__ import annotations

import argparse
import sys
import time
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

METAVARS = {int: "N", float: "X", str: "S"}
EXCLUSIVE = ("micro_batch_size", "max_tokens_per_micro_batch")
DEMO_EXAMPLES = """examples:
  rlmetrics demo                                  # 2 ranks, GRPO, about a minute
  rlmetrics demo --dp 4 --micro-batch-size 3 --dtype float64
  rlmetrics demo --algo ppo --mini-batches 2 --epochs 2 --max-tokens-per-micro-batch 200
  torchrun --nproc-per-node 2 -m rlmetrics.trainer --steps 50   # the same, under torchrun
"""

DEMO_DEFAULTS = {"naive": True}
"""Where ``rlmetrics demo``'s defaults differ from the config's: it shows naive values."""
CLIP = "actor/pg_clipfrac"


def _flag_type(annotation: Any) -> Any:
    """The argparse type of a field annotation (``int | None`` -> int)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner
    return annotation


def _add_field(group: Any, field: Field, annotation: Any, defaults: dict[str, Any]) -> None:
    flag = "--" + field.name.replace("_", "-")
    default = field.default if field.default is not MISSING else None
    default = defaults.get(field.name, default)
    help_text = f"{field.metadata.get('help', '')} (default: {default})"
    kwargs: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS, "help": help_text}
    kind = _flag_type(annotation)
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = kind
        kwargs["metavar"] = field.metadata.get("metavar", METAVARS.get(kind, "V"))
        if "choices" in field.metadata:
            kwargs["choices"] = field.metadata["choices"]
            kwargs.pop("metavar")
    group.add_argument(flag, *field.metadata.get("aliases", ()), **kwargs)


def add_config_arguments(
    parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None
) -> None:
    """One flag per config field, grouped by section; micro-batching flags exclusive.
    ``defaults``: fields whose default differs from the config's for this command."""
    from rlmetrics.trainer.config import SECTIONS

    defaults = defaults or {}

    for section, cls in SECTIONS.items():
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        group = parser.add_argument_group(section, doc)
        hints = typing.get_type_hints(cls)
        exclusive = None
        for field in fields(cls):
            target = group
            if field.name in EXCLUSIVE:
                exclusive = exclusive or group.add_mutually_exclusive_group()
                target = exclusive
            _add_field(target, field, hints[field.name], defaults)
    parser.set_defaults(**defaults)


def config_from_args(args: argparse.Namespace) -> Any:
    """The TrainConfig of the parsed flags (unset flags keep the dataclass defaults)."""
    from rlmetrics.trainer.config import SECTIONS, TrainConfig

    parts = {}
    for section, cls in SECTIONS.items():
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        parts[section] = cls(**given)
    return TrainConfig(**parts)


def build_parser() -> argparse.ArgumentParser:
    """The ``rlmetrics`` parser with its subcommands."""
    from rlmetrics.trainer.config import LAUNCHERS, METRICS_PATHS

    parser = argparse.ArgumentParser(
        prog="rlmetrics", description="Exact, partition-invariant metrics for RL training."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train the reference GRPO/PPO trainer on D spawned local ranks",
        description="Train a tiny transformer by RL on D local gloo ranks (spawned).",
        epilog=DEMO_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="spawn",
        help="how ranks start: spawn (local processes) or ray (D actors, "
        "a driver owns the loop) (default: spawn)",
    )
    demo.add_argument(
        "--metrics-path",
        choices=METRICS_PATHS,
        default="collective",
        help="ray: compute() in the actors, or their states merged on the "
        "driver (default: collective)",
    )
    demo.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="ray: a cluster to join, e.g. auto (default: RAY_ADDRESS, else a local Ray)",
    )
    add_config_arguments(demo, DEMO_DEFAULTS)
    train = sub.add_parser(
        "train",
        help="one rank of a torchrun job (python -m rlmetrics.trainer)",
        description="Join a torchrun job: RANK/WORLD_SIZE/LOCAL_RANK from the environment.",
    )
    add_config_arguments(train)
    from rlmetrics.cli import audit

    audit.add_audit_arguments(
        sub.add_parser(
            "audit",
            help="metric spread across partitions of one training step",
            description=audit.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    _add_plot(sub)
    return parser


def _add_plot(sub: Any) -> None:
    plot = sub.add_parser("plot", help="plot a JSONL metrics file")
    try:
        from rlmetrics.plot import add_plot_arguments
    except ImportError:
        return
    add_plot_arguments(plot)


def summarize(
    history: list[dict[str, float]], seconds: float, jsonl: Path | None, ranks: int
) -> list[str]:
    """The demo's closing lines: the reward's rise, the wall time, one exact metric next
    to its naive value (when the run logged it), where the metrics are, what to run next."""
    if not history:  # resumed from a checkpoint at the last step
        lines = ["no steps left to run"]
    else:
        scores = [m.get("critic/score/mean", float("nan")) for m in history]
        k = min(5, len(scores))
        first, last = sum(scores[:k]) / k, sum(scores[-k:]) / k
        lines = [
            f"{len(history)} steps on {ranks} rank(s) in {seconds:.0f} s; mean reward "
            f"(critic/score/mean) {first:.3f} over the first {k} steps, {last:.3f} over the last"
        ]
        lines += _exact_and_naive(history)
    if jsonl is not None:
        lines.append(f"every metric of every step: {jsonl}")
    lines.append(
        f"next: {command_prefix()} audit --naive   # one step under four partitions, "
        "exact next to naive"
    )
    return lines


def _exact_and_naive(history: list[dict[str, float]]) -> list[str]:
    """The clip fraction next to its naive value, at the step where they differ most."""
    steps = [(i, m) for i, m in enumerate(history) if CLIP in m and f"naive/{CLIP}" in m]
    if not steps:
        return []
    i, m = max(steps, key=lambda s: abs(s[1][f"naive/{CLIP}"] - s[1][CLIP]))
    exact, naive = m[CLIP], m[f"naive/{CLIP}"]
    step = int(m.get("training/global_step", i + 1))
    off = f" ({(naive - exact) / exact:+.0%})" if exact else ""
    return [
        f"{CLIP} at step {step}, where the two differ most: {exact:.4f} exact (the share "
        "of all the step's tokens clipped)",
        f"  and {naive:.4f}{off} as a mean of micro-batch means, what a per-micro-batch "
        "logger reports",
    ]


def command_prefix() -> str:
    """How to call ``rlmetrics`` again from here, as the user can type it: the bare name
    when it is on PATH and is this installation's, else this installation's script."""
    import os
    import shutil

    script = Path(sys.executable).parent / "rlmetrics"
    found = shutil.which("rlmetrics")
    if found and script.exists() and Path(found).resolve() == script.resolve():
        return "rlmetrics"
    if not script.exists():
        return f"{sys.executable} -m rlmetrics.cli"
    try:
        return os.path.relpath(script) if Path.cwd() in script.parents else str(script)
    except ValueError:  # another drive
        return str(script)


def run_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``rlmetrics demo``: spawn ``--dp`` local ranks and train."""
    from rlmetrics.trainer.launch import spawn

    cfg = _config(args, parser)
    if args.launcher == "ray" and cfg.run.device not in (None, "cpu"):
        parser.error(f"--device {cfg.run.device}: the ray launcher trains on the CPU only")
    _check_before_start(cfg, parser)
    start = time.perf_counter()
    history = _launch_ray(args, parser, cfg) if args.launcher == "ray" else spawn(cfg)
    run = cfg.run
    jsonl = None
    if "jsonl" in run.loggers:
        jsonl = Path(run.metrics_jsonl or Path(run.run_dir) / "metrics.jsonl")
    print("\n".join(summarize(history, time.perf_counter() - start, jsonl, run.dp)))
    return 0


def _check_before_start(cfg: Any, parser: argparse.ArgumentParser) -> None:
    """Before any rank starts: the device exists, the loggers' extras are installed, and
    the checkpoint to resume from exists, is readable and matches the config."""
    from rlmetrics._optional import require_loggers
    from rlmetrics.loggers import parse_backends
    from rlmetrics.trainer import checkpoint
    from rlmetrics.trainer.launch import check_device

    try:
        check_device(cfg.run.device)
        require_loggers(parse_backends(cfg.run.loggers), f"--loggers {cfg.run.loggers}")
        path = checkpoint.resume_path(cfg.run)
        if path is not None:
            checkpoint.check_config(cfg, checkpoint.load(path)["config"], path)
    except (ImportError, OSError, ValueError) as err:
        parser.error(str(err))


def _launch_ray(args: argparse.Namespace, parser: argparse.ArgumentParser, cfg: Any) -> Any:
    try:
        from rlmetrics.trainer.ray_launch import launch
    except ImportError as err:
        parser.error(str(err))
    return launch(cfg, metrics_path=args.metrics_path, address=args.ray_address)


def _config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    """The TrainConfig of the flags; a value out of range is a usage error naming its
    flag (``argument --lr: lr must be a finite number > 0, got nan``), exit 2."""
    from rlmetrics.trainer.config import ConfigError

    try:
        return config_from_args(args)
    except ConfigError as err:
        parser.error(f"argument --{err.field.replace('_', '-')}: {err}")
    except (TypeError, ValueError) as err:
        parser.error(str(err))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlmetrics`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo(args, parser)
    if args.command == "train":
        from rlmetrics.trainer.launch import from_env

        cfg = _config(args, parser)
        _check_before_start(cfg, parser)
        from_env(cfg)
        return 0
    if args.command == "plot":
        return _run_plot(args)
    if args.command == "audit":
        from rlmetrics.cli.audit import run_audit

        return run_audit(args)
    print(f"rlmetrics {args.command}: not yet implemented", file=sys.stderr)
    return 1


def _run_plot(args: argparse.Namespace) -> int:
    try:
        from rlmetrics.plot import run_plot
    except ImportError:
        print("rlmetrics plot: not yet implemented", file=sys.stderr)
        return 1
    return run_plot(args)


if __name__ == "__main__":
    sys.exit(main())

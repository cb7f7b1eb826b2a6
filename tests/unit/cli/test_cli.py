"""The command line's first-run behaviour: a plain install, bad flags, extras checked first.

``make test-plain`` runs the same commands in a fresh venv with torch and the package
only; these tests cover each piece in-process (the optional packages hidden by putting
None in ``sys.modules``, which makes their import fail as if they were not installed).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from rlmetrics.cli import _audit_report as audit_report
from rlmetrics.cli import build_parser, command_prefix, config_from_args, main
from rlmetrics.trainer.config import AlgoConfig, RunConfig, TaskConfig
from rlmetrics.trainer.launch import rank_device

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--num-prompts", "2",
        "--samples-per-prompt", "2", "--num-symbols", "3", "--max-prompt-len", "2"]  # fmt: skip


def hide(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make ``import package`` fail, as when it is not installed."""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)


@pytest.fixture(autouse=True)
def sandbox(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mpl"))
    monkeypatch.chdir(tmp_path)


# -- config values: finite and in range, named --------------------------------------------
@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--gamma", "nan", "gamma must be a finite number >= 0 and <= 1, got nan"),
        ("--kl-coef", "-1", "kl_coef must be a finite number >= 0, got -1.0"),
        ("--lr", "inf", "lr must be a finite number > 0, got inf"),
        ("--critic-lr", "nan", "critic_lr must be a finite number > 0, got nan"),
        ("--lam", "1.5", "lam must be a finite number >= 0 and <= 1, got 1.5"),
        ("--entropy-coef", "-inf", "entropy_coef must be a finite number >= 0, got -inf"),
        ("--max-grad-norm", "inf", "max_grad_norm must be a finite number > 0, got inf"),
        ("--end-bonus", "nan", "end_bonus must be a finite number >= 0 and <= 1, got nan"),
        ("--timeout", "inf", "timeout must be a finite number > 0, got inf"),
    ],
)
def test_demo_rejects_non_finite_and_out_of_range_values(flag, value, message, capsys) -> None:
    args = build_parser().parse_args(["demo", f"{flag}={value}"])
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        config_from_args(args)
    with pytest.raises(SystemExit) as exit_info:  # the command line: a usage error, exit 2
        main(["demo", f"{flag}={value}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"argument {flag}: {message}" in err


@pytest.fixture
def no_work(monkeypatch):
    """Any subcommand that gets past its flags fails the test at once (no ranks start)."""
    import rlmetrics.cli.audit as audit
    from rlmetrics.trainer import launch

    def work(*args, **kwargs):
        raise AssertionError("the command started with a bad flag")

    for owner, name in ((audit, "run_partitions"), (audit, "run_fn_audit"),
                        (launch, "spawn"), (launch, "from_env")):  # fmt: skip
        monkeypatch.setattr(owner, name, work)


def numeric_flags() -> list[tuple[str, str]]:
    """(subcommand, flag) of every numeric flag of every subcommand."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, type(parser._subparsers._actions[-1]))]
    out = []
    for command, subparser in sub.choices.items():
        for action in subparser._actions:
            kind = getattr(action.type, "__name__", None)
            if kind in ("int", "float", "int list", "float list"):
                out.append((command, action.option_strings[0]))
    return out


def test_every_subcommand_has_numeric_flags_to_check() -> None:
    flags = numeric_flags()
    for command in ("demo", "train", "audit"):
        assert sum(c == command for c, _ in flags) >= 6, command
    assert ("audit", "--tol") in flags and ("audit", "--ranks") in flags


@pytest.mark.parametrize(("command", "flag"), numeric_flags())
@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_every_numeric_flag_refuses_non_finite_and_negative_values(
    command, flag, value, no_work, capsys
) -> None:
    """NaN, infinity, a negative value: a usage error naming the flag, exit 2, before any
    work (every numeric flag here is >= 0)."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, f"{flag}={value}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"argument {flag}: " in err, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tol", "nan"], "argument --tol: must be a finite number > 0, got 'nan'"),
        (["--tol=-1e-9"], "argument --tol: must be a finite number > 0, got '-1e-9'"),
        (["--tol", "inf"], "argument --tol: must be a finite number > 0, got 'inf'"),
        # identical bits, which the contract does not promise (exit 1, "drift", was)
        (["--tol", "0"], "argument --tol: must be a finite number > 0, got '0'"),
        (["--num-prompts", "0"], "argument --num-prompts: must be an integer >= 1, got '0'"),
        (["--samples-per-prompt", "1"], "argument --samples-per-prompt: samples_per_prompt "
                                        "must be >= 2 with grpo, got 1"),
        (["--mini-batches", "0"], "argument --mini-batches: must be an integer >= 1"),
        (["--epochs", "1.5"], "argument --epochs: must be an integer >= 1, got '1.5'"),
        (["--seed", "-1"], "argument --seed: must be an integer >= 0 and <= 4294967295"),
        (["--seed", str(2**32)], "argument --seed: must be an integer >= 0 and <= 4294967295"),
        (["--ranks", "1,0"], "argument --ranks: each item must be an integer >= 1, got '0'"),
        (["--micro-batch-sizes", "2,nan"], "argument --micro-batch-sizes: each item must be"),
        (["--partitions", "0,1"], "--partitions: '0' is not DP"),
    ],
)  # fmt: skip
def test_audit_refuses_bad_numbers_as_a_usage_error_naming_the_flag(
    args, message, no_work, capsys
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["audit", *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--n-embd", "0"], "argument --n-embd: n_embd must be >= 1, got 0"),
        (["--n-embd", "-4"], "argument --n-embd: n_embd must be >= 1, got -4"),
        (["--seed", "-1"], "argument --seed: seed must be an integer >= 0 and <= 4294967295"),
        (["--seed", str(2**70)], "argument --seed: seed must be an integer >= 0"),
    ],
)
@pytest.mark.parametrize("command", ["demo", "train"])
def test_trainer_refuses_bad_numbers_as_a_usage_error_naming_the_flag(
    command, args, message, no_work, capsys
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_config_dataclasses_validate_in_post_init() -> None:
    with pytest.raises(ValueError, match="gamma"):
        AlgoConfig(gamma=math.nan)
    with pytest.raises(ValueError, match="clip_high"):
        AlgoConfig(clip_high=-0.1)
    with pytest.raises(ValueError, match="end_bonus"):
        TaskConfig(end_bonus=math.inf)
    with pytest.raises(ValueError, match="timeout"):
        RunConfig(timeout=math.nan)
    assert AlgoConfig(kl_coef=0.0, gamma=0.0, lam=1.0).kl_coef == 0.0  # bounds included


# -- --device ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "CPU", "cuda:", "", 0])
def test_device_values_other_than_cpu_cuda_or_cuda_n_are_named(bad) -> None:
    with pytest.raises(ValueError, match=f"device must be cpu, cuda or cuda:N, got {bad!r}"):
        RunConfig(device=bad)


def test_device_flag_reaches_the_config_and_picks_each_ranks_device() -> None:
    parse = build_parser().parse_args
    assert config_from_args(parse(["demo", "--device", "cuda:1"])).run.device == "cuda:1"
    assert config_from_args(parse(["train", "--device", "cpu"])).run.device == "cpu"
    assert config_from_args(parse(["demo"])).run.device is None
    assert rank_device(None, 3) == rank_device("cpu", 0) == torch.device("cpu")


def memory_metrics(jsonl: Path) -> set[str]:
    """The GPU memory metrics in the run's rows (reported only for a model on a GPU)."""
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    return {key for row in rows for key in row if "max_memory_allocated" in key}


def test_demo_on_the_cpu_device_trains_there(tmp_path, capsys) -> None:
    jsonl = tmp_path / "m.jsonl"
    flags = ["--dp", "1", "--steps", "1", "--device", "cpu", "--metrics-jsonl", str(jsonl)]
    assert main(["demo", *TINY, *flags]) == 0
    assert jsonl.exists() and memory_metrics(jsonl) == set()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_demo_on_cuda_without_cuda_is_a_usage_error_before_spawning(device, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *TINY, "--device", device])
    assert exit_info.value.code == 2
    assert f"--device {device}: CUDA is not available on this machine" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"--device {device}: CUDA is not available"):
        rank_device(device, 0)


def test_demo_on_a_missing_gpu_or_through_ray_on_a_gpu_is_a_usage_error(capsys) -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for argv, message in [
        (["--device", f"cuda:{max(count, 1)}"], f"--device cuda:{max(count, 1)}: "),
        (["--launcher", "ray", "--device", "cuda"], "the ray launcher trains on the CPU only"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["demo", *TINY, *argv])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


# -- a plain install: no rich, no matplotlib ------------------------------------------------
def test_demo_without_rich_prints_progress_tables_and_a_summary_ending_in_a_command(
    monkeypatch, capsys
) -> None:
    hide(monkeypatch, "rich")
    assert main(["demo", *TINY, "--dp", "1", "--steps", "2", "--log-every", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    progress = [line for line in out if line.startswith("step ") and "reward" in line]
    assert [line.split()[1] for line in progress] == ["1/2", "2/2"]
    assert "step 2" in out and any(line.split()[:3] == ["group", "metric", "value"] for line in out)
    assert any(line.split()[:2] == ["actor", "entropy"] for line in out)
    summary = out[out.index(progress[-1]) + 1 :]
    summary = summary[next(i for i, line in enumerate(summary) if "steps on 1 rank" in line) :]
    assert "mean reward (critic/score/mean)" in summary[0]
    assert summary[1].startswith("actor/pg_clipfrac at step ") and " exact " in summary[1]
    assert "mean of micro-batch means" in summary[2]
    assert summary[-1].startswith(f"next: {command_prefix()} audit --naive")


def test_the_closing_hint_is_a_command_that_runs_here(tmp_path, monkeypatch) -> None:
    """The hint names this installation's script as the user can type it: the bare name
    when PATH finds this one, else its path (relative from inside a checkout)."""
    import shutil

    script = Path(sys.executable).parent / "rlmetrics"
    assert script.exists()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert Path(command_prefix()).resolve() == script.resolve()
    monkeypatch.setattr(shutil, "which", lambda name: str(script))
    assert command_prefix() == "rlmetrics"


def test_audit_without_rich_renders_plain_text(monkeypatch, capsys) -> None:
    hide(monkeypatch, "rich")
    report = audit_report.spread_report(
        {"dp1": {"acc[top1]": 1.0, "loss": 2.0}, "dp2": {"acc[top1]": 1.0, "loss": 2.5}}, 1e-9
    )
    audit_report.render(report)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "metric spread across partitions (vs dp1)"
    assert lines[1].split()[:2] == ["metric", "value"]
    assert lines[2].split() == ["loss", "2", "0.25", "DRIFT", "at", "dp2"]
    assert lines[3].split() == ["acc[top1]", "1", "0", "ok"]
    assert lines[4].startswith("1 metrics invariant to 1e-09; 1 drift")


def test_audit_plot_without_matplotlib_fails_before_any_work(monkeypatch, tmp_path) -> None:
    import rlmetrics.cli.audit as audit

    def work(*args, **kwargs):
        raise AssertionError("the audit started before checking --plot's extra")

    monkeypatch.setattr(audit, "run_partitions", work)
    monkeypatch.setattr(audit, "run_fn_audit", work)
    hide(monkeypatch, "matplotlib")
    with pytest.raises(SystemExit, match=r"pip install 'rlmetrics\[plot\]'") as exit_info:
        main(["audit", "--plot", str(tmp_path / "a.png")])
    assert "rlmetrics audit --plot needs the 'matplotlib' package" in str(exit_info.value)


@pytest.mark.parametrize("backend", ["tensorboard", "wandb", "mlflow"])
def test_demo_checks_the_loggers_extras_before_spawning(backend, monkeypatch, capsys) -> None:
    from rlmetrics.trainer import launch

    def no_spawn(cfg):
        raise AssertionError("ranks were spawned")

    monkeypatch.setattr(launch, "spawn", no_spawn)
    hide(monkeypatch, backend)
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--loggers", f"jsonl,{backend}"])
    assert exit_info.value.code == 2
    assert f"pip install 'rlmetrics[{backend}]'" in capsys.readouterr().err


def test_audit_table_shows_names_literally(capsys) -> None:
    pytest.importorskip("rich")
    from rich.console import Console

    report = audit_report.spread_report({"a": {"acc[top1]": 1.0}, "b": {"acc[top1]": 1.0}}, 1e-9)
    console = Console(record=True, width=120, file=sys.stdout)
    audit_report.render(report, console)
    assert "acc[top1]" in console.export_text()

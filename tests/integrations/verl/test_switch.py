"""Turning the integration on and off in one process, and refusing untested verl."""

from __future__ import annotations

import importlib
import sys

import pytest

import rlmetrics.integrations.verl as integration


def test_other_verl_versions_are_refused() -> None:
    with pytest.raises(RuntimeError, match=r"tested with verl 0\.9\.1, but verl 0\.9\.0"):
        integration.check_version("0.9.0")


def test_enable_switches_verls_worker_classes_and_disable_restores_them() -> None:
    engine_workers = importlib.import_module("verl.workers.engine_workers")
    from rlmetrics.integrations.verl.worker import ExactTrainingWorker

    integration.enable()
    assert integration.is_enabled()
    assert engine_workers.ActorRolloutRefWorker.actor_worker_cls is ExactTrainingWorker
    assert engine_workers.TrainingWorker is ExactTrainingWorker
    integration.disable()
    assert not integration.is_enabled()
    assert engine_workers.TrainingWorker is not ExactTrainingWorker
    assert engine_workers.ActorRolloutRefWorker.actor_worker_cls is engine_workers.TrainingWorker
    integration.enable()
    assert engine_workers.TrainingWorker is ExactTrainingWorker


def test_the_subclass_keeps_verls_dispatch_registration() -> None:
    """verl's worker groups bind methods by the attribute ``@register`` sets: the
    overrides must carry the parent's, or the driver could not call them."""
    from verl.single_controller.base.decorator import MAGIC_ATTR

    from rlmetrics.integrations.verl.worker import ExactTrainingWorker

    parent = integration._ORIGINAL["TrainingWorker"]
    for name in ("set_loss_fn", "train_batch", "train_mini_batch"):
        mine = getattr(getattr(ExactTrainingWorker, name), MAGIC_ATTR)
        assert mine == getattr(getattr(parent, name), MAGIC_ATTR), name


def test_plugin_entry_point_names_the_module() -> None:
    from importlib.metadata import entry_points

    (plugin,) = [ep for ep in entry_points(group="verl.plugins") if ep.name == "rlmetrics"]
    assert plugin.value == "rlmetrics.integrations.verl.plugin"
    assert "rlmetrics.integrations.verl" in sys.modules

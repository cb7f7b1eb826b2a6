"""Adapters that give existing RL frameworks rlmetrics' exact, partition-invariant metrics.

Each submodule is imported on its own, with its framework, and names the package to
install when it is missing: ``rlmetrics.integrations.verl`` (verl's actor and critic
updates, turned on through verl's plugin hook) and ``rlmetrics.integrations.trl``
(TRL's GRPOTrainer).
"""

"""Adapters that give existing RL frameworks rlmetrics' exact, partition-invariant metrics.

Each submodule imports its framework lazily and names the package to install when it is
missing: ``rlmetrics.integrations.trl`` (TRL's GRPOTrainer) and, where present,
``rlmetrics.integrations.verl``.
"""

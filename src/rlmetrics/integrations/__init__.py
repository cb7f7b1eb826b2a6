"""Integrations with training frameworks (each imported on its own, with its framework)."""

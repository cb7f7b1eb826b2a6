"""Which verl releases the integration accepts, and the check that refuses the others.

A leaf module: the package and ``dataproto`` both import it, without importing each other.
"""

from __future__ import annotations

from rlmetrics.integrations._pins import refuse_untested

try:
    import verl
except ImportError as error:  # verl is not a dependency of rlmetrics
    raise ImportError(
        "rlmetrics.integrations.verl needs verl (tested with 0.9.1): pip install verl==0.9.1"
    ) from error

SUPPORTED_VERL = ("0.9.1",)


def check_version(version: str | None = None) -> None:
    """Raise unless ``version`` (default: the installed verl's) was tested here."""
    installed = verl.__version__ if version is None else version
    otherwise = "turn the integration off with VERL_USE_EXTERNAL_PLUGINS=none"
    refuse_untested("verl", "verl", installed, SUPPORTED_VERL, otherwise)

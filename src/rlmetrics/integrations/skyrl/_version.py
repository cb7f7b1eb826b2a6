"""Which SkyRL releases the integration accepts, and the check that refuses the others.

A leaf module: the package and its worker and trainer modules import it first, so an
untested SkyRL is refused before any of its modules is imported.
"""

from __future__ import annotations

from rlmetrics.integrations._pins import refuse_untested

try:
    import skyrl
except ImportError as error:  # skyrl is not a dependency of rlmetrics
    raise ImportError(
        "rlmetrics.integrations.skyrl needs SkyRL (tested with 0.4.0): "
        "pip install 'skyrl[fsdp]==0.4.0'"
    ) from error

SUPPORTED_SKYRL = ("0.4.0",)


def check_version(version: str | None = None) -> None:
    """Raise unless ``version`` (default: the installed SkyRL's) was tested here.

    Raises:
        RuntimeError: the version is not one of ``SUPPORTED_SKYRL``.
    """
    installed = skyrl.__version__ if version is None else version
    otherwise = "use SkyRL's own RayPPOTrainer"
    refuse_untested("skyrl", "SkyRL", installed, SUPPORTED_SKYRL, otherwise)


check_version()

"""Optional dependencies: check one before any work starts, naming the extra to install.

The core needs only torch and numpy; everything else is an extra of the package
(``pip install 'rlmetrics[plot]'``). A command that will need an extra checks it first,
so it fails in a second with the install line instead of after minutes of work.
"""

from __future__ import annotations

import importlib
import importlib.util

# The package each optional logger backend needs; its extra has the backend's name.
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def missing(module: str, extra: str, purpose: str, error: BaseException | None = None) -> str:
    """The message for a missing optional package: what needs it and what to install."""
    why = f" ({error})" if error is not None else ""
    return (
        f"{purpose} needs the {module!r} package, which could not be imported{why}; "
        f"install it with: pip install 'rlmetrics[{extra}]'"
    )


def require(module: str, extra: str, purpose: str) -> None:
    """Import ``module`` or raise ImportError naming the extra that provides it.

    Args:
        module: the package to import, e.g. "matplotlib".
        extra: the rlmetrics extra that installs it, e.g. "plot".
        purpose: what needs it, for the message, e.g. "rlmetrics audit --plot".

    Raises:
        ImportError: the package cannot be imported (``name`` is the module).
    """
    try:
        importlib.import_module(module)
    except ImportError as err:
        raise ImportError(missing(module, extra, purpose, err), name=module) from err


def available(module: str) -> bool:
    """Whether ``module`` imports (an optional backend is installed)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def installed(module: str) -> bool:
    """Whether ``module`` is installed, without importing it (cheap: for up-front checks)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require_loggers(backends: list[str], purpose: str) -> None:
    """Raise ImportError naming the extra of the first backend whose package is missing."""
    for backend in backends:
        package = LOGGER_PACKAGES.get(backend)
        if package is not None and not installed(package):
            raise ImportError(missing(package, backend, purpose), name=package)

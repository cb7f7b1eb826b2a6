"""The version rule every framework integration applies: run only on a release of the
framework tested here. The integrations subclass and hook into code that changes between
releases, so an untested one is refused with what to install instead."""

from __future__ import annotations

from collections.abc import Sequence


def refuse_untested(
    integration: str, framework: str, installed: str, tested: Sequence[str], otherwise: str
) -> None:
    """Raise unless ``installed`` is one of the ``tested`` releases of ``framework``.

    Args:
        integration: the module under ``rlmetrics.integrations`` (``"verl"``).
        framework: the framework's name as its users write it (``"SkyRL"``); its pip
            name is the same in lower case.
        installed: the installed release.
        tested: the releases tested here, oldest first.
        otherwise: what to do instead of installing a tested release.

    Raises:
        RuntimeError: naming the installed and the tested releases.
    """
    if installed not in tested:
        raise RuntimeError(
            f"rlmetrics.integrations.{integration} is tested with {framework} "
            f"{', '.join(tested)}, but {framework} {installed} is installed: install "
            f"{framework.lower()}=={tested[-1]}, or {otherwise}"
        )

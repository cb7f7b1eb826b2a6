"""verl's plugin hook (entry point ``verl.plugins: rlmetrics``): turns the integration on.

verl imports this at the end of ``import verl`` and swallows any error at debug level,
so a failure is also reported here, as a warning that names the cause.
"""

from __future__ import annotations

import warnings

try:
    import rlmetrics.integrations.verl  # noqa: F401  (importing it enables it)
except Exception as error:
    warnings.warn(
        f"rlmetrics' verl plugin is NOT active, verl's metrics stay as verl computes them: "
        f"{type(error).__name__}: {error}",
        RuntimeWarning,
        stacklevel=2,
    )
    raise

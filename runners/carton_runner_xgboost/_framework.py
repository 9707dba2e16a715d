"""Importing xgboost for the runner process, without the scikit-learn start-up cost."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["xgb"]


def _import_xgboost_without_sklearn() -> Any:
    """Import xgboost with scikit-learn blocked: the runner only uses `Booster`, and xgboost would otherwise import
    scikit-learn (and its scipy stack) at start-up, about a second of every runner launch. A ``None`` entry in
    ``sys.modules`` makes that optional import fail fast, as if scikit-learn were not installed; the entry is
    removed right after, so later imports of scikit-learn work normally."""
    if "sklearn" in sys.modules:
        import xgboost

        return xgboost
    sys.modules["sklearn"] = None  # type: ignore[assignment]
    try:
        import xgboost
    finally:
        del sys.modules["sklearn"]
    return xgboost


xgb = _import_xgboost_without_sklearn()

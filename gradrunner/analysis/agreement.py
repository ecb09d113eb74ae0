"""The one rule of "the same value", for compare (`compare_runs`), replay and the report's strategy table.

Contents:
    agrees(a, b, rtol, atol)   -- elementwise: equal, both NaN, or both finite and within the tolerance
    relative(a, b)             -- |a - b| / |a| elementwise (0 where equal, inf where a is 0 or one is NaN)

Imports numpy only.
"""

from __future__ import annotations

import numpy as np


def agrees(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    """Elementwise: equal (the same infinity too), or both NaN, or both finite and |a - b| <= atol + rtol * |a|.

    Example::

        agrees(np.array([1.0, np.nan]), np.array([1.0 + 1e-9, np.nan]), 1e-5, 1e-8)   # [True, True]
        agrees(np.array([np.inf, np.inf]), np.array([1.0, -np.inf]), 1e-5, 1e-8)        # [False, False]

    The tolerance is for finite values only: with a = inf, |a - b| <= rtol * |a| would be inf <= inf,
    true for every b. The one rule of "the same value" for compare, replay and the report's strategy table.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        close = np.isfinite(a) & np.isfinite(b) & (np.abs(a - b) <= atol + rtol * np.abs(a))
    return (a == b) | (np.isnan(a) & np.isnan(b)) | close


def relative(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| / |a| elementwise: 0 where they are equal (NaN and NaN too), inf where a is 0 or only one is NaN.

    Example::

        relative(np.array([0.0123]), np.array([0.0456]))     # [2.707...]
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.abs(a - b) / np.abs(a)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    return np.where(same, 0.0, np.where(np.isnan(rel), np.inf, rel))

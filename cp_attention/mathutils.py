"""Integer helpers shared by the planners and ops (imports nothing from the package)."""
from __future__ import annotations


def ceil_div(a, b):
    """ceil(a / b) for ints and integer numpy arrays / tensors (b > 0)."""
    return -(-a // b)

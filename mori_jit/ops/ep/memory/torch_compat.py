"""The torch release this process runs, for the memory providers' version-dependent calls (the
project supports torch >= 2.9)."""
from __future__ import annotations

import torch

__all__ = ["torch_before"]


def torch_before(major: int, minor: int) -> bool:
    """Whether this torch is older than ``major.minor``."""
    parts = torch.__version__.split(".")
    return (int(parts[0]), int(parts[1])) < (major, minor)

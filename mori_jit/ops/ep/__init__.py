"""Expert-parallel dispatch/combine (DESIGN §6). Importing this package imports no backend."""
from .config import EpDispatchCombineConfig
from .op import EpDeviceError, EpDispatchCombineOp, EpUnsupportedError, KernelSet

__all__ = ["EpDispatchCombineConfig", "EpDispatchCombineOp", "EpDeviceError", "EpUnsupportedError", "KernelSet"]

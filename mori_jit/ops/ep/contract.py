"""Facts of the EP op's contract that the argument checks, every backend and the kernels' config
share (no torch, no backend: the CLI's torch-free verbs import it through the kernels' config)."""

__all__ = ["ROW_ALIGN"]

#: Bytes of the vectors the kernels move token rows in (and the bulk-copy unit's address
#: alignment): a token row is whole vectors, and the row tensors (dispatch input, combine input
#: and output) start on such a boundary. A misaligned pointer would fault on the device, killing
#: the context, instead of raising on the host.
ROW_ALIGN = 16

"""The op's backends: ``torch`` (the reference, on torch.distributed collectives) and ``hip``
(the JIT kernels). A backend subclasses :class:`~mori_jit.ops.ep.core.op.EpDispatchCombineOp` and
hands it a :class:`~mori_jit.ops.ep.core.kernel_set.KernelSet`; backends never import each other."""

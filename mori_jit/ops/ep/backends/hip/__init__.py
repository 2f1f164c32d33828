"""The ``hip`` backend: the JIT kernels of ``kernels/ep/`` (AMD via hipcc, NVIDIA via nvcc).

``common/`` holds what both kernel families share; ``intranode/`` and ``internode/`` one family
each (cfg, args, specs, tuning, error words); the top files join them: ``backend`` (the op's hip
backend), ``variants`` (every kernel a live op builds, shared with ``mori-jit precompile``) and
``gaps`` (what the kernels cannot serve). Imports point down: top files → families → common."""

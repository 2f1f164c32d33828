"""The backend-independent op: its lifecycle (``op``), the checks of each call's arguments
(``arguments``, ``arguments_moe``, ``checks``), the ranks' agreement before a launch, what a backend
hands the op (``kernel_set``) and which geometry a call launches (``schedule``). Imports ``memory``
and the top files of ``ops/ep``; names its backends by module path only."""

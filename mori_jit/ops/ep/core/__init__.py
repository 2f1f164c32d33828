"""The backend-independent op: its lifecycle (``op``), the checks of each call's arguments
(``arguments``, ``arguments_moe``, ``checks``), the ranks' agreement before a launch
(``agreement``) and the bounded waits of the op's host collectives (``watch``), what a backend
hands the op (``kernel_set``), which geometry a call launches (``schedule``) and each leg as a send
and a receive (``overlap``). Imports ``memory``
and the top files of ``ops/ep``; names its backends by module path only."""

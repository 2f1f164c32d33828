"""The ``torch`` backend: the reference algorithm (``reference``, ``reference_moe``) on
torch.distributed collectives, the parity oracle of the ``hip`` backend (``backend``); its legs as a
send and a receive (``split``)."""

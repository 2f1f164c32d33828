"""``python -m mori_jit`` is the ``mori-jit`` command."""
import sys

from mori_jit.cli import main

sys.exit(main())

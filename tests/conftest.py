"""Settings for the whole test session.

Many tests compare two runs bit for bit (exact resume, one trainer against its ranks, local
against Ray). On a CPU the engine and trainer follow the cores other processes leave free
(`rollover.engine.cpu.share`), and a changed thread count can change a float sum's last bits:
a neighbour's load (another job on the machine, the test's own Ray processes) would then decide
whether such a test passes. So the session keeps torch's thread count fixed; the adapting
itself is tested in tests/test_cpu_share.py, which turns it back on.
"""

import os

os.environ.setdefault("ROLLOVER_CPU_SHARE", "0")

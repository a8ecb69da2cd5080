"""`python -m rollover.config docs/config.md`: write the configuration reference."""

import sys
from pathlib import Path

from rollover.config.reference import markdown_reference

Path(sys.argv[1]).write_text(markdown_reference() + "\n")

"""`python -m substation`: the same command as `substation`."""
import sys

from substation.cli import main

sys.exit(main())

"""`python -m hfsampler`: the same entry point as the console script."""

import sys

from hfsampler.cli.main import main

sys.exit(main())

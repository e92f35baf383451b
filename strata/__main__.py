import sys

from strata.cli.main import main

sys.exit(main())

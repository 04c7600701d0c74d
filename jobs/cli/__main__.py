import sys

from hpcrl.jobs.cli import main

sys.exit(main())

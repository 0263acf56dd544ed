import sys

from draft_align.cli import main

sys.exit(main())

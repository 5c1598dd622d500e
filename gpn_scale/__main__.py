import sys

from gpn_scale.cli import main

sys.exit(main())

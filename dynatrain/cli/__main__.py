import sys

from dynatrain.cli import main

sys.exit(main())

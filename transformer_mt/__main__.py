import sys

from transformer_mt.cli import main

sys.exit(main())

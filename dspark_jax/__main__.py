import sys

from dspark_jax.cli import main

sys.exit(main())

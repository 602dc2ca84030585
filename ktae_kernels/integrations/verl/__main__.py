"""``python -m ktae_kernels.integrations.verl --check [overrides]``: see ``check``."""
import sys

from .check import main

sys.exit(main())

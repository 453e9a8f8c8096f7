"""``python -m dlgs_jax.cluster``: the emulated cluster's command line."""

import sys

from dlgs_jax.cluster import netns

sys.exit(netns.main())

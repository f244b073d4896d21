"""``python -m tokenspeed_jax.models.deepseek``: see :mod:`tokenspeed_jax.models.deepseek.cli`."""

import sys

from tokenspeed_jax.models.deepseek.cli import main

sys.exit(main())

"""``python -m peagle_jax.bench``: the MT-Bench acceptance and speed benchmark (:mod:`peagle_jax.bench.mtbench`)."""

import sys

from peagle_jax.bench.mtbench import main

sys.exit(main())

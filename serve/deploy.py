"""Deploy the server to a SageMaker endpoint: ``python serve/deploy.py create|delete ...`` (see
:mod:`peagle_jax.serve.deploy` for the flags and an example)."""

import sys

from peagle_jax.serve.deploy import main

if __name__ == "__main__":
    sys.exit(main())

#!/bin/sh
# Container entry point. SageMaker starts an inference container as `docker run IMAGE serve`, which
# peagle_jax.serve takes as its SageMaker mode (port 8080, model from /opt/ml/model). PEAGLE_SERVE_ARGS
# holds the server flags (the Dockerfile's default, or serve/deploy.py --serve-args); it is split into
# words on purpose.
# shellcheck disable=SC2086
exec python -m peagle_jax.serve "$@" $PEAGLE_SERVE_ARGS

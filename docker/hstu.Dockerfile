# HSTU recipe on Ascend NPUs. Build docker/base.Dockerfile first (see docker/README.md).
#
#   docker build -f docker/hstu.Dockerfile -t npu-cookbook/hstu .
#
# Made from docker/deepseek.Dockerfile; needs nothing beyond the base image's packages.

ARG BASE_IMAGE=npu-cookbook/base
FROM ${BASE_IMAGE}

WORKDIR /opt/npu-cookbook

# requirements*.txt are already here and installed (base image). The shared package next, since it
# changes less often than the recipe, installed editable as in the README.
COPY pyproject.toml ./
COPY common/ common/
RUN python3 -m pip install --no-cache-dir --no-deps -e .

COPY recipes/hstu/ recipes/hstu/

# npu-entrypoint sources the CANN set_env.sh, then runs the recipe; `docker run` arguments are
# passed to run.sh, e.g. `--data /data/KuaiRand-1K --weights /weights --mode eval`.
ENTRYPOINT ["npu-entrypoint", "bash", "recipes/hstu/run.sh"]

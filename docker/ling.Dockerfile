# Ling-3.0-Flash recipe on Ascend NPUs. Build docker/base.Dockerfile first (see docker/README.md).
#
#   docker build -f docker/ling.Dockerfile -t npu-cookbook/ling .
#
# docker/deepseek.Dockerfile with "deepseek" replaced; Python packages live in the base image.

ARG BASE_IMAGE=npu-cookbook/base
FROM ${BASE_IMAGE}

WORKDIR /opt/npu-cookbook

# requirements*.txt are already here and installed (base image). The shared package next, since it
# changes less often than the recipe, installed editable as in the README.
COPY pyproject.toml ./
COPY common/ common/
RUN python3 -m pip install --no-cache-dir --no-deps -e .

COPY recipes/ling/ recipes/ling/

# npu-entrypoint sources the CANN set_env.sh, then runs the recipe; `docker run` arguments are
# passed to run.sh, e.g. `--weights /weights --config recipes/ling/configs/<preset>.yaml`.
ENTRYPOINT ["npu-entrypoint", "bash", "recipes/ling/run.sh"]

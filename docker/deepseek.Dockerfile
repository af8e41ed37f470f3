# DeepSeek recipe on Ascend NPUs. Build docker/base.Dockerfile first (see docker/README.md).
#
#   docker build -f docker/deepseek.Dockerfile -t npu-cookbook/deepseek .
#
# Pattern for the other recipes: copy this file to docker/<recipe>.Dockerfile and replace
# "deepseek" in the COPY and ENTRYPOINT lines. Python packages live in the base image; a recipe
# that needs more adds `RUN python3 -m pip install --no-cache-dir -r recipes/<recipe>/requirements.txt`.

ARG BASE_IMAGE=npu-cookbook/base
FROM ${BASE_IMAGE}

WORKDIR /opt/npu-cookbook

# requirements*.txt are already here and installed (base image). The shared package next, since it
# changes less often than the recipe, installed editable as in the README.
COPY pyproject.toml ./
COPY common/ common/
RUN python3 -m pip install --no-cache-dir --no-deps -e .

COPY recipes/deepseek/ recipes/deepseek/

# npu-entrypoint sources the CANN set_env.sh, then runs the recipe; `docker run` arguments are
# passed to run.sh, e.g. `--weights /weights --config recipes/deepseek/configs/<preset>.yaml`.
ENTRYPOINT ["npu-entrypoint", "bash", "recipes/deepseek/run.sh"]

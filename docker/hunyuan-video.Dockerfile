# HunyuanVideo recipe on Ascend NPUs. Build docker/base.Dockerfile first (see docker/README.md).
#
#   docker build -f docker/hunyuan-video.Dockerfile -t npu-cookbook/hunyuan-video .
#   docker run ... npu-cookbook/hunyuan-video --weights /weights/ckpts --config configs/atlas-a3-720p.yaml
#
# Made from docker/hstu.Dockerfile; needs nothing beyond the base image's packages (PyAV writes the MP4).

ARG BASE_IMAGE=npu-cookbook/base
FROM ${BASE_IMAGE}

WORKDIR /opt/npu-cookbook

# requirements*.txt are already here and installed (base image). The shared package next, since it
# changes less often than the recipe, installed editable as in the README.
COPY pyproject.toml ./
COPY common/ common/
RUN python3 -m pip install --no-cache-dir --no-deps -e .

COPY recipes/hunyuan-video/ recipes/hunyuan-video/

# npu-entrypoint sources the CANN set_env.sh, then runs the recipe; `docker run` arguments are passed to
# run.sh, which launches torchrun itself when the preset or --sp asks for several ranks.
ENTRYPOINT ["npu-entrypoint", "bash", "recipes/hunyuan-video/run.sh"]

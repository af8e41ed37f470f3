# HunyuanImage-3.0 text-to-image recipe on Ascend NPUs. Build docker/base.Dockerfile first (see docker/README.md).
#
#   docker build -f docker/hunyuan-image.Dockerfile -t npu-cookbook/hunyuan-image .
#
# Made from docker/hstu.Dockerfile; needs nothing beyond the base image's packages (diffusers, einops,
# transformers, PyAV / Pillow are in requirements.txt).

ARG BASE_IMAGE=npu-cookbook/base
FROM ${BASE_IMAGE}

WORKDIR /opt/npu-cookbook

# requirements*.txt are already here and installed (base image). The shared package next, since it
# changes less often than the recipe, installed editable as in the README.
COPY pyproject.toml ./
COPY common/ common/
RUN python3 -m pip install --no-cache-dir --no-deps -e .

COPY recipes/hunyuan-image/ recipes/hunyuan-image/

# npu-entrypoint sources the CANN set_env.sh, then runs the recipe; `docker run` arguments are passed
# to run.sh, e.g. `--weights /weights/HunyuanImage-3 --image-size 1024x1024 --infer-steps 50 --ep 8`.
ENTRYPOINT ["npu-entrypoint", "bash", "recipes/hunyuan-image/run.sh"]

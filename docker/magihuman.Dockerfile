# daVinci-MagiHuman recipe on Ascend NPUs. Build docker/base.Dockerfile first (see docker/README.md).
#
#   docker build -f docker/magihuman.Dockerfile -t npu-cookbook/magihuman .
#
# Made from docker/hstu.Dockerfile; needs nothing beyond the base image's packages (torch, transformers for
# T5Gemma, diffusers for the Wan2.2 / Oobleck VAEs and UniPC, PyAV for the MP4, scipy for the audio resampling).

ARG BASE_IMAGE=npu-cookbook/base
FROM ${BASE_IMAGE}

WORKDIR /opt/npu-cookbook

# requirements*.txt are already here and installed (base image). The shared package next, since it
# changes less often than the recipe, installed editable as in the README.
COPY pyproject.toml ./
COPY common/ common/
RUN python3 -m pip install --no-cache-dir --no-deps -e .

COPY recipes/magihuman/ recipes/magihuman/

# npu-entrypoint sources the CANN set_env.sh, then runs the recipe; `docker run` arguments are passed to
# run.sh, e.g. `--weights /weights --mode distill --offload --out /outputs/clip.mp4`.
ENTRYPOINT ["npu-entrypoint", "bash", "recipes/magihuman/run.sh"]

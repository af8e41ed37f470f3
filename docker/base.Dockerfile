# Base of every NPU recipe image: CANN toolkit + Python 3.11 + torch + torch_npu + requirements.txt
# (without its CPU torch pin). Versions: docker/versions.env.
#
#   docker build -f docker/base.Dockerfile -t npu-cookbook/base .
#   Atlas A3:  add --build-arg CANN_IMAGE=quay.io/ascend/cann:9.1.0-a3-ubuntu22.04-py3.11
#   Ascend 950: add --build-arg CANN_IMAGE=quay.io/ascend/cann:9.1.0-950-ubuntu22.04-py3.11

# Default = CANN_IMAGE in docker/versions.env (tests/test_docker.py keeps them equal).
ARG CANN_IMAGE=quay.io/ascend/cann:9.1.0-910b-ubuntu22.04-py3.11
FROM ${CANN_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1

WORKDIR /opt/npu-cookbook
# libibverbs1: what the Mooncake transfer engine (PD disaggregation's KV transfer) links against;
# libtcmalloc-minimal4: the allocator the benches restart under (common/cpu_malloc.py)
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*
COPY docker/versions.env docker/versions.env
COPY requirements.txt requirements-npu.txt requirements-nodeps.txt ./

# torch from the CPU wheel index (the NPU backend comes from torch_npu; this keeps CUDA wheels out),
# then torch_npu from PyPI together with requirements.txt minus its `torch==` line, torch held at
# the version torch_npu was built against.
RUN . docker/versions.env \
    && python3 -c "import sys; v = '%d.%d' % sys.version_info[:2]; assert v == '${PYTHON_VERSION}', v" \
    && python3 -m pip install --no-cache-dir --index-url "${TORCH_CPU_INDEX_URL}" "torch==${NPU_TORCH_VERSION}" \
    && grep -v -E '^torch==' requirements.txt > /tmp/requirements-without-torch.txt \
    && python3 -m pip install --no-cache-dir "torch==${NPU_TORCH_VERSION}" "torch-npu==${TORCH_NPU_VERSION}" \
        -r /tmp/requirements-without-torch.txt \
    && python3 -m pip install --no-cache-dir --no-deps -r requirements-nodeps.txt \
    && rm /tmp/requirements-without-torch.txt

# The CANN environment is loaded by the entrypoint (it sources
# /usr/local/Ascend/ascend-toolkit/set_env.sh, and NNAL's set_env.sh when present), so it holds
# for whatever command the container runs, including `docker exec ... npu-entrypoint CMD`.
COPY --chmod=755 docker/npu-entrypoint.sh /usr/local/bin/npu-entrypoint
ENTRYPOINT ["npu-entrypoint"]
CMD ["bash"]

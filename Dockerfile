# syntax=docker/dockerfile:1.7
#
# vllm-exl3 appliance for NVIDIA DGX Spark (GB10, sm_121, arm64): stock vLLM from NGC + the exl3 plugin with its
# CUDA kernels, ExLlamaV3's extension prebuilt, supervisord, health checks. Build it on a Spark (or any arm64
# host with BuildKit); no GPU is needed to build:
#
#   docker buildx build -t vllm-exl3:dev .                                   # kernels for sm_121a
#   docker buildx build --build-arg EXTRA_CUDA_ARCHS=9.0a -t vllm-exl3:dev .  # ... and Hopper (sm_90a)
#
# Base image: NGC vLLM 26.10-py3 = vLLM 0.31.0, PyTorch 2.15.0a0, CUDA 13.4.3, Python 3.12 (NVIDIA's 26.10
# release notes). Pin its digest for reproducible builds; `docker buildx imagetools inspect
# nvcr.io/nvidia/vllm:26.10-py3` prints it:
#   --build-arg BASE_DIGEST=@sha256:<digest>
ARG BASE_IMAGE=nvcr.io/nvidia/vllm:26.10-py3
ARG BASE_DIGEST=

# ---------------------------------------------------------------------------------------------------------------
# builder: compile csrc/ into the plugin wheel and ExLlamaV3's extension, then prove the cubins are there.
# ---------------------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE}${BASE_DIGEST} AS builder
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Kernels are compiled for these targets only. 12.1a = GB10 with its arch-specific instructions; it must be set
# explicitly: with no GPU visible, torch's own detection fails (IndexError) rather than guessing.
ARG TORCH_CUDA_ARCH_LIST=12.1a
# More targets, ';'-separated, e.g. 9.0a for Hopper test machines.
ARG EXTRA_CUDA_ARCHS=
# Parallel nvcc jobs: each takes several GiB, and the builder shares the Spark's memory with everything else.
ARG MAX_JOBS=8
# ExLlamaV3 from PyPI, checked against the hash of the wheel this Dockerfile was written for (change both together).
ARG EXLLAMAV3_VERSION=1.6.5
ARG EXLLAMAV3_SHA256=550c0d04c755f249840e5c1edc26b0e80c7342c33b5d99ad17479abb407e8ded

ENV MAX_JOBS=${MAX_JOBS} \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src

RUN --mount=type=cache,target=/root/.cache/pip \
    pip download --no-deps --only-binary=:all: --dest /dist "exllamav3==${EXLLAMAV3_VERSION}" \
    && echo "${EXLLAMAV3_SHA256}  /dist/exllamav3-${EXLLAMAV3_VERSION}-py3-none-any.whl" | sha256sum --check \
    && pip install --no-deps /dist/exllamav3-*.whl

COPY pyproject.toml setup.py README.md LICENSE NOTICE THIRD_PARTY_NOTICES.md ./
COPY csrc csrc
COPY plugin plugin
COPY tools tools

# One target list for both builds; check-cubins gets the same targets as sm_XXX names (12.1a -> sm_121a) and
# fails the build when cuobjdump finds no SASS for one of them in either library; check-exllamav3-ext fails it when
# ExLlamaV3's extension lacks an entry point the exllamav3 backend's routed experts call.
RUN --mount=type=cache,target=/root/.cache/pip \
    archs="${TORCH_CUDA_ARCH_LIST}${EXTRA_CUDA_ARCHS:+;${EXTRA_CUDA_ARCHS}}" \
    && export TORCH_CUDA_ARCH_LIST="${archs}" \
    && VLLM_EXL3_BUILD_CUDA=1 pip wheel --no-build-isolation --no-deps --wheel-dir /dist . \
    && tools/build-exllamav3-ext /dist \
    && python3 -m zipfile -e /dist/vllm_exl3-*.whl /tmp/so/plugin \
    && python3 -m zipfile -e /dist/exllamav3_ext_prebuilt-*.whl /tmp/so/exllamav3 \
    && for so in /tmp/so/plugin/vllm_exl3/kernels/_C*.so /tmp/so/exllamav3/exllamav3_ext*.so; do \
         echo "${archs}" | tr ';' '\n' | sed -E 's/^([0-9]+)\.([0-9]+)(.*)$/sm_\1\2\3/' \
           | xargs --verbose tools/check-cubins "${so}" || exit 1; \
       done \
    && tools/check-exllamav3-ext /tmp/so/exllamav3/exllamav3_ext*.so \
    && sha256sum /dist/*.whl > /dist/SHA256SUMS

# ---------------------------------------------------------------------------------------------------------------
# runtime: the same NGC image, plus the wheels, supervisord, presets and health checks; runs as a non-root user.
# ---------------------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE}${BASE_DIGEST} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ARG BASE_IMAGE
ARG BASE_DIGEST
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG SOURCE_URL=
LABEL org.opencontainers.image.title="vllm-exl3" \
      org.opencontainers.image.description="Serve EXL3 (ExLlamaV3 trellis) MoE models with stock vLLM 0.31 on NVIDIA DGX Spark, one or two nodes" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}${BASE_DIGEST}"

# The SHA256SUMS copy makes the wheels part of this layer's cache key (a bind mount alone is not), so a warm
# BuildKit cache can never install stale wheels. Every package the base image has keeps its version (its own
# list is the constraint): our wheels may add packages (marisa-trie, supervisor) but never move vLLM's, and a
# conflict fails the build instead of breaking vLLM at run time.
COPY --from=builder /dist/SHA256SUMS /opt/vllm-exl3/SHA256SUMS
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,from=builder,source=/dist,target=/dist \
    sha256sum --check --quiet /opt/vllm-exl3/SHA256SUMS \
    && pip list --format=freeze > /tmp/base-image-versions.txt \
    && pip install --constraint /tmp/base-image-versions.txt \
         /dist/vllm_exl3-*.whl /dist/exllamav3-*.whl supervisor==4.3.0 \
    && pip install --no-deps /dist/exllamav3_ext_prebuilt-*.whl \
    && rm /tmp/base-image-versions.txt \
    && python3 -c "import importlib.util as u; s = u.find_spec('exllamav3_ext'); \
assert s and s.origin.endswith('.so'), 'exllamav3 would JIT-compile: no prebuilt exllamav3_ext'"

COPY deploy/supervisord.conf /etc/vllm-exl3/supervisord.conf
COPY deploy/supervisor.d /etc/vllm-exl3/supervisor.d
COPY plugin/vllm_exl3/appliance/presets /etc/vllm-exl3/presets
COPY healthchecks /opt/vllm-exl3/healthchecks

# uid 2000 in group 0 with group-writable state: runs under the default user or an arbitrary uid alike.
# The cache directories exist in the image so that compose's named volumes start with the right owner.
RUN useradd --uid 2000 --gid 0 --create-home --home-dir /home/vllm --shell /usr/sbin/nologin vllm \
    && mkdir -p /run/vllm-exl3 /home/vllm/.cache/vllm /home/vllm/.cache/flashinfer /home/vllm/.triton \
    && chown -R 2000:0 /run/vllm-exl3 /home/vllm \
    && chmod -R g=u /run/vllm-exl3 /home/vllm

ENV HOME=/home/vllm \
    VLLM_EXL3_ROLE=single \
    VLLM_EXL3_MODEL=/model \
    VLLM_EXL3_KERNEL=native \
    VLLM_EXL3_RUN_DIR=/run/vllm-exl3 \
    VLLM_EXL3_PRESET_DIR=/etc/vllm-exl3/presets \
    VLLM_EXL3_SUPERVISOR_D=/etc/vllm-exl3/supervisor.d \
    TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas \
    FLASHINFER_CUDA_ARCH_LIST=12.1a \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    PYTHONUNBUFFERED=1

USER 2000
WORKDIR /home/vllm
EXPOSE 8000

# Readiness by role (healthchecks/healthcheck.py). A first boot loads and compiles for many minutes; failures
# inside start-period do not count, and start-interval probes often so "healthy" shows up soon after.
HEALTHCHECK --interval=30s --timeout=15s --start-period=45m --start-interval=15s --retries=3 \
    CMD ["python3", "/opt/vllm-exl3/healthchecks/healthcheck.py", "readiness"]

ENTRYPOINT ["supervisord", "-c", "/etc/vllm-exl3/supervisord.conf"]

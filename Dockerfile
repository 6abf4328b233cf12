# tandem image: one image, one service per container (see compose.yaml).
FROM python:3.11-slim
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-tools curl && rm -rf /var/lib/apt/lists/*
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
# TORCH_SPEC: "torch==2.13.0" for the CPU build (default) or a CUDA build for GPU hosts
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install --no-cache-dir "${TORCH_SPEC}" && pip install --no-cache-dir .
ENTRYPOINT ["tandem"]

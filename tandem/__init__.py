"""tandem: LLM serving with disaggregated prefill and decode pools.

The import namespace over the repository's top-level folders (installed through
setuptools' package-dir mapping, see pyproject.toml):

    tandem              CLI, launcher, default-model resolution, GPU placement (top)
    tandem.bench        load client, engine and cluster benchmarks (top)
    tandem.gateway      HTTP/OpenAI API, admission, failover, gRPC admin (service; no torch)
    tandem.prefill      prefill scheduler and worker (service)
    tandem.decode       decode scheduler, worker and prefill handoff (service)
    tandem.kvtransfer   KV sender/receiver and the shm, cuda_ipc and nccl transports
    tandem.engine       model, loader, paged KV pool, sampler, CUDA graphs
    tandem.kernels      Triton kernels beside their torch references
    tandem.cluster      wire messages, Redis keys, registry, settings, policies (bottom; no torch)

Each layer imports only the layers below it (tests/unit/test_layers.py holds it).
"""

from tandem import import_guard

import_guard.install()  # before anything of tandem runs: the checkout's folders are never top-level modules

__version__ = "0.1.0"

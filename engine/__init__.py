"""What both worker pools execute: the model, its paged KV pool, and sampling.

Modules, in the order data flows through them:

- ``config``: ``ModelConfig`` from an HF checkpoint's config.json (+ generation_config.json);
  Llama 2/3, Qwen2 and Mistral; both transformers 4.x and 5.x config layouts.
- ``loader``: ``load_model(path, dtype, device)`` reads safetensors directly and fuses
  q/k/v -> ``qkv_proj`` and gate/up -> ``gate_up_proj``.
- ``rope``: the [max_position, head_dim] cos|sin table (default, linear, llama3 scaling).
- ``kv_cache``: ``KVCachePool``, one [layers, 2, blocks, block_size, kv_heads, head_dim]
  tensor; on the CPU optionally a /dev/shm file another process can map.
- ``attention``: ``SeqChunk`` (a sequence's new tokens + its block table) and
  ``build_metadata`` -> ``AttentionMetadata`` for one flattened, unpadded batch.
- ``model``: ``LlamaFamilyModel``; every heavy op goes through ``tandem.kernels.ops``.
- ``runner``: ``ModelRunner.forward(chunks) -> logits`` of each sequence's last new token.
- LoRA: ``lora_adapter`` (a PEFT adapter read and checked, its digest), ``lora_weights`` (the
  device slots, stacked per projection), ``lora_manager`` (adapters by name, the host cache, LRU
  slots), ``lora_batch`` (a step's rows grouped by slot; the projections' LoRA).
- ``sampler``: ``sample(logits, params, step_indices)``; seeded rows reproducible across
  batches and workers.
- ``demo_model``: ``make_tiny_checkpoint``, the tiny random-weight model ``--model demo`` serves
  (random weights + a locally built tokenizer); the tests build their checkpoints with it too.

Block allocation (which block ids a sequence gets) is the schedulers' business, in
plain Python; the engine only reads and writes the blocks it is handed.
"""

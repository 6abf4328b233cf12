"""The step profile's bookkeeping: kernels grouped by kind, and the FLOPs of a forward's GEMMs."""

from tandem.bench.decode_profile import gemm_flops, gemm_summary, kinds, step_parts
from tandem.bench.engine import hf_config_dict
from tandem.engine.config import ModelConfig


def test_kernels_are_grouped_by_kind():
    table = {"nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT": 50.0, "_skinny_gemm_kernel": 20.0,
             "_decode_partial_kernel": 12.0, "_decode_reduce_kernel": 3.0, "_fused_prefill_attention": 5.0,
             "_rms_norm_kernel": 7.0,
             "void at::native::elementwise_kernel<...>": 3.0}
    assert kinds(table) == {"gemm": 70.0, "attention": 20.0, "other": 10.0}


def test_llama3_8b_gemm_flops_per_token_is_twice_its_projection_weights():
    config = ModelConfig.from_dict(hf_config_dict("llama3-8b"))
    # 8.03 B parameters, 0.53 B of them the embedding table (no GEMM): 2 x 7.5 B per token
    per_token = gemm_flops(config, 1, 1)
    assert 14.9e9 < per_token < 15.1e9
    assert gemm_flops(config, 1024, 1) < 1024 * per_token  # one LM-head row, not 1,024
    summary = gemm_summary({"kernels_us": {"gemm_kernel": 1e6}}, config, 1, 1, matmul_tflops=1.0)
    assert abs(summary["gemm_TFLOPs"] - per_token / 1e12) < 1e-9


def test_a_step_is_split_into_kernels_by_kind_gaps_sampling_and_host():
    kernels = {"_skinny_gemm_kernel": 4000.0, "_decode_partial_kernel": 2500.0, "_rms_norm_kernel": 500.0}
    parts = step_parts(step_ms=8.0, replay_ms=7.4, sampling_ms=0.3, kernels_us=kernels)
    assert parts == {"gemm": 4.0, "attention": 2.5, "other": 0.5, "between kernels": 0.4, "sampling": 0.3,
                     "host": 0.3}
    assert abs(sum(parts.values()) - 8.0) < 1e-9  # the parts add up to the step
    # kernels that overlap under programmatic dependent launch sum to more than the replay
    assert step_parts(7.0, 6.5, 0.2, kernels)["between kernels"] == -0.5

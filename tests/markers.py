"""Which tests are not pure, decided once at collection (``tests/conftest.py`` applies it).

``make test-fast`` deselects every test marked here; ``make test`` runs them all. A test is
marked ``services`` when its fixtures reach a real service (PostgreSQL, Redis, RabbitMQ, moto's
server), ``subprocess`` when it starts processes (seen in its fixtures or its own source),
``gpu`` when it is skipped without CUDA, and ``slow`` when it is named in ``SLOW`` (measured:
over about 3 s on two cores on its own). A module may also say so itself with ``pytestmark``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable

import pytest

# Fixtures that reach a service, directly or through their own fixtures.
SERVICE_FIXTURES = frozenset(
    {"pg_admin_user", "pg_url", "s3_endpoint", "s3_client", "shared_bucket", "aws_env", "s3_bucket", "redis_broker",
     "amqp_broker", "sqs_broker", "pg_redis_s3_stack", "pg_amqp_s3_stack", "pg_sqs_s3_stack"}
)  # fmt: skip
# Parameters of the parametrized fixtures (``db_url``, ``store``) that pick a service.
SERVICE_PARAMS = frozenset({"postgres", "s3", "redis", "amqp", "rabbitmq", "sqs"})
# Fixtures that start processes.
SUBPROCESS_FIXTURES = frozenset({"spawn_worker", "tcp_proxy"})
# What a test's own source says when it starts a process.
SUBPROCESS_SOURCE = re.compile(r"\bsubprocess\.|\bPopen\(|\bspawn_worker\b|tensor_parallel_size=[2-9]|run_cli_process")

# Measured with ``pytest -m "not services and not subprocess" --durations=0`` on the 2-core machine
# (other jobs running): a test at about a second or more there, with all its parameters. A path
# alone would mark every test of the module.
SLOW: tuple[str, ...] = (
    "tests/benchmarks/test_gpu_check.py::test_a_step_that_fails_or_outlives_its_limit_is_recorded_and_the_next_still_runs",
    "tests/benchmarks/test_gpu_check.py::test_steps_left_without_time_in_the_budget_are_skipped",
    "tests/engine/test_admission.py::test_same_greedy_outputs_and_fewer_preemptions_on_a_tiny_model",
    "tests/engine/test_attention_torch.py::test_cascade_decoding_keeps_outputs_exact",
    "tests/engine/test_attention_torch.py::test_torch_backend_matches_the_reference",
    "tests/engine/test_bf16_logits.py::test_bf16_logits_are_as_close_as_transformers_own",
    "tests/engine/test_chunk_budget.py::test_the_engine_shrinks_the_prefill_budget_under_an_unmeetable_target",
    "tests/engine/test_embeddings.py::test_decoder_vectors_equal_sentence_transformers",
    "tests/engine/test_embeddings.py::test_last_token_pooling_reuses_the_prefix_cache_and_mean_pooling_does_not",
    "tests/engine/test_embeddings.py::test_embedding_and_generation_share_steps_and_keep_their_outputs",
    "tests/engine/test_encoder_embeddings.py::test_encoder_vectors_equal_sentence_transformers",
    "tests/engine/test_correctness.py::test_batch_of_mixed_prompts_matches_transformers",
    "tests/engine/test_qwen3_5.py::test_batch_of_mixed_prompts_matches_transformers",
    "tests/engine/test_qwen3_5.py::test_requests_joining_mid_flight",
    "tests/engine/test_qwen3_5.py::test_preemption_when_kv_cache_is_small",
    "tests/engine/test_qwen3_5.py::test_chunked_prefill_carries_the_state_across_chunks",
    "tests/engine/test_qwen3_5.py::test_follow_ups_sharing_a_prefix_recompute_it",
    "tests/engine/test_qwen3_5.py::test_one_token_prompts_and_decodes_start_from_a_zero_state",
    "tests/engine/test_qwen3_5.py::test_ngram_speculative_decoding_matches_transformers",
    "tests/engine/test_qwen3_5.py::test_a_hybrid_draft_model_is_refused",
    "tests/engine/test_qwen3_5.py::test_a_multimodal_checkpoint_runs_its_language_model",
    "tests/engine/test_qwen3_5.py::test_the_transformers_fallback_refuses_linear_attention",
    "tests/kernels/test_gated_delta_reference.py::test_chunked_rule_matches_transformers",
    "tests/kernels/test_gated_delta_triton.py::test_prefill_matches_the_reference",
    "tests/kernels/test_gated_delta_triton.py::test_prefill_snapshots_match_the_reference",
    "tests/engine/test_cuda_graphs.py::test_hybrid_decode_graphs_match_transformers",
    "tests/kernels/test_gated_delta_in_model.py::test_qwen3_5_on_the_cuda_path_runs_the_triton_delta_rule_and_matches_transformers",
    "tests/kernels/test_gated_delta_in_model.py::test_speculative_decoding_on_the_cuda_path_rolls_the_state_back",
    "tests/worker/entrypoints/test_run_hybrid.py::test_run_answers_with_a_tiny_qwen3_5",
    "tests/engine/test_correctness.py::test_chunked_prefill_under_a_small_token_budget",
    "tests/engine/test_correctness.py::test_config_variants_match_transformers",
    "tests/engine/test_correctness.py::test_phi3_long_factors_past_the_original_context_match_transformers",
    "tests/engine/test_correctness.py::test_preemption_when_kv_cache_is_small",
    "tests/engine/test_correctness.py::test_requests_joining_mid_flight",
    "tests/engine/test_deepseek_v3.py::test_the_cache_holds_one_latent_and_rope_key_per_token",
    "tests/engine/test_deepseek_v3.py::test_the_multi_token_prediction_layer_is_skipped",
    "tests/engine/test_deepseek_v3.py::test_ngram_speculation_verifies_through_the_latent_cache",
    "tests/engine/test_cuda_graphs.py::test_decode_graphs_match_transformers",
    "tests/engine/test_cuda_graphs.py::test_graph_and_eager_steps_interleave",
    "tests/engine/test_cuda_graphs.py::test_seeded_sampling_is_the_same_with_graphs",
    "tests/engine/test_cuda_graphs.py::test_the_captured_forward_never_syncs_with_the_host",
    "tests/engine/test_engine_api.py::test_final_only_requests_report_once_with_the_streamed_text",
    "tests/engine/test_gemma4.py::test_configs_it_cannot_run_exactly_are_refused",
    "tests/engine/test_gemma4.py::test_published_config_spelling_reads_the_same",
    "tests/engine/test_gemma4.py::test_shared_kv_layers_own_no_cache",
    "tests/engine/test_gguf.py::test_gguf_gemma3_layer_keys_override_llama_cpp_defaults",
    "tests/engine/test_gguf.py::test_gguf_gemma_matches_transformers_gguf_loader",
    "tests/engine/test_gguf.py::test_gguf_gemma_matches_transformers_on_the_original",
    "tests/engine/test_gguf.py::test_gguf_greedy_matches_transformers",
    "tests/engine/test_gguf.py::test_gguf_phi3_and_moe_match_transformers_on_the_original",
    "tests/engine/test_gguf.py::test_smollm2_chat_matches_transformers",
    "tests/engine/test_gguf_2026.py::test_gguf_2026_matches_transformers_on_the_original",
    "tests/engine/test_glm4_moe.py::test_fused_kernel_path_matches_transformers",
    "tests/engine/test_glm4_moe.py::test_multi_token_prediction_layers_are_skipped",
    "tests/engine/test_glm4_moe.py::test_ngram_speculation_is_exact",
    "tests/engine/test_input_boundary.py::test_any_prompt_ends_as_an_output_and_never_sinks_the_batch",
    "tests/engine/test_input_boundary.py::test_any_stop_value_is_accepted_or_a_value_error_naming_stop",
    "tests/engine/test_kv_cache.py::test_request_too_long_for_the_cache_is_rejected",
    "tests/engine/test_moe_fused_kernel.py::test_decode_graphs_on_the_kernel_path_match_transformers_and_never_sync",
    "tests/engine/test_moe_fused_kernel.py::test_kernel_path_matches_transformers",
    "tests/engine/test_moe_fused_kernel.py::test_torch_path_on_cpu_is_not_captured",
    "tests/engine/test_prefix_caching.py::TestBlockPool::runTest",
    "tests/engine/test_prefix_caching.py::test_cache_hits_keep_outputs_exact",
    "tests/engine/test_prefix_caching.py::test_eviction_under_memory_pressure_keeps_outputs_exact",
    "tests/engine/test_fp8_kv_cache.py::test_fp8_kv_cache_logprobs_stay_within_the_bound",
    "tests/engine/test_gpt_oss_mxfp4.py::test_transformers_dequantizes_the_blocks_we_wrote",
    "tests/engine/test_gpt_oss_mxfp4.py::test_experts_kept_in_mxfp4_on_the_fused_kernel",
    "tests/engine/test_gpt_oss_mxfp4.py::test_released_checkpoint_matches_transformers",
    "tests/engine/test_gpt_oss_mxfp4.py::test_preemption_chunked_prefill_and_prefix_caching",
    "tests/engine/test_gpt_oss_mxfp4.py::test_two_ranks_split_the_dequantized_experts",
    "tests/engine/test_multimodal_gemma.py::test_multimodal_checkpoint_runs_its_language_model",
    "tests/engine/test_multimodal_gemma.py::test_transformers_multimodal_model_answers_the_same_on_text",
    "tests/engine/test_multimodal_gemma.py::test_two_ranks_split_a_multimodal_checkpoints_language_model",
    "tests/engine/test_tensor_parallel.py::test_two_ranks_split_gemma4_per_layer_kind",
    "tests/engine/test_tensor_parallel.py::test_two_ranks_split_qwen3_5s_linear_attention_heads_and_state",
    "tests/engine/test_fp8_kv_cache.py::test_the_triton_backend_reads_the_fp8_cache_within_the_bound",
    "tests/engine/test_fp8_kv_cache.py::test_the_checkpoints_kv_scales_are_applied_within_the_bound[attn_head-torch]",
    "tests/engine/test_fp8_kv_cache.py::test_the_checkpoints_kv_scales_are_applied_within_the_bound[attn_head-triton]",
    "tests/engine/test_fp8_kv_cache.py::test_without_the_scales_the_fp8_cache_is_measurably_worse",
    "tests/kernels/test_fp8_kv_cache.py::test_kv_write_stores_torchs_e4m3_bytes",
    "tests/kernels/test_fp8_kv_cache.py::test_paged_attention_reads_an_fp8_cache",
    "tests/engine/test_quantized_checkpoints.py::test_quantized_llama_matches_transformers_on_the_weights_it_stores",
    "tests/engine/test_quantized_checkpoints.py::test_transformers_own_fp8_loader_reads_the_weights_we_read",
    "tests/engine/test_quantized_checkpoints.py::test_requests_joining_mid_flight",
    "tests/engine/test_quantized_checkpoints.py::test_preemption_chunked_prefill_and_prefix_caching",
    "tests/engine/test_quantized_checkpoints.py::test_quantized_experts_match_transformers",
    "tests/engine/test_quantized_checkpoints.py::test_two_ranks_shard_a_quantized_checkpoint",
    "tests/engine/test_quantized_kept_weights.py::test_kept_weights_answer_as_transformers_on_the_stored_weights",
    "tests/engine/test_quantized_kept_weights.py::test_gguf_kept_weights_answer_as_transformers_gguf_loader",
    "tests/engine/test_quantized_kept_weights.py::test_two_ranks_keep_their_shards_quantized",
    "tests/engine/test_spec_decode.py::test_a_sliding_window_draft_lets_blocks_be_released_and_never_reads_them",
    "tests/engine/test_spec_decode.py::test_draft_target_as_its_own_draft_accepts_nearly_everything",
    "tests/engine/test_spec_decode.py::test_ngram_greedy_is_exact_on_gpt_oss_with_chunked_prefill",
    "tests/engine/test_spec_decode.py::test_ngram_greedy_is_exact_under_preemption",
    "tests/engine/test_spec_decode.py::test_ngram_greedy_is_exact_with_chunked_prefill_and_prefix_caching",
    "tests/engine/test_spec_decode.py::test_sampling_with_speculation_keeps_the_distribution",
    "tests/engine/test_structured_outputs.py::test_every_schema_validates_alone_and_as_in_a_batch",
    "tests/engine/test_structured_outputs.py::test_every_schema_validates_in_a_batch_of_32",
    "tests/engine/test_structured_outputs.py::test_greedy_output_equals_transformers_masked_by_llguidance",
    "tests/engine/test_structured_outputs.py::test_json_object_and_a_schema_given_as_text",
    "tests/engine/test_structured_outputs.py::test_preemption_keeps_the_matcher_in_step",
    "tests/engine/test_triton_backend.py::test_chunked_prefill_under_a_small_token_budget",
    "tests/engine/test_triton_backend.py::test_deepseek_latent_decode_through_the_kernel",
    "tests/engine/test_triton_backend.py::test_forward_agrees_with_the_torch_backend",
    "tests/engine/test_triton_backend.py::test_gemma_sliding_windows_and_soft_caps",
    "tests/engine/test_triton_backend.py::test_gpt_oss_sinks_and_windows",
    "tests/engine/test_triton_backend.py::test_mixed_batch_matches_transformers_and_the_torch_backend",
    "tests/engine/test_triton_backend.py::test_preemption_when_kv_cache_is_small",
    "tests/engine/test_triton_backend.py::test_prefill_over_a_cached_prefix",
    "tests/kernels/test_quant_gemm.py::test_quant_gemm_kernels_compile_for_gpu_without_spills",
    "tests/kernels/test_fused_moe.py::test_clamped_swiglu_with_biases_matches_reference",
    "tests/kernels/test_fused_moe.py::test_gpt_oss_variants_compile_for_gpu_without_spills",
    "tests/kernels/test_fused_moe.py::test_matches_reference",
    "tests/kernels/test_fused_moe.py::test_mxfp4_weights_dequantized_in_the_k_loop",
    "tests/kernels/test_paged_attention_decode.py::test_paged_attention_decode_like",
    "tests/kernels/test_paged_attention_misc.py::test_chunked_prefill_matches_full_prefill",
    "tests/kernels/test_paged_attention_misc.py::test_decode_split_count_is_what_the_kernel_chooses",
    "tests/kernels/test_paged_attention_misc.py::test_non_power_of_two_shapes",
    "tests/kernels/test_paged_attention_misc.py::test_padding_rows_and_empty_requests",
    "tests/kernels/test_paged_attention_misc.py::test_split_kv_with_empty_splits",
    "tests/kernels/test_paged_attention_prefill.py::test_paged_attention_prefill_like",
    "tests/kernels/test_paged_attention_sinks.py::test_sinks_match_the_reference",
    "tests/kernels/test_paged_attention_window_softcap.py::test_saturated_softcap_matches_the_reference",
    "tests/kernels/test_paged_attention_window_softcap.py::test_window_and_softcap_match_the_reference",
    "tests/test_architecture.py::test_every_layer_imports_only_the_layers_below_it",
    "tests/test_architecture.py::test_there_are_no_import_circles",
    "tests/worker/api/test_api_access.py::test_a_missing_wrong_or_revoked_key_gets_401",
    "tests/worker/api/test_api_access.py::test_an_upload_that_stalls_mid_body_gets_408_and_frees_its_slot",
    "tests/worker/api/test_api_access.py::test_lists_page_with_after_cursors_as_openais_do",
    "tests/worker/api/test_catalog.py::test_submit_warns_only_for_a_model_nobody_declared",
    "tests/worker/api/test_catalog.py::test_with_no_worker_the_sdk_batch_for_a_declared_or_once_served_model_waits_as_demand",
    "tests/worker/batchio/test_body_fields.py::test_completions_fields_through_conveyor_run",
    "tests/worker/batchio/test_hostile_lines.py::test_every_non_blank_line_ends_as_exactly_one_entry",
    "tests/worker/batchio/test_structured_outputs.py::test_a_structured_job_through_conveyor_run",
    "tests/worker/broker/test_submission_consumer.py::test_the_api_takes_a_submission_twice_sent_as_one_job_while_no_worker_runs",
    "tests/worker/entrypoints/test_cli.py::test_submit_status_results_cancel",
    "tests/worker/entrypoints/test_embeddings_run.py::test_run_embeds_every_input_shape_as_sentence_transformers_does",
    "tests/worker/entrypoints/test_embeddings_run.py::test_plain_rows_with_an_input_column_are_embedded",
    "tests/worker/entrypoints/test_embeddings_run.py::test_run_embeds_with_an_encoder_and_an_input_over_the_step_budget_fails_alone",
    "tests/worker/entrypoints/test_embeddings_run.py::test_a_model_that_cannot_embed_answers_each_line_with_the_reason",
    "tests/worker/entrypoints/test_embeddings_run.py::test_results_export_as_parquet_one_row_per_vector",
    "tests/worker/entrypoints/test_exit_codes.py::test_format_flag_forces_csv",
    "tests/worker/entrypoints/test_model_impl_flag.py::test_worker_passes_model_impl_to_the_engine_config",
    "tests/worker/entrypoints/test_serve_cli.py::test_the_conveyor_serve_process_answers_the_sdk",
    "tests/worker/execution/test_cold_start.py::test_bench_cold_start_times_fresh_processes",
    "tests/worker/execution/test_process_state.py::test_the_metrics_server_answers_health_and_readiness_beside_metrics",
    "tests/worker/execution/test_shards.py::test_a_redelivered_shard_is_skipped",
    "tests/worker/execution/test_shards.py::test_failed_attempts_are_retried_then_the_items_fail_and_the_job_goes_on",
    "tests/worker/faults/test_chaos.py::test_one_of_each_fault_loses_and_repeats_no_line",
    "tests/worker/faults/test_broker_down.py::test_a_job_whose_enqueue_failed_is_retried_without_a_new_upload",
    "tests/worker/faults/test_dependency_gate.py::test_the_gate_passes_other_errors_through_and_gives_up_after_its_patience",
    "tests/worker/faults/test_dependency_gate.py::test_the_gate_pauses_work_until_the_dependency_is_back_and_says_so_once",
    "tests/worker/faults/test_prefix_group_faults.py::test_an_expired_grouped_job_reports_the_rest_by_line",
    "tests/worker/faults/test_prefix_group_faults.py::test_duplicated_shard_messages_run_each_line_once",
    "tests/worker/jobs/test_announcements.py::test_a_failed_publish_is_tried_again_a_lease_later",
    "tests/worker/jobs/test_expiry.py::test_a_partly_done_job_keeps_its_finished_results_when_it_expires",
    "tests/worker/jobs/test_expiry.py::test_an_unserved_job_expires_at_its_window_and_follow_ends",
    "tests/worker/jobs/test_files_and_keys.py::test_a_verified_key_is_taken_without_the_database_for_a_moment",
    "tests/worker/jobs/test_files_and_keys.py::test_an_upload_streams_through_the_server_in_bounded_memory",
    "tests/worker/jobs/test_jobs.py::test_an_unreachable_broker_is_named_before_a_job_is_created",
    "tests/worker/jobs/test_openai_compat.py::test_completion_window_is_recorded_with_its_expiry",
    "tests/worker/jobs/test_openai_compat.py::test_status_json_validates_as_an_openai_batch_in_every_state",
    "tests/worker/jobs/test_openai_compat.py::test_transient_and_expired_states_validate_as_openai_batches",
    "tests/worker/jobs/test_prefix_jobs.py::test_grouped_and_input_order_runs_give_the_same_files_in_input_order",
    "tests/worker/metrics/test_metrics_database.py::test_shards_wait_for_a_worker_then_fly_under_its_lease_and_wait_again_when_it_expires",
    "tests/engine/test_llm_chat.py::test_chat_gives_generates_tokens_for_the_rendered_template",
    "tests/engine/test_llm_lifecycle.py::test_the_with_block_releases_the_engine",
    "tests/test_docs_rendering.py::test_no_paragraph_swallows_a_list",
)


def _source(item: pytest.Item) -> str:
    function = getattr(item, "function", None)
    try:
        return inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        return ""


def _params(item: pytest.Item) -> Iterable[object]:
    callspec = getattr(item, "callspec", None)
    return callspec.params.values() if callspec is not None else ()


def _names_a_service(param: object) -> bool:
    """A parameter that picks a service: ``postgres``, ``s3``..., or a stack fixture's name (``pg_...``)."""
    return isinstance(param, str) and (param in SERVICE_PARAMS or param.startswith("pg_"))


def kinds(item: pytest.Item) -> set[str]:
    """The markers ``item`` gets from what it uses."""
    found: set[str] = set()
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & SERVICE_FIXTURES or any(_names_a_service(p) for p in _params(item)):
        found.add("services")
    if fixtures & SUBPROCESS_FIXTURES or SUBPROCESS_SOURCE.search(_source(item)):
        found.add("subprocess")
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if "CUDA" in reason or "GPU" in reason:
            found.add("gpu")
    if any(item.nodeid == s or item.nodeid.startswith((s + "::", s + "[")) for s in SLOW):
        found.add("slow")
    return found


def apply(items: list[pytest.Item]) -> None:
    for item in items:
        for name in sorted(kinds(item)):
            item.add_marker(name)

"""Megatron-LM's arguments (``common.pt``'s ``args``) by what they do to a GPT model's forward, for an export to
transformers: those known not to change it (how the run was parallelised, trained, checkpointed and logged, its data
and tokenizer, its kernels and precision recipes, dropout and initialisation, options of other models), and
Megatron-LM's default of the others. An argument ckptfix neither maps nor knows to leave the forward alone changes it
unless it holds its default: :func:`changed` names it, and the export refuses it.

The names are megatron-core 0.16.1's ``megatron/training/arguments.py`` (its parser, and what ``validate_args`` and
the training loop add), with the older names of 0.8 to 0.13 that it dropped.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

# known not to change a trained GPT model's forward
_NO_MATH = """
    account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split accumulate_allreduce_grads_in_fp32
    adam_beta1 adam_beta2 adam_eps add_position_embedding adlr_autoresume adlr_autoresume_interval align_grad_reduce
    align_param_gather allow_ambiguous_pad_tokens app_tag_run_name app_tag_run_version apply_query_key_layer_scaling
    apply_rope_fusion apply_wd_to_qk_layernorm async_save async_tensor_model_parallel_allreduce attention_backend
    attention_dropout attention_softmax_in_fp32 auto_detect_ckpt_format barrier_with_L1_time batch_invariant_mode
    batch_size bert_binary_head bert_embedder_type bert_load bias_dropout_fusion bias_gelu_fusion bias_swiglu_fusion
    biencoder_projection_dim biencoder_shared_query_context_model block_data_path cache_mla_latents calc_ft_timeouts
    calculate_per_token_loss check_for_large_grads check_for_nan_in_loss_and_grad check_for_spiky_loss
    check_weight_hash_across_dp_replicas_interval checkpoint_activations ckpt_assume_constant_structure
    ckpt_convert_format ckpt_convert_save ckpt_convert_update_legacy_dist_opt_format ckpt_format
    ckpt_fully_parallel_load ckpt_fully_parallel_save ckpt_fully_parallel_save_deprecated ckpt_step classes_fraction
    clip_grad clone_scatter_output_in_embedding config_logger_dir consumed_train_bins consumed_train_samples
    consumed_valid_samples context_parallel_size cp_comm_type cpu_offloading cpu_offloading_num_layers
    create_all_gather_group create_attention_mask_in_dataloader cross_entropy_fusion_impl cross_entropy_loss_fusion
    cuda_graph_impl cuda_graph_scope cuda_graph_warmup_steps curr_iteration data_args_path data_cache_path
    data_parallel_random_init data_parallel_sharding_strategy data_parallel_size data_path data_per_class_fraction
    data_sharding dataloader_defer_npy_index_mmap dataloader_fast_cache_load dataloader_type
    ddp_average_in_collective ddp_bucket_size ddp_num_buckets ddp_pad_buckets_for_high_nccl_busbw
    ddp_reduce_scatter_with_fp32_accumulation decode_only_cuda_graphs decoder_first_pipeline_num_layers
    decoder_last_pipeline_num_layers decoder_seq_length decoupled_lr decoupled_min_lr decrease_batch_size_if_needed
    defer_embedding_wgrad_compute delay_grad_reduce delay_param_gather delay_wgrad_compute
    deprecated_use_mcore_models deterministic_mode dino_bottleneck_size dino_freeze_last_layer dino_head_hidden_size
    dino_local_crops_number dino_local_img_size dino_norm_last_layer dino_teacher_temp dino_warmup_teacher_temp
    dino_warmup_teacher_temp_epochs disable_bf16_reduced_precision_matmul disable_chunked_prefill disable_jit_fuser
    disable_mamba_mem_eff_path disable_straggler_on_startup disable_symmetric_registration dist_ckpt_format
    dist_ckpt_format_deprecated dist_ckpt_optim_fully_reshardable dist_ckpt_save_pre_mcore_014 dist_ckpt_strictness
    distrib_optim_fully_reshardable_mem_efficient distribute_saved_activations distributed_backend
    distributed_timeout_minutes distributed_timeout_seconds_after_init do_test do_train do_valid
    dump_param_to_param_group_map embedding_init_method_std embedding_path empty_unused_memory_level
    enable_cuda_graph enable_experimental enable_ft_package enable_full_sharding_in_hsdp enable_gloo_process_groups
    enable_msc enable_one_logger encoder_pipeline_model_parallel_size encoder_seq_length
    encoder_tensor_model_parallel_size end_weight_decay eod_mask_loss ep_overlap_early_attn_memory_release
    error_injection_rate error_injection_type eval_interval eval_iters evidence_data_path exit_duration_in_mins
    exit_interval exit_on_missing_checkpoint exit_signal exit_signal_handler exit_signal_handler_for_dataloader
    exp_avg_dtype exp_avg_sq_dtype expert_model_parallel_size expert_tensor_parallel_size external_cuda_graph
    fake_process_group fim_data fim_eod_token fim_fragment_rate fim_middle_token fim_no_prefix fim_pad_token
    fim_prefix_token fim_rate fim_split_sample fim_spm_rate fim_suffix_token fine_grained_activation_offloading
    finetune first_last_layers_bf16 flash_decode fp16_lm_cross_entropy fp32_residual_connection fp4 fp4_param
    fp4_quantizer_factory fp4_recipe fp8 fp8_amax_compute_algo fp8_amax_history_len fp8_interval fp8_margin
    fp8_param_gather fp8_quantizer_factory fp8_recipe fp8_wgrad fsdp_double_buffer fsdp_manual_registration
    ft_num_warmup_iters full_validation global_batch_size grad_reduce_in_bf16 gradient_accumulation_fusion
    gradient_reduce_div_fusion grpo_clamp_eps_lower grpo_clamp_eps_upper grpo_entropy_term_weight
    grpo_filter_groups_with_same_reward grpo_group_size grpo_iterations grpo_kl_beta grpo_prompts_per_step
    grpo_samples_per_iteration head_lr_mult hidden_dropout hierarchical_context_parallel_sizes
    high_priority_stream_groups hybrid_context_parallel hysteresis ict_head_size ict_load img_h img_w
    indexer_batch_size indexer_log_interval inference_batch_times_seqlen_threshold inference_coordinator_port
    inference_dynamic_batching inference_dynamic_batching_block_size
    inference_dynamic_batching_buffer_guaranteed_fraction inference_dynamic_batching_buffer_overflow_factor
    inference_dynamic_batching_buffer_size_gb inference_dynamic_batching_chunk_size
    inference_dynamic_batching_cuda_graph_max_tokens inference_dynamic_batching_cuda_graph_mixed_prefill_count
    inference_dynamic_batching_max_requests inference_dynamic_batching_max_requests_override
    inference_dynamic_batching_max_tokens inference_dynamic_batching_max_tokens_override
    inference_dynamic_batching_num_cuda_graphs inference_dynamic_batching_paused_buffer_size_gb
    inference_dynamic_batching_track_paused_request_events inference_dynamic_batching_unified_memory_level
    inference_fuse_tp_communication inference_logging_step_interval inference_max_batch_size
    inference_max_seq_length inference_rng_tracker inference_wandb_logging init_method_std
    init_method_xavier_uniform init_model_with_meta_device initial_loss_scale inprocess_active_world_size
    inprocess_barrier_timeout inprocess_completion_timeout inprocess_empty_cuda_cache inprocess_granularity
    inprocess_hard_timeout inprocess_heartbeat_interval inprocess_heartbeat_timeout inprocess_last_call_wait
    inprocess_max_iterations inprocess_monitor_process_interval inprocess_monitor_thread_interval
    inprocess_progress_watchdog_interval inprocess_restart inprocess_soft_timeout inprocess_termination_grace_time
    iter_per_epoch iteration iterations_to_skip keep_fp8_transpose_cache
    keep_fp8_transpose_cache_when_using_custom_fsdp kitchen_attention_backend kitchen_config_file
    kitchen_recipe_number langrl_env_config langrl_external_server langrl_inference_server_conversation_template
    langrl_inference_server_type lazy_mpu_init legacy_tokenizer load load_main_params_from_ckpt
    load_model_opt_format local_rank log_batch_size_to_tensorboard log_device_memory_used log_energy log_interval
    log_learning_rate_to_tensorboard log_loss_scale_to_tensorboard log_max_attention_logit log_memory_interval
    log_memory_to_tensorboard log_num_zeros_in_grad log_params_norm log_progress log_straggler log_throughput
    log_timers_to_tensorboard log_validation_ppl_to_tensorboard log_world_size_to_tensorboard logging_level
    loss_scale loss_scale_window lr lr_decay_iters lr_decay_samples lr_decay_style lr_warmup_fraction lr_warmup_init
    lr_warmup_iters lr_warmup_samples lr_wsd_decay_iters lr_wsd_decay_samples lr_wsd_decay_style main_grads_dtype
    main_params_dtype make_vocab_size_divisible_by manual_gc manual_gc_eval manual_gc_interval mask_factor mask_prob
    mask_type masked_softmax_fusion max_seqlen_per_dp_cp_rank max_tokens_to_oom memory_snapshot_path merge_file
    micro_batch_size microbatch_group_size_per_vp_stage mid_level_dataset_surplus min_loss_scale min_lr
    min_offloaded_tensor_size mlp_chunks_for_prefill mmap_bin_files mock_data model_parallel_size model_type
    moe_aux_loss_coeff moe_deepep_num_sms moe_enable_deepep moe_enable_routing_replay moe_extended_tp
    moe_flex_dispatcher_backend moe_grouped_gemm moe_hybridep_num_sms moe_layer_recompute
    moe_pad_expert_input_to_capacity moe_pad_experts_for_cuda_graph_inference moe_per_layer_logging
    moe_permute_fusion moe_router_bias_update_rate moe_router_dtype moe_router_fusion moe_router_load_balancing_type
    moe_router_padding_for_fp8 moe_router_padding_for_quantization moe_shared_expert_overlap
    moe_token_dispatcher_type moe_upcycling_granularity moe_use_legacy_grouped_gemm moe_use_upcycling
    moe_z_loss_coeff mtp_loss_scaling_factor multiple_validation_sets muon_extra_scale_factor muon_fp32_matmul_prec
    muon_momentum muon_num_ns_steps muon_scale_mode muon_split_qkv muon_tp_mode muon_use_nesterov
    nccl_all_reduce_for_prefill nccl_communicator_config_path nccl_ub no_load_optim no_load_rng
    no_persist_layer_norm no_save_optim no_save_rng no_weight_decay_cond_type non_persistent_ckpt_type
    non_persistent_global_ckpt_dir non_persistent_local_ckpt_algo non_persistent_local_ckpt_dir
    non_persistent_save_interval num_channels num_classes num_dataset_builder_threads
    num_distributed_optimizer_instances num_floating_point_operations_so_far num_layers_at_end_in_bf16
    num_layers_at_start_in_bf16 num_layers_per_virtual_pipeline_stage num_virtual_stages_per_pipeline_rank
    num_workers object_storage_cache_path offload_modules one_logger_async one_logger_project one_logger_run_name
    onnx_safe optimizer optimizer_cpu_offload optimizer_offload_fraction outer_dp_sharding_strategy
    output_bert_embeddings overlap_cpu_optimizer_d2h_h2d overlap_grad_reduce overlap_moe_expert_parallel_comm
    overlap_p2p_comm overlap_p2p_comm_warmup_flush overlap_param_gather overlap_param_gather_with_optimizer_step
    override_opt_param_scheduler patch_dim per_dataset_sequences_path per_split_data_args_path
    perform_initialization perform_rl_step phase_transition_iterations pin_cpu_grads pin_cpu_params
    pipeline_model_parallel_comm_backend pipeline_model_parallel_layout pipeline_model_parallel_size
    pipeline_model_parallel_split_rank pretrained_checkpoint profile profile_ranks profile_step_end
    profile_step_start qk_clip qk_clip_alpha qk_clip_threshold query_in_block_prob rampup_batch_size rank
    recompute_activations recompute_granularity recompute_method recompute_modules recompute_num_layers
    record_memory_history refit_method relative_attention_max_distance relative_attention_num_buckets replication
    replication_factor replication_jump rerun_mode reset_attention_mask reset_position_ids
    result_rejected_tracker_filename retriever_report_topk_accuracies retriever_score_scaling retriever_seq_length
    retro_cyclic_train_iters retro_encoder_attention_dropout retro_encoder_hidden_dropout retro_encoder_layers
    retro_project_dir reuse_grad_buf_for_mxfp8_param_ag rl_default_temperature rl_default_top_k rl_default_top_p
    rl_importance_sampling_truncation_coef rl_inference_expert_model_parallel_size
    rl_inference_expert_tensor_model_parallel_size rl_inference_logprobs_is_correction
    rl_inference_model_unified_memory_level rl_inference_pipeline_model_parallel_size
    rl_inference_tensor_model_parallel_size rl_offload_inference_model_weights_when_idle
    rl_offload_kv_cache_during_training rl_offload_optimizer_during_inference rl_parallel_generation_tasks
    rl_partial_rollouts rl_prompts_per_eval rl_remove_kv_cache_during_training rl_reset_cuda_graphs
    rl_sequence_packing_algo rl_sequence_packing_max_sequences_per_bin rl_skip_bos_token rl_training_cuda_graphs
    rl_use_sequence_packing rl_verify_model_weights_swap rope_scaling_factor run_workload_inspector_server
    s3_cache_path sample_rate save save_dgrads_interval save_interval save_retain_interval save_wgrads_interval
    scatter_gather_tensors_in_pipeline seed seq_length sequence_parallel sft sft_tokenizer_prompt_format
    sgd_momentum sharp_enabled_group short_seq_prob skip_train skipped_train_samples split
    standalone_embedding_stage start_weight_decay straggler_ctrlr_port straggler_minmax_count
    strict_fsdp_dtensor_load suggested_communication_unit_size swin_backbone_type symmetric_ar_type
    te_precision_config_file te_rng_tracker tensor_model_parallel_size tensorboard_dir tensorboard_log_interval
    tensorboard_queue_size test_data_path test_mode tiktoken_num_special_tokens tiktoken_pattern
    tiktoken_special_tokens timing_log_level timing_log_option titles_data_path to_test
    tokenizer_hf_include_special_tokens tokenizer_hf_use_fast tokenizer_metadata tokenizer_model
    tokenizer_sentencepiece_legacy tokenizer_special_tokens tokenizer_type torch_fsdp2_reshard_after_forward
    tp_comm_bootstrap_backend tp_comm_bulk_dgrad tp_comm_bulk_wgrad tp_comm_overlap tp_comm_overlap_ag
    tp_comm_overlap_cfg tp_comm_overlap_rs tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_split_rs
    train_data_path train_iters train_samples train_sync_interval transformer_impl
    transformer_pipeline_model_parallel_size trust_remote_code use_checkpoint_args
    use_checkpoint_opt_param_scheduler use_cpu_initialization use_custom_fsdp use_dist_ckpt use_dist_ckpt_deprecated
    use_distributed_optimizer use_flash_attn use_fused_weighted_squared_relu use_kitchen_attention use_legacy_models
    use_legacy_static_engine use_mamba_mem_eff_path use_mcore_models use_megatron_fsdp
    use_mp_args_from_checkpoint_args use_one_sent_docs use_persistent_ckpt_worker use_precision_aware_optimizer
    use_pytorch_profiler use_ring_exchange_p2p use_rotary_position_embeddings use_sharp use_te_activation_func
    use_tokenizer_model_from_checkpoint_args use_torch_fsdp2 use_torch_optimizer_for_cpu_offload
    use_tp_pp_dp_mapping valid_data_path variable_seq_lengths virtual_pipeline_model_parallel_size
    vision_backbone_type vision_pretraining vision_pretraining_type vocab_extra_ids vocab_file wandb_entity
    wandb_exp_name wandb_project wandb_save_dir warmup weight_decay weight_decay_incr_style wgrad_deferral_limit
    world_size yaml_cfg
"""
NO_MATH = frozenset(_NO_MATH.split())
# Megatron-LM's default of each other argument, where it is neither None nor False (the others' is one of those)
DEFAULTS: dict[str, Any] = {
    "glu_linear_offset": 0.0,
    "hybrid_attention_ratio": 0.0,
    "hybrid_mlp_ratio": 0.0,
    "kv_lora_rank": 32,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "mamba_head_dim": 64,
    "mamba_num_groups": 8,
    "mamba_state_dim": 128,
    "moe_token_drop_policy": "probs",
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "rotary_scaling_factor": 1.0,
    "softmax_type": "vanilla",
    "v_head_dim": 128,
}


def changed(args: Mapping[str, Any], *, mapped: Collection[str]) -> list[str]:
    """``name=value`` of each argument in ``args`` that changes the forward: not ``mapped`` (read by the caller),
    not known to leave it alone, and not at Megatron-LM's default."""
    return [
        f"{k}={v!r}" for k, v in sorted(args.items()) if k not in mapped and k not in NO_MATH and not _default(k, v)
    ]


def _default(name: str, value: Any) -> bool:
    """``value`` is Megatron-LM's default of ``name``: None or False (an option unset, a switch off), or its
    :data:`DEFAULTS` entry."""
    return value is None or value is False or (name in DEFAULTS and type(value) is not bool and value == DEFAULTS[name])


__all__ = ["DEFAULTS", "NO_MATH", "changed"]

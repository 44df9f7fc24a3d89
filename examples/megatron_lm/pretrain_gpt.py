"""GPT pretraining on Megatron-LM's own training loop (``megatron.training.pretrain``).

An entry script in the form of Megatron-LM's ``pretrain_gpt.py``: a model provider, a forward
step, a datasets provider, Megatron-LM's flags (``parse_and_validate_args``) and its data
(``--mock-data``, or ``--data-path`` to an indexed dataset). It calls nothing of mover_plugin;
run it as Megatron-LM's own script is run::

    torchrun --nproc-per-node 4 pretrain_gpt.py <Megatron-LM flags>
    mover-launch --nproc-per-node 4 pretrain_gpt.py <Megatron-LM flags>

Under ``mover-launch`` (or ``torchrun ... -m mover_plugin.launch.run pretrain_gpt.py ...``)
mover_plugin adds its flags to Megatron-LM's parser and, on a machine without CUDA, the CPU
stand-ins (``--transformer-impl local`` and the flags in ``docs/megatron-lm.md``).
"""

from __future__ import annotations

import os
import warnings
from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.training import get_args, get_tokenizer, inprocess_restart, pretrain, print_rank_0
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
"""What a training sample holds (the attention mask is the causal one, built by the model)."""


def model_provider(pre_process: bool = True, post_process: bool = True,
                   vp_stage: Optional[int] = None, config: Any = None,
                   pg_collection: Any = None) -> GPTModel:
    """This rank's part of the GPT model (the stages ``pre_process``/``post_process`` say)."""
    args = get_args()
    config = config or core_transformer_config_from_args(args)
    if args.num_experts:  # mixture of experts: each layer's own spec, as Megatron-LM builds it
        layer_spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=args.transformer_impl != "local",
            normalization=args.normalization, qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    elif args.transformer_impl == "local":
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm,
                                              normalization=args.normalization)
    else:
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def holds_data() -> bool:
    """Whether this rank reads samples: the first tensor-parallel rank of the first and last
    pipeline stages (the others receive them or need none)."""
    return parallel_state.get_tensor_model_parallel_rank() == 0 and (
        parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage())


def get_batch(data_iterator) -> dict[str, Optional[torch.Tensor]]:
    """The next micro-batch, read by the first tensor-parallel rank and sent to the others of
    its group; None on middle pipeline stages, which take activations instead."""
    if not (parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()):
        return {key: None for key in BATCH_KEYS}
    args = get_args()
    shape = (args.micro_batch_size, args.seq_length)
    dtypes = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32,
              "position_ids": torch.int64}
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        sample = next(data_iterator)
        batch = {key: sample[key].to(dtypes[key]).contiguous() for key in BATCH_KEYS}
    else:
        batch = {key: torch.empty(shape, dtype=dtypes[key]) for key in BATCH_KEYS}
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        for key in BATCH_KEYS:
            dist.broadcast(batch[key], parallel_state.get_tensor_model_parallel_src_rank(),
                           group=parallel_state.get_tensor_model_parallel_group())
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return {key: tensor.to(device) for key, tensor in batch.items()}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of the masked token losses, the token count, and the pair to report ('lm loss')."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().clone().detach().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), tokens.view(1)])}


def forward_step(data_iterator, model: GPTModel):
    """One micro-batch forward; the loss function is applied by the schedule."""
    batch = get_batch(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def dataset_config(args) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data else ([args.data_path[0]] if len(args.data_path) == 1
                                            else args.data_path, None),
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,
        data_parallel_size=args.data_parallel_size,
    )


def train_valid_test_datasets_provider(train_valid_test_num_samples, vp_stage=None):
    """The train, validation and test datasets (mock data with ``--mock-data``)."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building GPT datasets ...")
    return BlendedMegatronDatasetBuilder(dataset_type, train_valid_test_num_samples,
                                        holds_data, dataset_config(args)).build()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore", message=".*recommended to use a ModelConfig")
    train_valid_test_datasets_provider.is_distributed = True
    run_pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    arguments = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    run_pretrain(
        pretrain_cfg_container_from_args(arguments),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_provider=model_provider,
        store=store,
    )

"""The flexible interleaved 1F1B schedule as a Megatron-Core ``forward_backward_func``.

``forward_backward_pipelining_flexible`` takes exactly the keyword arguments of Megatron-Core's
forward_backward functions (and ignores unknown future ones). It runs the per-rank order of
``l3plugin.schedule.build_schedule`` with Megatron's own building blocks: ``forward_step`` and
``backward_step``, ``deallocate_output_tensor``, ``config.no_sync_func`` / ``grad_sync_func`` /
``param_sync_func`` / ``finalize_model_grads_func``, forward-only evaluation and ``collect_non_loss_data``.

Differences from the stock interleaved schedule, all deliberate:
- any m >= 1 and any k in 1..m (k from ``config.microbatch_group_size_per_vp_stage``, default p);
  k < p runs all-forward-all-backward, a last group smaller than p is fine;
- P2P goes through ``l3plugin.schedule.comm`` (device taken from the model; both peers of a pair post
  their sends and receives in one agreed order), not Megatron's P2PCommunicator, whose receive buffers
  hard-code CUDA and whose batched pp=2 path can silently swap activations and gradients;
- grad-sync hooks run right after the chunk's last backward (stock delays them by the pipeline rank),
  and a new per-round hook ``config.round_grad_sync_func(chunk_id, params, round_id, is_last_round)``
  runs after the last backward of every (chunk, round of k microbatches): ZeRO-2 reduce-scatters there.
Chunks are opaque: uneven layers per stage need nothing here.

Frozen layers: every call agrees over the PP group (one all-reduce of p x v flags) which virtual stages
hold a trainable parameter (``requires_grad``). Stages before the first such stage skip their backward,
receive their activations without requires_grad and exchange no gradients (the plan drops those messages
on both sides: ``l3plugin.schedule.plan.with_trainable_stages``); frozen parameters never get a ``.grad``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from l3plugin.checks import check_int
from l3plugin.megatron.cp_documents import schedule_step
from l3plugin.schedule.comm import PipelineChannels, pair_orders
from l3plugin.schedule.plan import FORWARD, RankPlan, Schedule, build_schedule, with_trainable_stages


@functools.lru_cache(maxsize=64)
def _cached_plan(pp, vpp, m, k, forward_only, rank, trainable):
    """Everything a step derives from the configuration alone, built once rather than every step:
    the schedule (forward-only if asked; ``trainable``: one flag per virtual stage), this rank's P2P order
    (a replay of the whole plan), and the indices of its actions after which grad sync (chunk done) and
    round sync (round done) happen."""
    schedule = with_trainable_stages(build_schedule(pp, vpp, m, k), trainable)
    if forward_only:
        schedule = forward_only_schedule(schedule)
    orders = {peer: tuple(ops) for peer, ops in pair_orders(schedule, rank).items()}
    return schedule, orders, schedule.ranks[rank].grad_sync_points(), schedule.round_end_points(rank)


def forward_only_schedule(schedule: Schedule) -> Schedule:
    """The same forward order with every backward removed (evaluation)."""
    import dataclasses

    ranks = []
    for plan in schedule.ranks:
        forwards = tuple(a for a in plan.actions if a.op == FORWARD)
        ranks.append(RankPlan(plan.rank, len(forwards), forwards))
    return dataclasses.replace(schedule, ranks=tuple(ranks))


def param_sync_points(plan: RankPlan, pp_rank: int, num_chunks: int) -> dict[int, list[int]]:
    """When ``config.param_sync_func`` starts each chunk's parameter all-gather, as stock's interleaved
    schedule does it (with --overlap-param-gather and --align-param-gather): chunks 0 and 1 before the
    first forward (key -1); chunk c + 1 (c + 1 >= 2) at this rank's i-th forward when its (i + pp_rank)-th
    forward is the first of chunk c. Rank r runs its i-th forward at about the time rank 0 runs its
    (i + r)-th, so every pipeline rank launches a chunk's gather at the same moment. Returns
    {forward index (or -1): [chunks]}; nothing without virtual stages (stock's 1F1B never calls it)."""
    if num_chunks < 2:
        return {}
    forwards = [a for a in plan.actions if a.op == FORWARD]
    points = {-1: [0, 1]}
    seen = set()
    first_of_chunk = []
    for action in forwards:
        first_of_chunk.append(action.chunk not in seen)
        seen.add(action.chunk)
    for i in range(len(forwards)):
        j = i + pp_rank
        if j < len(forwards) and first_of_chunk[j] and 2 <= forwards[j].chunk + 1 < num_chunks:
            points.setdefault(i, []).append(forwards[j].chunk + 1)
    return points


def _process_groups(p2p_communicator, pg_collection):
    """(pp, tp, cp, pg_collection) from the caller's objects, else from parallel_state (as stock does)."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is not None:
        return pg_collection.pp, pg_collection.tp, pg_collection.cp, pg_collection
    pg = ProcessGroupCollection()
    pg.pp = p2p_communicator.pp_group if p2p_communicator is not None else ps.get_pipeline_model_parallel_group()
    pg.tp = ps.get_tensor_model_parallel_group()
    pg.cp = ps.get_context_parallel_group()
    pg.embd = ps.get_embedding_group(check_initialized=False)
    pg.pos_embd = ps.get_position_embedding_group(check_initialized=False)
    pg.dp_cp = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    return pg.pp, pg.tp, pg.cp, pg


@functools.lru_cache(maxsize=4)
def _takes_model_type(backward_step) -> bool:
    """Megatron-Core 0.16's backward_step takes model_type before config; from 0.17 it does not."""
    return "model_type" in inspect.signature(backward_step).parameters


def trainable_stages(model, pp_group, device) -> tuple[bool, ...]:
    """Whether each virtual stage (pipeline order) has a parameter with requires_grad: this rank's chunks'
    flags summed over the PP group (collective; every PP rank calls it at the same point)."""
    from l3plugin import comm

    p, r = pp_group.size(), pp_group.rank()
    flags = torch.zeros(p * len(model), dtype=torch.float32, device=device)
    for c, chunk in enumerate(model):
        flags[c * p + r] = float(any(param.requires_grad for param in chunk.parameters()))
    if p > 1:
        comm.all_reduce_sum(flags, pp_group, what="trainable stages over the PP group")
    return tuple(bool(f) for f in flags.tolist())


def _model_device(model) -> torch.device:
    for chunk in model:
        for param in chunk.parameters():
            return param.device
    return torch.device("cpu")


@schedule_step  # document boundaries of the CP route for middle stages (cp_documents.py)
def forward_backward_pipelining_flexible(
    *, forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
    decoder_seq_length=None, forward_only=False, collect_non_loss_data=False, first_val_step=None,
    adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None, force_all_reduce=False,
    **_future_kwargs,
):
    """Run one training (or evaluation) step with the flexible interleaved 1F1B schedule.

    Returns the forward data store (losses on the last stage, empty elsewhere), like Megatron.
    """
    import torch.distributed as dist
    from megatron.core.pipeline_parallel.schedules import (
        backward_step, check_first_val_step, deallocate_output_tensor, forward_step)
    from megatron.core.utils import get_model_config, get_model_type

    model = model if isinstance(model, list) else [model]
    data_iterator = data_iterator if isinstance(data_iterator, list) else [data_iterator] * len(model)
    if len(data_iterator) != len(model):
        raise ValueError(f"data_iterator has {len(data_iterator)} entries but model has {len(model)} "
                         f"chunks: pass one iterator per model chunk")
    config = get_model_config(model[0])
    if adjust_tensor_shapes_fn is not None or getattr(config, "variable_seq_lengths", False):
        raise NotImplementedError("the flexible schedule sends fixed [seq, batch, hidden] tensors: "
                                  "adjust_tensor_shapes_fn and variable_seq_lengths are not supported")
    pp_group, tp_group, cp_group, pg_collection = _process_groups(p2p_communicator, pg_collection)
    p, r, v = pp_group.size(), pp_group.rank(), len(model)
    check_int("num_microbatches", num_microbatches)
    k = config.microbatch_group_size_per_vp_stage
    k = p if k is None else k
    if k == p and num_microbatches < p:
        k = num_microbatches  # Megatron's default k = p: fewer microbatches than that make one group
    device = _model_device(model)
    # Forward-only: nothing needs a gradient (no collective either).
    trainable = (False,) * (p * v) if forward_only else trainable_stages(model, pp_group, device)
    try:
        schedule, orders, grad_sync_points, round_ends = _cached_plan(
            p, v, num_microbatches, k, bool(forward_only), r, trainable)
    except ValueError as exc:
        raise ValueError(f"{exc} (group_size is config.microbatch_group_size_per_vp_stage, set by "
                         f"--microbatch-group-size-per-virtual-pipeline-stage)") from None
    plan = schedule.ranks[r]

    seq = (decoder_seq_length or seq_length) // cp_group.size()
    if config.sequence_parallel:
        seq //= tp_group.size()
    channels = PipelineChannels(
        schedule, r, orders, dist.get_process_group_ranks(pp_group), pp_group,
        shape=(seq, micro_batch_size, config.hidden_size), dtype=config.pipeline_dtype, device=device)
    model_type = (get_model_type(model[0]),) if _takes_model_type(backward_step) else ()
    free_output = functools.partial(deallocate_output_tensor,
                                    deallocate_pipeline_outputs=config.deallocate_pipeline_outputs)

    # Gradient synchronisation: off except during each chunk's last backward (Megatron's DDP contract).
    no_sync_func = config.no_sync_func
    if isinstance(no_sync_func, list):
        funcs = no_sync_func

        def no_sync_func():
            stack = contextlib.ExitStack()
            for f in funcs:
                stack.enter_context(f())
            return stack
    no_sync_func = no_sync_func or contextlib.nullcontext
    grad_sync_func = config.grad_sync_func
    if grad_sync_func is not None and not isinstance(grad_sync_func, list):
        grad_sync_func = [grad_sync_func] * v
    round_sync_func = getattr(config, "round_grad_sync_func", None)
    param_sync_func = None if forward_only else config.param_sync_func
    if param_sync_func is not None and not isinstance(param_sync_func, list):
        param_sync_func = [param_sync_func] * v
    param_syncs = param_sync_points(plan, r, v) if param_sync_func is not None else {}
    no_sync_context = None

    def disable_grad_sync():
        nonlocal no_sync_context
        if no_sync_context is None and not forward_only:
            no_sync_context = no_sync_func()
            no_sync_context.__enter__()

    def enable_grad_sync():
        nonlocal no_sync_context
        if no_sync_context is not None:
            no_sync_context.__exit__(None, None, None)
            no_sync_context = None

    if config.finalize_model_grads_func is not None and not forward_only:
        from megatron.core.pipeline_parallel.schedules import clear_embedding_activation_buffer
        embedding_module = clear_embedding_activation_buffer(config, model, r == p - 1)
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)

    disable_grad_sync()
    for c in param_syncs.get(-1, ()):
        param_sync_func[c](model[c].parameters())
    forward_data_store = []
    total_num_tokens = None
    saved = {}  # (microbatch, chunk) -> (input tensor, output tensor) kept for the backward
    first_forward_seen = set()
    forward_index = 0
    for index, action in enumerate(plan.actions):
        recv_msg, send_msg = schedule.action_messages(r, action)
        mb, c = action.microbatch, action.chunk
        if action.op == FORWARD:
            for chunk_to_sync in param_syncs.get(forward_index, ()):
                param_sync_func[chunk_to_sync](model[chunk_to_sync].parameters())
            forward_index += 1
            stage = schedule.stage_of(r, c)
            input_tensor = None if recv_msg is None else channels.recv(
                recv_msg, schedule.owner_of(recv_msg.src_stage)[0])
            output_tensor, num_tokens = forward_step(
                forward_step_func, data_iterator[c], model[c], num_microbatches, input_tensor,
                forward_data_store, config, cp_group_size=cp_group.size(),
                collect_non_loss_data=collect_non_loss_data,
                is_first_microbatch=check_first_val_step(first_val_step, forward_only,
                                                         c not in first_forward_seen),
                current_microbatch=mb, vp_stage=c if v > 1 else None,
                is_last_stage=stage == schedule.num_stages - 1)
            first_forward_seen.add(c)
            total_num_tokens = (num_tokens.clone() if total_num_tokens is None
                                else total_num_tokens + num_tokens.to(total_num_tokens.device))
            if send_msg is not None:
                channels.send(send_msg, output_tensor, schedule.owner_of(send_msg.dst_stage)[0],
                              on_complete=free_output if not forward_only else None)
            if not forward_only and schedule.has_grad_path(stage):
                saved[(mb, c)] = (input_tensor, output_tensor, send_msg)
        else:
            stage = schedule.stage_of(r, c)
            last_for_chunk = index in grad_sync_points
            if last_for_chunk and grad_sync_func is None:
                enable_grad_sync()  # DDP hooks reduce during this backward
            input_grad = None
            if schedule.has_grad_path(stage):  # else a frozen prefix: no backward, the hooks below still run
                input_tensor, output_tensor, sent = saved.pop((mb, c))
                if sent is not None:
                    channels.wait_sent(sent)  # the output must be sent (and freed) before its backward
                output_grad = None if recv_msg is None else channels.recv(
                    recv_msg, schedule.owner_of(recv_msg.src_stage)[0])
                if input_tensor is not None and not input_tensor.requires_grad:
                    input_tensor = None  # the first trainable stage: no input gradient wanted
                input_grad = backward_step(input_tensor, output_tensor, output_grad, *model_type, config)
            if round_sync_func is not None and index in round_ends:
                enable_grad_sync()
                round_sync_func(c, model[c].parameters(), schedule.round_of(mb), last_for_chunk)
            if last_for_chunk:
                if grad_sync_func is not None:
                    enable_grad_sync()
                    grad_sync_func[c](model[c].parameters())
            disable_grad_sync()
            if send_msg is not None:
                channels.send(send_msg, input_grad, schedule.owner_of(send_msg.dst_stage)[0])
    channels.finish()
    enable_grad_sync()

    if not forward_only and config.finalize_model_grads_func is not None:
        from megatron.core.pipeline_parallel.schedules import finish_embedding_wgrad_compute
        finish_embedding_wgrad_compute(config, embedding_module, r == p - 1, tp_group)
        config.finalize_model_grads_func(
            model, total_num_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return forward_data_store

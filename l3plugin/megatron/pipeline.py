"""The flexible interleaved 1F1B schedule as a Megatron-Core ``forward_backward_func``.

``forward_backward_pipelining_flexible`` takes exactly the keyword arguments of Megatron-Core's
forward_backward functions (and ignores unknown future ones). It runs the per-rank order of
``l3plugin.schedule.build_schedule`` with Megatron's own building blocks: ``forward_step`` and
``backward_step``, ``deallocate_output_tensor``, ``config.no_sync_func`` / ``grad_sync_func`` /
``param_sync_func`` / ``finalize_model_grads_func``, forward-only evaluation and ``collect_non_loss_data``.

Differences from the stock interleaved schedule, all deliberate:
- any m >= 1 and any k in 1..m (k from ``config.microbatch_group_size_per_vp_stage``, default p, or from the
  environment variable ``L3PLUGIN_MICROBATCH_GROUP_SIZE``: arguments.py ``microbatch_group_size``);
  k < p runs all-forward-all-backward, a last group smaller than p is fine; m may change from call to call;
- ``config.variable_seq_lengths`` (RL and SFT frameworks: micro-batches of different lengths, seq_length and
  micro_batch_size then unused): each activation's shape travels just before it and a gradient takes its
  activation's shape, so no receive waits for a shape exchange (stock exchanges shapes before every message);
  also with ``adjust_tensor_shapes_fn``, whose shapes the messages then carry themselves;
- P2P goes through ``l3plugin.schedule.p2p`` (device taken from the model; on gloo receives are posted
  as early as the plan allows within a budget, l3plugin.schedule.receives, so transfers overlap compute; on
  other transports (NCCL) both peers of a pair post their sends and receives in one agreed order), not Megatron's
  P2PCommunicator, whose receive buffers hard-code CUDA and whose batched pp=2 path can silently swap
  activations and gradients; ``receive_posting="early"`` / ``"agreed"`` overrides that choice ("auto"); a dict
  passed as ``waits`` is filled with this rank's blocking in the step (seconds and count of receive and send
  waits), its most receive buffers posted at once and its compute (``busy_s``, and ``actions``: (op,
  micro-batch, chunk, start, end) per step run, ``time.perf_counter`` seconds, receives excluded);
- grad-sync hooks run right after the chunk's last backward (stock delays them by the pipeline rank),
  and two new per-round hooks run around the last backward of every (chunk, round of k microbatches):
  ``config.round_grad_sync_start_func`` before it and ``config.round_grad_sync_func`` after it, both
  ``(chunk_id, params, round_id, is_last_round)``: ZeRO-2 starts its reduce-scatters from the gradient
  hooks of that backward and finishes the round after it.
Chunks are opaque: uneven layers per stage need nothing here.

Zero bubble (``pipeline_schedule="flexible-zb"``, ``forward_backward_pipelining_flexible_zb``): the plan of
``l3plugin.schedule.zero_bubble`` (the flexible plan's forwards and backwards in the same order, each backward
of a trainable stage split into B and W, the W steps placed where the rank would idle). B computes the input
gradient and keeps what the weight gradients need; W accumulates them later, a chunk's W steps in its B order
(``l3plugin.schedule.split_backward``: generic autograd, nothing on the input side computed twice), so every
gradient is bit-identical to the flexible schedule's. Megatron's local linear layers compute through
``l3plugin.megatron.split_linears`` during the step (their one-Function backward would otherwise do the weight
products in B). Messages and receive posting are the flexible plan's;
the grad-sync and round hooks run around a chunk's (round's) last W. Transformer Engine's own deferral
(``delay_wgrad_compute``, ``backward_dw()``) is refused (NotImplementedError), as are
``gradient_accumulation_fusion`` (its weight gradient is added inside B) and recompute of modules with weights.

Frozen layers: every call agrees over the PP group (one all-reduce of p x v flags) which virtual stages
hold a trainable parameter (``requires_grad``). Stages before the first such stage skip their backward,
receive their activations without requires_grad and exchange no gradients (the plan drops those messages
on both sides: ``l3plugin.schedule.plan.with_trainable_stages``); frozen parameters never get a ``.grad``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time

import torch

from l3plugin.arguments.checks import check_int
from l3plugin.megatron.arguments import microbatch_group_size
from l3plugin.megatron.cp_documents import schedule_step
from l3plugin.megatron.split_linears import check_split_config, splittable_linears
from l3plugin.schedule.p2p import PipelineChannels, header_shape, pair_orders, posts_receives_early, shape_header
from l3plugin.schedule.plan import FORWARD, WEIGHT, RankPlan, Schedule, build_schedule, with_trainable_stages
from l3plugin.schedule.receives import receive_posts
from l3plugin.schedule.split_backward import backward_input
from l3plugin.schedule.zero_bubble import build_zero_bubble_schedule

PIPELINE_SCHEDULES = ("flexible", "flexible-zb")  # l3plugin's own: the flexible plan, and it with B / W split


@functools.lru_cache(maxsize=64)
def _cached_plan(pp, vpp, m, k, forward_only, rank, trainable, early, split=False):
    """Everything a step derives from the configuration alone, built once rather than every step:
    the schedule (forward-only if asked; ``trainable``: one flag per virtual stage; ``split``: the zero-bubble
    plan, each backward split into B and W), this rank's P2P plan (``early``: when it posts each receive,
    ``receives.py``; else the pair order, a replay of the whole plan), and the indices of its actions after
    which grad sync (chunk done) and round sync (round done) happen."""
    if split and not forward_only:
        schedule = build_zero_bubble_schedule(pp, vpp, m, k, trainable=trainable)
    else:
        schedule = with_trainable_stages(build_schedule(pp, vpp, m, k), trainable)
    if forward_only:
        schedule = forward_only_schedule(schedule)
    if early:
        orders, posts = None, receive_posts(schedule, rank)
    else:
        orders, posts = {peer: tuple(ops) for peer, ops in pair_orders(schedule, rank).items()}, None
    return schedule, orders, posts, schedule.ranks[rank].grad_sync_points(), schedule.round_end_points(rank)


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
    from l3plugin.collective import comm

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



def _checked_config(model, data_iterator):
    """The model's Megatron config, after checking there is one data iterator per model chunk."""
    from megatron.core.utils import get_model_config

    if len(data_iterator) != len(model):
        raise ValueError(f"data_iterator has {len(data_iterator)} entries but model has {len(model)} "
                         f"chunks: pass one iterator per model chunk")
    return get_model_config(model[0])


def shapes_vary(config, adjust_tensor_shapes_fn) -> bool:
    """Whether messages carry their own shapes (p2p.py): Megatron's ``variable_seq_lengths`` (and
    ``mtp_standalone``, for which stock exchanges shapes too), or an ``adjust_tensor_shapes_fn`` (stock's hook for
    messages that are not [seq, batch, hidden]: each message's real shape travels with it, so the hook itself is
    not called)."""
    return bool(adjust_tensor_shapes_fn is not None or getattr(config, "variable_seq_lengths", False)
                or getattr(config, "mtp_standalone", False))


def _check_tp_inputs(tp_group, sequence_parallel, _module, args, kwargs):
    """Forward pre-hook of the first stage (variable lengths, TP > 1): its TP ranks must hold inputs of one shape,
    else Megatron's TP collectives get different sizes (gloo aborts the process, NCCL hangs); with sequence
    parallelism the tokens (``input_ids`` [b, s], this CP rank's) must split evenly over TP. One all-gather of a
    64-byte header per micro-batch; the executor's note names the micro-batch."""
    from l3plugin.collective import comm

    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor):
        return
    tp = tp_group.size()
    rows = comm.all_gather_shards(shape_header(ids), tp_group).view(tp, -1)
    shapes = [header_shape(row) for row in rows]
    if len(set(shapes)) > 1:
        raise ValueError(f"the tensor-parallel ranks of the first pipeline stage got inputs of shapes {shapes} (TP "
                         f"rank order): with variable_seq_lengths every TP rank must get the same micro-batch")
    if sequence_parallel and ids.dim() == 2 and not ids.is_floating_point() and ids.shape[1] % tp:
        raise ValueError(f"a micro-batch of {ids.shape[1]} tokens on this rank (after CP): sequence parallelism "
                         f"splits them over TP = {tp}, so the length must be a multiple of {tp} (pad the micro-batch)")


@contextlib.contextmanager
def _first_stage_inputs_checked(model, pp_rank, tp_group, config, variable):
    """``_check_tp_inputs`` on the first stage's chunk for this step, where shapes vary and TP > 1."""
    if not variable or pp_rank != 0 or tp_group.size() == 1:
        yield
        return
    handle = model[0].register_forward_pre_hook(
        functools.partial(_check_tp_inputs, tp_group, bool(config.sequence_parallel)), with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _step_plan(config, model, pp_group, num_microbatches, forward_only, device, receive_posting, split=False):
    """``_cached_plan`` for this step: k from the config (or the environment), the trainable stages agreed over
    the PP group."""
    p, r, v = pp_group.size(), pp_group.rank(), len(model)
    k, k_from = microbatch_group_size(config, p, num_microbatches)  # L3PLUGIN_MICROBATCH_GROUP_SIZE or the config's
    # Forward-only: nothing needs a gradient (no collective either).
    trainable = (False,) * (p * v) if forward_only else trainable_stages(model, pp_group, device)
    try:
        return _cached_plan(p, v, num_microbatches, k, bool(forward_only), r, trainable,
                            posts_receives_early(pp_group, device, receive_posting), split)
    except ValueError as exc:
        raise ValueError(f"{exc} (group_size is {k_from})") from None


def _per_chunk(funcs, num_chunks):
    """A config hook as one function per chunk (Megatron takes one function or a list of them)."""
    if funcs is not None and not isinstance(funcs, list):
        return [funcs] * num_chunks
    return funcs


def _all_of(context_funcs):
    """``config.no_sync_func`` as one context-manager factory (Megatron takes one or a list of them)."""
    if not isinstance(context_funcs, list):
        return context_funcs or contextlib.nullcontext

    def enter_all():
        stack = contextlib.ExitStack()
        for f in context_funcs:
            stack.enter_context(f())
        return stack
    return enter_all


class SyncHooks:
    """The config's synchronisation hooks and the points of one step where they run.

    Gradient reduction is off (``no_sync_func``) except for a chunk's completed gradients (Megatron's DDP
    contract): during the chunk's last backward when there is no ``grad_sync_func``, else right after it
    with that function; ``round_grad_sync_start_func`` runs before and ``round_grad_sync_func`` after the
    last backward of every (chunk, round). In a split plan "last backward" is the last B or W step, where the
    gradients accumulate: a trainable chunk's last W. ``param_sync_func`` starts chunks' parameter all-gathers
    at ``param_sync_points``."""

    def __init__(self, config, model, schedule, pp_rank, grad_sync_points, round_ends, forward_only):
        self.model, self.schedule, self.forward_only = model, schedule, forward_only
        self.grad_sync_points, self.round_ends = grad_sync_points, round_ends
        self.no_sync = _all_of(config.no_sync_func)
        self.grad_sync = _per_chunk(config.grad_sync_func, len(model))
        self.round_start = getattr(config, "round_grad_sync_start_func", None)
        self.round_sync = getattr(config, "round_grad_sync_func", None)
        self.param_sync = None if forward_only else _per_chunk(config.param_sync_func, len(model))
        self.param_points = ({} if self.param_sync is None
                             else param_sync_points(schedule.ranks[pp_rank], pp_rank, len(model)))
        self._no_sync_context = None

    def disable(self):
        if self._no_sync_context is None and not self.forward_only:
            self._no_sync_context = self.no_sync()
            self._no_sync_context.__enter__()

    def enable(self):
        if self._no_sync_context is not None:
            self._no_sync_context.__exit__(None, None, None)
            self._no_sync_context = None

    def start_param_gathers(self, forward_index):
        """The parameter all-gathers due at this rank's ``forward_index``-th forward (-1: before the first)."""
        for c in self.param_points.get(forward_index, ()):
            self.param_sync[c](self.model[c].parameters())

    def before_backward(self, index, action):
        """The hooks due before action ``index`` (a backward, run or skipped)."""
        if self.round_start is not None and index in self.round_ends:
            c = action.chunk
            self.round_start(c, self.model[c].parameters(), self.schedule.round_of(action.microbatch),
                             index in self.grad_sync_points)
        if index in self.grad_sync_points and self.grad_sync is None:
            self.enable()  # DDP hooks reduce during this backward

    def after_backward(self, index, action):
        """The round and chunk hooks due after action ``index`` (a backward, run or skipped), then sync off."""
        c, last_for_chunk = action.chunk, index in self.grad_sync_points
        if self.round_sync is not None and index in self.round_ends:
            self.enable()
            self.round_sync(c, self.model[c].parameters(), self.schedule.round_of(action.microbatch),
                            last_for_chunk)
        if last_for_chunk and self.grad_sync is not None:
            self.enable()
            self.grad_sync[c](self.model[c].parameters())
        self.disable()


class _Executor:
    """Runs this rank's forward and backward actions with Megatron's forward_step / backward_step, keeping
    what a step accumulates: the forward data store, the token count, the tensors saved for backwards."""

    def __init__(self, schedule, pp_rank, channels, syncs, *, forward_step_func, data_iterator, model, config,
                 num_microbatches, cp_size, forward_only, collect_non_loss_data, first_val_step):
        from megatron.core.pipeline_parallel.schedules import (backward_step, check_first_val_step,
                                                               deallocate_output_tensor, forward_step)
        from megatron.core.utils import get_model_type

        # Megatron's step functions, looked up once per step (a patched module attribute is still seen).
        self.forward_step, self.backward_step, self.check_first_val_step = (
            forward_step, backward_step, check_first_val_step)
        self.schedule, self.rank, self.channels, self.syncs = schedule, pp_rank, channels, syncs
        self.forward_step_func, self.data_iterator, self.model, self.config = (
            forward_step_func, data_iterator, model, config)
        self.num_microbatches, self.cp_size, self.forward_only = num_microbatches, cp_size, forward_only
        self.collect_non_loss_data, self.first_val_step = collect_non_loss_data, first_val_step
        self.model_type = (get_model_type(model[0]),) if _takes_model_type(backward_step) else ()
        self.free_output = functools.partial(deallocate_output_tensor,
                                             deallocate_pipeline_outputs=config.deallocate_pipeline_outputs)
        self.forward_data_store = []
        self.total_num_tokens = None
        self.saved = {}  # (microbatch, chunk) -> (input tensor, output tensor, its send) kept for the backward
        self.weight_steps = {}  # (microbatch, chunk) -> what its B kept for its W (split plans)
        self.first_forward_seen = set()
        self.forward_index = 0
        self.spans = []  # (op, microbatch, chunk, start, end): this rank's compute, receives excluded
        self._started = 0.0

    def _receive(self, msg):
        return None if msg is None else self.channels.recv(msg, self.schedule.owner_of(msg.src_stage)[0])

    def _send(self, msg, tensor, **kwargs):
        self.channels.send(msg, tensor, self.schedule.owner_of(msg.dst_stage)[0], **kwargs)

    def forward(self, action):
        recv_msg, send_msg = self.schedule.action_messages(self.rank, action)
        mb, c = action.microbatch, action.chunk
        self.syncs.start_param_gathers(self.forward_index)
        self.forward_index += 1
        stage = self.schedule.stage_of(self.rank, c)
        input_tensor = self._receive(recv_msg)
        started = time.perf_counter()
        output_tensor, num_tokens = self.forward_step(
            self.forward_step_func, self.data_iterator[c], self.model[c], self.num_microbatches, input_tensor,
            self.forward_data_store, self.config, cp_group_size=self.cp_size,
            collect_non_loss_data=self.collect_non_loss_data,
            is_first_microbatch=self.check_first_val_step(self.first_val_step, self.forward_only,
                                                     c not in self.first_forward_seen),
            current_microbatch=mb, vp_stage=c if len(self.model) > 1 else None,
            is_last_stage=stage == self.schedule.num_stages - 1)
        self.first_forward_seen.add(c)
        self.total_num_tokens = (num_tokens.clone() if self.total_num_tokens is None
                                 else self.total_num_tokens + num_tokens.to(self.total_num_tokens.device))
        self._account(action, started)
        if send_msg is not None:
            self._send(send_msg, output_tensor, on_complete=self.free_output if not self.forward_only else None)
        if not self.forward_only and self.schedule.has_grad_path(stage):
            self.saved[(mb, c)] = (input_tensor, output_tensor, send_msg)

    def backward(self, index, action):
        """The backward of ``action`` (none for a frozen prefix: its sync hooks still run), then its send."""
        recv_msg, send_msg = self.schedule.action_messages(self.rank, action)
        self.syncs.before_backward(index, action)
        input_grad = None
        stage = self.schedule.stage_of(self.rank, action.chunk)
        if self.schedule.has_weight_step(stage):
            input_grad = self._backward_input(action, recv_msg)
        elif self.schedule.has_grad_path(stage):
            input_grad = self.backward_step(*self._backward_operands(action, recv_msg), *self.model_type,
                                            self.config)
        if self.schedule.has_grad_path(stage):
            self._account(action, self._started)  # from its gradient's arrival
        self.syncs.after_backward(index, action)
        if send_msg is not None:
            self._send(send_msg, input_grad)

    def weight(self, index, action):
        """The W step of a split backward: the weight gradients its B kept (the chunk's grad-sync hooks are due
        around its last W)."""
        self.syncs.before_backward(index, action)
        step = self.weight_steps.pop((action.microbatch, action.chunk))
        if step is not None:
            started = time.perf_counter()
            with _backward_timer(self.config):
                step.run()
            self._account(action, started)
        self.syncs.after_backward(index, action)

    def _account(self, action, started):
        self.spans.append((action.op, action.microbatch, action.chunk, started, time.perf_counter()))

    def _backward_operands(self, action, recv_msg):
        """(input tensor, output tensor, output gradient) of ``action``'s backward, once its output is sent."""
        input_tensor, output_tensor, sent = self.saved.pop((action.microbatch, action.chunk))
        if sent is not None:
            self.channels.wait_sent(sent)  # the output must be sent (and freed) before its backward
        output_grad = self._receive(recv_msg)
        self._started = time.perf_counter()
        if input_tensor is not None and not input_tensor.requires_grad:
            input_tensor = None  # the first trainable stage: no input gradient wanted
        return input_tensor, output_tensor, output_grad

    def _backward_input(self, action, recv_msg):
        """B of a split backward (``l3plugin.schedule.split_backward``): the input gradient now, as Megatron's
        backward_step computes it (the last stage's loss scaled by ``config.grad_scale_func``); the weight
        gradients are kept for the W step."""
        input_tensor, output_tensor, output_grad = self._backward_operands(action, recv_msg)
        output_tensor = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
        if output_grad is None and self.config.grad_scale_func is not None:
            output_tensor = self.config.grad_scale_func(output_tensor)
        with _backward_timer(self.config):
            input_grad, self.weight_steps[(action.microbatch, action.chunk)] = backward_input(
                output_tensor, output_grad, input_tensor, self.model[action.chunk].parameters())
        return input_grad


@contextlib.contextmanager
def _backward_timer(config):
    """Megatron's 'backward-compute' timer around a B or W step (its backward_step times the fused one)."""
    if config.timers is None:
        yield
        return
    config.timers("backward-compute", log_level=2).start()
    try:
        yield
    finally:
        config.timers("backward-compute").stop()


def _start_step(config, model, is_last_rank, forward_only):
    """Megatron's step start: the embedding activation buffer (returns its module), the timer."""
    embedding_module = None
    if config.finalize_model_grads_func is not None and not forward_only:
        from megatron.core.pipeline_parallel.schedules import clear_embedding_activation_buffer
        embedding_module = clear_embedding_activation_buffer(config, model, is_last_rank)
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    return embedding_module


def _finish_step(config, model, embedding_module, is_last_rank, tp_group, total_num_tokens, pg_collection,
                 force_all_reduce, forward_only):
    """Megatron's step end: the embedding weight gradient, ``finalize_model_grads_func``, the timer."""
    if not forward_only and config.finalize_model_grads_func is not None:
        from megatron.core.pipeline_parallel.schedules import finish_embedding_wgrad_compute
        finish_embedding_wgrad_compute(config, embedding_module, is_last_rank, tp_group)
        config.finalize_model_grads_func(
            model, total_num_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    if config.timers is not None:
        config.timers("forward-backward").stop()


@schedule_step  # document boundaries of the CP route for middle stages (cp_documents.py)
def forward_backward_pipelining_flexible(
    *, forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
    decoder_seq_length=None, forward_only=False, collect_non_loss_data=False, first_val_step=None,
    adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None, force_all_reduce=False,
    receive_posting="auto", waits=None, pipeline_schedule="flexible", **_future_kwargs,
):
    """Run one training (or evaluation) step with the flexible interleaved 1F1B schedule.

    Returns the forward data store (losses on the last stage, empty elsewhere), like Megatron.
    l3plugin's own keywords: ``receive_posting`` "auto" (early receives on gloo, the agreed pair order
    elsewhere), "early" or "agreed" (``l3plugin.schedule.p2p.posts_receives_early``); ``waits``: a dict this
    rank's account of the step is written into (``PipelineChannels.waits``, ``busy_s``, ``actions``);
    ``pipeline_schedule`` "flexible" or "flexible-zb" (each backward split into B and W,
    ``l3plugin.schedule.zero_bubble``; the same gradients bit for bit).
    """
    import torch.distributed as dist

    if pipeline_schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline_schedule={pipeline_schedule!r} is invalid: choose one of {PIPELINE_SCHEDULES}")
    split = pipeline_schedule == "flexible-zb"
    model = model if isinstance(model, list) else [model]
    data_iterator = data_iterator if isinstance(data_iterator, list) else [data_iterator] * len(model)
    config = _checked_config(model, data_iterator)
    if split and not forward_only:
        check_split_config(config)
    pp_group, tp_group, cp_group, pg_collection = _process_groups(p2p_communicator, pg_collection)
    r, is_last_rank = pp_group.rank(), pp_group.rank() == pp_group.size() - 1
    check_int("num_microbatches", num_microbatches)
    device = _model_device(model)
    schedule, orders, posts, grad_sync_points, round_ends = _step_plan(
        config, model, pp_group, num_microbatches, forward_only, device, receive_posting, split)

    seq = (decoder_seq_length or seq_length) // cp_group.size()
    if config.sequence_parallel:
        seq //= tp_group.size()
    variable = shapes_vary(config, adjust_tensor_shapes_fn)
    channels = PipelineChannels(
        schedule, r, orders, dist.get_process_group_ranks(pp_group), pp_group,
        shape=(seq, micro_batch_size, config.hidden_size), dtype=config.pipeline_dtype, device=device,
        posts=posts, variable_shapes=variable)
    syncs = SyncHooks(config, model, schedule, r, grad_sync_points, round_ends, forward_only)
    executor = _Executor(
        schedule, r, channels, syncs, forward_step_func=forward_step_func, data_iterator=data_iterator,
        model=model, config=config, num_microbatches=num_microbatches, cp_size=cp_group.size(),
        forward_only=forward_only, collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step)

    embedding_module = _start_step(config, model, is_last_rank, forward_only)
    syncs.disable()
    syncs.start_param_gathers(-1)
    linears = splittable_linears(model) if split and not forward_only else contextlib.nullcontext()
    with _first_stage_inputs_checked(model, r, tp_group, config, variable), linears:
        for index, action in enumerate(schedule.ranks[r].actions):
            try:
                channels.before_action(index)
                if action.op == FORWARD:
                    executor.forward(action)
                elif action.op == WEIGHT:
                    executor.weight(index, action)
                else:
                    executor.backward(index, action)
            except Exception as exc:  # the traceback says where; this says which micro-batch of which step
                kind = {FORWARD: "forward", WEIGHT: "weight gradients"}.get(action.op, "backward")
                exc.add_note(f"l3plugin: in the {kind} of micro-batch {action.microbatch} of {num_microbatches} "
                             f"(model chunk {action.chunk}, virtual stage {schedule.stage_of(r, action.chunk)}) on "
                             f"pipeline rank {r}; the other pipeline ranks fail when their waits for this rank end "
                             f"(L3PLUGIN_WAIT_TIMEOUT)")
                raise
    channels.finish()
    syncs.enable()
    _finish_step(config, model, embedding_module, is_last_rank, tp_group, executor.total_num_tokens,
                 pg_collection, force_all_reduce, forward_only)
    if waits is not None:
        waits.update(channels.waits, busy_s=sum(end - start for *_, start, end in executor.spans),
                     actions=executor.spans)
    return executor.forward_data_store


def forward_backward_pipelining_flexible_zb(**kwargs):
    """``forward_backward_pipelining_flexible`` with ``pipeline_schedule="flexible-zb"`` (what
    ``--pipeline-schedule flexible-zb`` selects): each backward split into B, the input gradient, and W, the
    weight gradients, run where the rank would idle (``l3plugin.schedule.zero_bubble``)."""
    return forward_backward_pipelining_flexible(**kwargs, pipeline_schedule="flexible-zb")

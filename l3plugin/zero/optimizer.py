"""The FP32-reducing ZeRO-1/2 optimizer (Llama 3 paper, sections 3.1.3 and 6.2), framework-neutral.

Model compute and the parameter all-gather stay in the parameters' dtype (bf16); gradients are
accumulated over micro-batches in fp32, reduce-scattered over the gradient-reduction group in fp32, and
the fp32 master shard is updated by an ordinary torch optimizer. Bucket layout and sharding map: see
``buffers.py``.

    zero = FP32ReduceZero(torch.optim.AdamW(model.parameters(), lr=1e-4), group=dp_cp_group, stage=2)
    for round in rounds:                         # a round = k consecutive micro-batches of one chunk
        for mb in round: loss(mb).backward()     # hooks add each bf16 .grad into fp32 buckets, free .grad
        zero.end_of_round(chunk_params, is_last_round)
    zero.step()                                  # reduce leftovers, clip on the fp32 norm, step, all-gather

The calls a framework adapter makes:
- gradients: nothing (post-accumulate-grad hooks are installed on construction);
- ``arm(params)`` before a backward pass that completes those params' gradients for a reduction (the
  DeepSpeed adapter does it for every micro-batch that ends with a reduce-scatter): with ``overlap`` each
  bucket's reduce-scatter starts from the hook that completes the bucket, while backward goes on;
- ``before_round_end(params, is_last_round)`` before the last backward of each (chunk, round) (optional):
  arms those params' buckets, so their reduce-scatters start from that backward's gradient hooks;
- ``end_of_round(params, is_last_round)`` after the last backward of each (chunk, round): ZeRO-2 starts
  those params' reduce-scatters not started yet and frees the full buffers when they complete, keeping only
  the fp32 shard; ZeRO-1 does so only when ``is_last_round`` (full fp32 gradients live across rounds and
  chunks);
- ``reduce_scatter(params)`` to force it regardless of stage; ``finish_grad_sync()`` starts every reduction
  not started yet and waits for all (cheap when the rounds did it) - call it before reading gradients;
- ``add_grad_sum(params, group)`` once after construction, for parameters whose copies on other ranks
  see other data (weights tied across pipeline stages: construct with ``own_bucket=`` them; weights
  replicated over sequence-parallel TP ranks): ``finish_grad_sync`` then sums their reduced fp32 shards
  over that group (``grad_sums.py``); ``scale_grads(factor)`` after it (1 / tokens for a per-token loss);
- ``all_reduce_param_grad(param, group)``: the same sum for one parameter in any bucket, through its full
  gradient (the DeepSpeed adapter's tied weights);
- ``step()`` = finish_grad_sync + clip + optimizer step + ``all_gather_params()`` + ``zero_grad()``.

Overlap (``ZeroSettings.overlap``, default on): collectives are started asynchronously and waited where
their result or their buffer is needed: a bucket's reduce-scatter before the bucket is accumulated into
again, at the next round end (Megatron path: started during a round's last backward, one round in flight
after a round end), at the end of the backward pass that started it (DeepSpeed adapter: all but those started
last that fit in ``carry_bytes``, ``wait_uncarried``; those run on under the next forward), and in
``finish_grad_sync``;
the bf16 parameter all-gathers where the next forward first uses each bucket (``overlap_param_gather``, on by
default; ``param_gather.py``: forward pre-hooks and a guard against earlier reads). Every wait is bounded by
``wait_timeout`` and fails with an error naming the rank, the group and the bucket. Overlap on and off do
the same arithmetic in the same order: bit-identical results (tested).

Megatron-Core wiring: ``l3plugin/megatron/zero.py``. ``megatron_zero`` builds this optimizer over the model
chunks (gradient group DP x CP, norm group TP x PP, TP duplicates and the last stage's tied embedding copy
counted once in the norm) and registers the sums Megatron's ``finalize_model_grads`` makes (tied embedding /
output layer over the embedding group, sequence-parallel and qk-layernorm gradients over TP);
``attach_to_schedule(config, zero)`` sets the config's ``round_grad_sync_start_func`` and
``round_grad_sync_func`` (the flexible schedule calls ``before_round_end`` before and ``end_of_round`` after
the last backward of every round) and its ``finalize_model_grads_func`` (``finalize_grads_func``:
``finish_grad_sync``, then with a per-token loss the 1 / tokens scaling). ``megatron_zero`` refuses what it does
not carry over (MoE, MTP, ...), naming the config attribute.
Do not also wrap the chunks in Megatron's DistributedDataParallel: its hooks would take the gradients.
The paper runs ZeRO-1 with 1F1B when k >= 2p and ZeRO-2 with all-forward-all-backward when k < 2p.

Every rank of the group must make the same calls in the same order (they are collectives) and touch the
same buckets (true for dense models). Parameters must be identical across the group on construction (as
after DDP's or DeepSpeed's initial broadcast). The torch optimizer must update element-wise (AdamW, Adam,
SGD, ...): it sees flat fp32 shards, not shaped tensors.
"""

from __future__ import annotations

import logging
import math
import weakref
import zlib

import torch
import torch.distributed as dist

from l3plugin.collective import comm
from l3plugin.collective.fail_together import agree
from l3plugin.collective.waits import resolve_timeout
from l3plugin.zero.buffers import GradBucket, GradBufferMemory, plan_buckets
from l3plugin.zero.full_tensors import FullTensors
from l3plugin.zero.grad_sums import apply_grad_sum, make_grad_sum
from l3plugin.zero.param_gather import GUARD, ParamGather
from l3plugin.zero.settings import BUCKETS_PER_MODEL, CARRY_BY_BUDGET, CARRY_SHARE, ZeroSettings

LOG = logging.getLogger(__name__)

class FP32ReduceZero(FullTensors, ParamGather):
    """Wraps a torch optimizer built over the model's (bf16) parameters; takes ownership of its param groups.

    group: the gradient-reduction process group (DP, or DP x CP); None = the default group.
    chunks: optional list of parameter iterables (model chunks / virtual stages); buckets never span two.
    norm_group: extra group the squared gradient norm is summed over (model-parallel ranks: TP x PP).
    counts_in_norm(param) -> bool: False for copies that another model-parallel rank already counts
        (TP-duplicated or pipeline-tied weights); default: every parameter counts.
    param_names: {param: name} for the sharding map, checkpoints and export.
    own_bucket: parameters that each get a bucket of their own (copies tied across pipeline stages whose
        gradients are summed with ``add_grad_sum``: their shard ranges then match on every stage).
    Frozen parameters (requires_grad False) get no bucket, hook or reduction; with none trainable (a frozen
    pipeline stage) there are no buckets and ``step`` only joins the gradient norm's all-reduces.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, group=None, *, settings: ZeroSettings | None = None,
                 chunks=None, norm_group=None, counts_in_norm=None, param_names=None, own_bucket=(),
                 **setting_kwargs):
        if settings is None:
            settings = ZeroSettings(**setting_kwargs)
        elif setting_kwargs:
            raise TypeError("pass either settings= or keyword settings, not both")
        self.settings = settings
        self.wait_timeout = resolve_timeout(settings.wait_timeout)
        self.optimizer = optimizer
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.norm_group = norm_group
        self.memory = GradBufferMemory()
        self.overflow = False
        self.last_grad_norm: torch.Tensor | None = None

        # Fail together: a rank whose setup fails (or whose model differs) stops every rank here, instead of
        # leaving them in the first gradient collective.
        self.device = device = next((p.device for pg in optimizer.param_groups for p in pg["params"]), "cpu")
        what = "ZeRO optimizer setup"
        try:
            self._build_buckets(optimizer, chunks, counts_in_norm, param_names, set(own_bucket))
        except Exception as exc:  # noqa: BLE001 - every rank raises in agree()
            agree(exc, self.group, what=what, device=device, timeout=self.wait_timeout)
            raise
        numels = [b.spec.numel for b in self.buckets]
        agree(None, self.group, what=what, device=device, timeout=self.wait_timeout,
              outcome=f"{len(numels)} buckets, {sum(numels)} elements, layout CRC32 "
                      f"{zlib.crc32(str([(b.spec.group, b.spec.numel) for b in self.buckets]).encode()):#010x}")

    def _build_buckets(self, optimizer, chunks, counts_in_norm, param_names, own_bucket) -> None:
        settings = self.settings
        chunk_of = {}
        for c, params in enumerate(chunks or []):
            for p in params:
                chunk_of[p] = c
        ordered, specs = [], []
        for g, pg in enumerate(optimizer.param_groups):
            mine = [p for p in pg["params"] if p.requires_grad and p.numel() > 0]
            mine.sort(key=lambda p: chunk_of.get(p, 0))  # stable: keeps the user's order inside a chunk
            for p in mine:
                ordered.append(p)
                specs.append((g, chunk_of.get(p, 0), p.dtype, tuple(p.shape)))
        self.params = ordered
        self.param_names = {p: (param_names or {}).get(p, f"param{i}") for i, p in enumerate(ordered)}
        alone = {i for i, p in enumerate(ordered) if p in own_bucket}
        self.bucket_numel = settings.bucket_numel or min(  # see settings.BUCKETS_PER_MODEL
            settings.bucket_limit, max(1, -(-sum(p.numel() for p in ordered) // BUCKETS_PER_MODEL)))
        slots, bucket_specs = plan_buckets(specs, self.world_size, self.bucket_numel, alone)
        self.slots: dict = dict(zip(ordered, slots))
        self.buckets: list[GradBucket] = []
        for spec in bucket_specs:
            params = [ordered[s.index] for s in spec.slots]
            self.buckets.append(GradBucket(spec, params, self._initial_master(spec, params),
                                           settings.accumulate_dtype, self.memory))
        self.counted_in_norm = [self._norm_mask(b, counts_in_norm) for b in self.buckets]
        # The torch optimizer now updates the fp32 shards: one tensor per bucket, in the bucket's group.
        for g, pg in enumerate(optimizer.param_groups):
            pg["params"] = [b.master for b in self.buckets if b.spec.group == g]
        self._launch_order: list[int] = []  # armed buckets not started yet, in the order they must start
        self._launches = 0  # reduce-scatters started so far (GradBucket.started)
        self._gathers: dict = {}  # bucket index -> its started parameter all-gather (comm.InFlight)
        # The hooks reach this optimizer through a weak reference: a tensor's hooks are where Python's garbage
        # collector does not look, so a strong one would keep a dropped optimizer (its buffers, pending gathers,
        # the model) alive for good. When it is collected, its hooks are removed.
        accumulate = weakref.WeakMethod(self._accumulate)
        self._hooks = [p.register_post_accumulate_grad_hook(lambda param: _call_if_alive(accumulate, param))
                       for p in ordered]
        weakref.finalize(self, _remove_handles, self._hooks)
        self.grad_sums: list = []  # grad_sums.GradSum, applied in finish_grad_sync
        self._sums_applied = False
        shard_bytes = sum(b.spec.shard_numel for b in self.buckets) * settings.accumulate_dtype.itemsize
        self.carry_budget = shard_bytes // CARRY_SHARE if settings.carry_bytes is None else settings.carry_bytes
        if self.rank == 0 and settings.stage == 2 and settings.carried_buckets not in (0, CARRY_BY_BUDGET):
            LOG.warning(self._carry_cost(shard_bytes))

    def _carry_cost(self, shard_bytes) -> str:
        """The memory an opt-in carry (carry_buckets, carry_reductions) may hold between micro-batches."""
        n = self.settings.carried_buckets
        held = sorted((self._flight_bytes(b) for b in self.buckets), reverse=True)[:n]
        what = (f"carry_buckets={n} may hold the full fp32 buffers and received slices of the {len(held)} largest "
                "buckets" if n is not None else "carry_reductions may hold the full fp32 buffers and received slices "
                "of every bucket")
        mib = 2 ** 20
        return (f"l3plugin ZeRO-2: {what} between micro-batches: up to {sum(held) / mib:.1f} MiB per rank, "
                f"{sum(held) / max(shard_bytes, 1):.2f} x the fp32 gradient shard ({shard_bytes / mib:.1f} MiB, what "
                f"stock ZeRO-2 holds); the default (carry_bytes) holds at most {self.carry_budget / mib:.2f} MiB")

    # -- construction helpers -----------------------------------------------------------------------
    def _initial_master(self, spec, params) -> torch.nn.Parameter:
        shard = torch.zeros(spec.shard_numel, dtype=torch.float32, device=params[0].device)
        for slot, p in zip(spec.slots, params):
            part = spec.shard_part(slot, self.rank)
            if part:
                a, b, at = part
                shard[at:at + b - a] = p.detach().reshape(-1)[a:b]
        return torch.nn.Parameter(shard)

    def _norm_mask(self, bucket, counts_in_norm):
        """Shard-local [start, end) ranges that count in the norm (None: the whole shard counts)."""
        if counts_in_norm is None or all(counts_in_norm(p) for p in bucket.params):
            return None
        keep = []
        for p, a, b, at in self.owned_ranges(bucket):
            if counts_in_norm(p):
                keep.append((at, at + b - a))
        return keep

    # -- gradients ------------------------------------------------------------------------------------
    # A bucket's reduce-scatter is *started* (``_launch``) and later *completed* (``_complete``: wait, scale,
    # add into the fp32 shard, free the full buffer). With ``overlap`` the start comes as early as the
    # gradient is final and the wait as late as the result or the buffer is needed; without it each start
    # is followed by its wait. Both do the same arithmetic in the same order, so results are bit-identical.
    @torch.no_grad()
    def _accumulate(self, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        slot = self.slots[param]
        bucket = self.buckets[slot.bucket]
        if bucket.in_flight is not None:  # the buffer is about to be reused: its reduction must have read it
            self._complete(bucket)
        bucket.accumulate(slot, param.grad)
        param.grad = None  # the bf16 gradient is consumed: autograd allocates a fresh one next micro-batch
        if bucket.armed:
            bucket.seen += 1
            if self.settings.overlap:
                self._launch_ready()

    def buckets_of(self, params=None) -> list[GradBucket]:
        if params is None:
            return list(self.buckets)
        wanted = sorted({self.slots[p].bucket for p in params if p in self.slots})
        return [self.buckets[i] for i in wanted]

    def arm(self, params=None) -> None:
        """Announce that the coming backward pass completes the gradients of ``params`` (all if None) for a
        reduce-scatter: with ``overlap``, each of their buckets starts its reduce-scatter from the gradient
        hook that completes it, while backward goes on. Buckets start in descending index order (the order
        backward completes them), so every rank issues the collectives in the same order."""
        for bucket in self.buckets_of(params):
            bucket.armed, bucket.seen = True, 0
        self._launch_order = sorted((b.spec.index for b in self.buckets if b.armed), reverse=True)

    def _launch_ready(self) -> None:
        order = self._launch_order
        while order and self.buckets[order[0]].seen >= len(self.buckets[order[0]].params):
            self._launch(self.buckets[order.pop(0)])

    def _needs_reduce(self, bucket: GradBucket) -> bool:
        # Unreduced gradients, or never reduced this step (zeros: the collective must still run everywhere).
        return bucket.in_flight is None and (bucket.full is not None or bucket.shard_grad is None)

    @torch.no_grad()
    def _launch(self, bucket: GradBucket) -> None:
        if self._sums_applied:
            raise RuntimeError("gradients were accumulated after finish_grad_sync summed them over the "
                               "add_grad_sum groups: call step() or zero_grad() before the next backward")
        bucket.armed = False
        bucket.started, self._launches = self._launches, self._launches + 1
        bucket.in_flight = comm.start_reduce_scatter_sum(bucket.full_buffer(), self.group, self.settings.reduce_dtype,
                                                         what=f"gradient bucket {bucket.spec.index}",
                                                         tag=bucket.spec.index)
        if not self.settings.overlap:
            self._complete(bucket)

    @torch.no_grad()
    def _complete(self, bucket: GradBucket) -> None:
        flight, bucket.in_flight = bucket.in_flight, None
        shard = self.memory.alloc(flight.wait(self.wait_timeout).to(self.settings.accumulate_dtype))
        bucket.free_full()  # the shard existed next to the full buffer: counted in the peak above
        scale = self.settings.gradient_scale
        shard.mul_(1.0 / self.world_size if scale is None else scale)
        bucket.add_reduced(shard)

    def launch_reductions(self, params=None) -> None:
        """Start the reduce-scatter of every bucket of ``params`` (all if None) that needs one."""
        wanted = {b.spec.index for b in self.buckets_of(params)}
        for index in [i for i in self._launch_order if i in wanted] + sorted(wanted, reverse=True):
            bucket = self.buckets[index]
            if self._needs_reduce(bucket):
                self._launch(bucket)
            bucket.armed = False  # armed but with nothing to reduce: must not start later by itself
        self._launch_order = [i for i in self._launch_order if i not in wanted]

    def wait_reductions(self, params=None) -> None:
        """Complete the started reduce-scatters of the buckets of ``params`` (all if None)."""
        for bucket in self.buckets_of(params):
            if bucket.in_flight is not None:
                self._complete(bucket)

    def wait_reductions_but_latest(self, keep: int) -> None:
        """Complete every started reduce-scatter except the ``keep`` started last (the buckets a backward
        completes last): they run on, holding their full buffers, until their bucket is next accumulated into
        or ``wait_reductions`` / ``finish_grad_sync`` / ``zero_grad``."""
        flying = sorted((b for b in self.buckets if b.in_flight is not None), key=lambda b: b.started)
        for bucket in flying[:max(0, len(flying) - keep)]:
            self._complete(bucket)

    def _flight_bytes(self, bucket: GradBucket) -> int:
        """Bytes a started reduce-scatter of ``bucket`` holds until waited: its full buffer, the copy it sends
        when the reduce dtype differs, and what it receives (gloo's exchange: the W - 1 slices from the peers;
        NCCL: this rank's output slice)."""
        n, w, reduce = bucket.spec.padded_numel, self.world_size, self.settings.reduce_dtype
        held = n * self.settings.accumulate_dtype.itemsize
        if reduce != self.settings.accumulate_dtype:
            held += n * reduce.itemsize
        if w > 1:
            gloo = dist.get_backend(self.group) == "gloo"
            held += (n * (w - 1) // w if gloo else n // w) * reduce.itemsize
        return held

    def wait_uncarried(self, carry) -> None:
        """At the end of a ZeRO-2 backward that is not the step's last (a round end): complete the started
        reduce-scatters that may not run on into the next micro-batch. ``carry`` is ``settings.carried_buckets``:
        ``CARRY_BY_BUDGET`` keeps the ones started last while what they hold fits in ``carry_budget`` bytes;
        a number N keeps the N started last; None keeps every one still running."""
        if carry is None:
            self.complete_finished_reductions()
            return
        if carry == CARRY_BY_BUDGET:
            flying = sorted((b for b in self.buckets if b.in_flight is not None), key=lambda b: -b.started)
            carry, held = 0, 0
            for bucket in flying:
                held += self._flight_bytes(bucket)
                if held > self.carry_budget:
                    break
                carry += 1
        self.wait_reductions_but_latest(carry)

    def complete_finished_reductions(self) -> None:
        """Complete (without waiting) the reduce-scatters that have already finished, freeing their full
        buffers early: called between micro-batches when reductions are carried into the next forward."""
        for bucket in self.buckets:
            if bucket.in_flight is not None and bucket.in_flight.done():
                self._complete(bucket)

    def reduce_scatter(self, params=None) -> None:
        """Reduce-scatter the buckets holding ``params`` (all buckets if None) now, whatever the stage."""
        self.launch_reductions(params)
        self.wait_reductions(params)

    def before_round_end(self, params, is_last_round: bool) -> None:
        """Before the last backward of a round of micro-batches of the chunk owning ``params``: ``arm`` the
        buckets ``end_of_round`` will reduce (ZeRO-2 every round, ZeRO-1 the last), so with ``overlap`` each
        bucket's reduce-scatter starts from the gradient hook that completes it, while that backward goes
        on (in descending bucket order, the same on every rank)."""
        if self.settings.stage == 2 or is_last_round:
            self.arm(params)

    def end_of_round(self, params, is_last_round: bool, carry: int | None = None) -> None:
        """After the last backward of a round of the chunk owning ``params`` (ZeRO-2 every round, ZeRO-1 the
        last): complete earlier rounds' reductions (other chunks' buckets), start those of ``params`` not
        started yet, which run under the next round. ``carry`` (they started in the backward: ``before_round_end``):
        ``settings.carried_buckets``, what ``wait_uncarried`` lets run on (the rest are waited where their bucket
        is next needed); None: every one runs on."""
        GUARD.leave_if_done()  # a guard whose last gather completed in its own dispatch could not leave then
        if self.settings.stage == 2 or is_last_round:
            params = list(params)  # may be a generator (a module's parameters()): read twice
            mine = {bucket.spec.index for bucket in self.buckets_of(params)}
            for bucket in self.buckets:
                if bucket.in_flight is not None and bucket.spec.index not in mine:
                    self._complete(bucket)
            self.launch_reductions(params)
            if carry is not None:
                self.wait_uncarried(carry)

    def finish_grad_sync(self) -> None:
        """Reduce-scatter every bucket that still holds unreduced gradients or was never reduced this step,
        wait for every reduction in flight, then (once per step) make the ``add_grad_sum`` sums."""
        if self._sums_applied:
            return
        self.launch_reductions()
        self.wait_reductions()
        for grad_sum in self.grad_sums:
            apply_grad_sum(self, grad_sum)
        self._sums_applied = bool(self.grad_sums)

    def add_grad_sum(self, params, group, *, average: bool = False, what: str = "gradient sum") -> None:
        """From now on ``finish_grad_sync`` sums (``average``: averages) the reduced gradients of ``params``
        over ``group``, whose ranks hold copies of them (see ``grad_sums.py``). Collective over ``group``:
        checks that every peer owns the same elements of them (tied copies need ``own_bucket``)."""
        self.grad_sums.append(make_grad_sum(self, params, group, average=average, what=what))

    @torch.no_grad()
    def all_reduce_param_grad(self, param, group) -> None:
        """Sum ``param``'s fp32 gradient over ``group`` (collective over ``group``, and over the reduction
        group too once gradients are reduce-scattered).

        For weights tied across pipeline stages (embedding / output layer: each stage holds a copy whose
        gradients must be added) and for parameters replicated over tensor-parallel ranks that see different
        tokens (sequence-parallel layer norms). Before the reduce-scatter the full fp32 buffer is summed
        in place; after it (ZeRO-2 rounds, or in a finalize hook) the reduced gradient is assembled, summed
        and written back to this rank's shard. The sum commutes with the data-parallel average.
        """
        slot = self.slots[param]
        bucket = self.buckets[slot.bucket]
        if bucket.in_flight is not None:
            self._complete(bucket)
        if bucket.shard_grad is None:
            comm.all_reduce_sum(bucket.param_view(slot), group, self.wait_timeout)
            return
        if bucket.full is not None:
            raise RuntimeError("gradient of a tied/replicated parameter is partly reduce-scattered: call "
                               "all_reduce_param_grad before the first or after the last reduce-scatter")
        full = self.full_grad(param)
        comm.all_reduce_sum(full, group, self.wait_timeout)
        self.set_full_grad(param, full)

    @property
    def grads_reduced(self) -> bool:
        return all(b.full is None and b.in_flight is None and b.shard_grad is not None for b in self.buckets)

    # -- step -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        """Multiply the reduced gradients (e.g. 1 / tokens for a per-token loss); after finish_grad_sync."""
        for bucket in self.buckets:
            if bucket.shard_grad is not None:
                bucket.shard_grad.mul_(factor)

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the reduced fp32 gradient (collective over group and norm_group)."""
        total = torch.zeros(1, dtype=torch.float32, device=self.device)
        for bucket, keep in zip(self.buckets, self.counted_in_norm):
            g = bucket.shard_grad
            if g is None:
                continue
            g = g.float()
            for s, e in [(0, g.numel())] if keep is None else keep:
                total += g[s:e].pow(2).sum()
        comm.all_reduce_sum(total, self.group, self.wait_timeout, "gradient norm")
        if self.norm_group is not None:
            comm.all_reduce_sum(total, self.norm_group, self.wait_timeout, "gradient norm")
        return total.sqrt()

    @torch.no_grad()
    def clip_grad_norm(self) -> torch.Tensor:
        norm = self.grad_norm()
        max_norm = self.settings.clip_grad
        if max_norm > 0:
            coef = max_norm / (norm.item() + 1e-6)
            if coef < 1.0:
                for bucket in self.buckets:
                    if bucket.shard_grad is not None:
                        bucket.shard_grad.mul_(coef)
        return norm

    @torch.no_grad()
    def step(self, closure=None) -> torch.Tensor:
        """Reduce what is left, clip, update the fp32 shards, all-gather the parameters. Returns the norm.

        A non-finite gradient norm skips the update (``self.overflow`` is then True) instead of writing
        NaNs into the master weights.
        """
        if closure is not None:
            raise ValueError("FP32ReduceZero.step does not take a closure")
        self.finish_grad_sync()
        norm = self.clip_grad_norm()
        self.last_grad_norm = norm
        self.overflow = not math.isfinite(norm.item())
        if not self.overflow:
            for bucket in self.buckets:
                g = bucket.shard_grad
                bucket.master.grad = None if g is None else g.to(torch.float32)
            self.optimizer.step()
            self.all_gather_params()
        self.zero_grad()
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wait_reductions()  # a started collective is never abandoned: other ranks take part in it
        for bucket in self.buckets:
            bucket.clear_grads()
            bucket.armed = False
        self._launch_order = []
        self._sums_applied = False
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def refresh_master_from_params(self) -> None:
        """Reset the fp32 shards from the (bf16) parameters, e.g. after loading model weights only."""
        self.wait_param_gather()
        for bucket in self.buckets:
            bucket.master.copy_(self._initial_master(bucket.spec, bucket.params))

    # -- documentation / inspection ----------------------------------------------------------------------
    def sharding_map(self) -> list[dict]:
        """One row per parameter: its bucket, bucket offset and which group ranks own which of its elements."""
        rows = []
        for p in self.params:
            slot = self.slots[p]
            spec = self.buckets[slot.bucket].spec
            rows.append({"name": self.param_names[p], "group": slot.group, "chunk": slot.chunk,
                         "bucket": slot.bucket, "offset": slot.offset, "numel": slot.numel,
                         "bucket_padded_numel": spec.padded_numel,
                         "owners": [(r, s - slot.offset, e - slot.offset) for r, s, e in spec.owners(slot)]})
        return rows

    def remove_hooks(self) -> None:
        _remove_handles(self._hooks)
        self._hooks = []


def _call_if_alive(method_ref, *args) -> None:
    method = method_ref()
    if method is not None:
        method(*args)


def _remove_handles(handles) -> None:
    for handle in handles:
        handle.remove()

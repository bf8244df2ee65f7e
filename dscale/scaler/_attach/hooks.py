"""Unscale inside the gradient reduction: ``GradScaler.attach(ddp_model or fsdp2_model)``.

DDP's default hook divides each bucket by the world size and all-reduces it. This hook all-reduces
the scaled bucket and then, in one fused pass over the reduced values, multiplies by
1 / (world_size * scale) and records whether any value is inf/NaN. The reduced bucket is the same on
every rank of DDP's group, so the scaler needs no unscale pass for these parameters. step() still
checks them again for inf/NaN (times 1) and runs its one-element agreement: a write between the
reduction and step() through an alias whose version does not move (``p.grad.data``, ``.numpy()``)
is invisible here and may be on one rank only (``_check``).

fp16/bf16 buckets are divided by the world size before the all-reduce (as DDP does) so the sum
cannot overflow where the average would not; the pass after it then multiplies by 1 / scale.
For a power-of-two world size and scale (dscale's defaults), the result is bitwise the plain path's.

FSDP2 has no replaceable reduce-scatter hook that sees the whole reduction, but it runs
``set_all_reduce_hook`` callbacks on every reduce-scatter output while it is hot; there this module
unscales and checks the rank's shard in one pass. A shard's flag is local, so the scaler still
all-reduces it (one element), but step() no longer makes its own pass over those grads.

What a hook did not see is never taken on trust (``report()``): parameters DDP or FSDP2 ignore are
checked by the scaler's own pass, a grad that a later backward outside the hooks accumulated into
goes back to the scaler's pass, and a grad written after the reduction is refused.

``policy="predictive"`` passes a ``GradMeasure``: the hooks also take the largest magnitude of each
reduced, unscaled bucket or shard, so the scaler's own pass measures only what they did not see.
The measurement is kept and dropped with the flag: a backward that is abandoned (no step) leaves
neither for the next one.
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations as objects.
import dataclasses
import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from dscale import _dist
from dscale.scaler._attach.param_sets import ParamSet, param_set
from dscale.scaler._program.grad_measure import GradMeasure, measure_reduced
from dscale.scaler._program.unscale import DTensor, copy_to, local_tensor


@dataclasses.dataclass(frozen=True)
class HookReport:
    """What the hooks did for one optimizer in this iteration.

    ``flag``: their overflow flag (None: no hook ran); ``covered``: ids of the parameters whose
    grads they checked and unscaled, as they are now; ``unscaled``: the covered grads are unscaled;
    ``measured``: policy="predictive"'s ``[scaled max, underflowing elements, elements]``;
    ``backwards``: the backward passes so far through the models holding the optimizer's
    parameters, and those that added to their unscaled grads outside the reduction
    (:meth:`ReductionHooks.backwards`); ``complete``: ``covered`` holds every grad the
    optimizer has, so the scaler's own pass has nothing to take.
    """

    flag: torch.Tensor | None
    covered: frozenset[int]
    unscaled: bool
    measured: torch.Tensor | None = None
    backwards: tuple[int, ...] = ()
    complete: bool = False


class AttachRefusal(RuntimeError):
    """Grads the hooks cannot vouch for (the refusing rank joins the peers' agreement)."""


class HookState:
    """One attached model: its hook's flag for the current grads, and what those grads are."""

    def __init__(
        self,
        scale_of: Callable[[], torch.Tensor],
        scale_calls: Callable[[], int],
        params: list[torch.nn.Parameter],
        group: Any,
        *,
        ddp: bool,
        measure: GradMeasure | None = None,
    ) -> None:
        self.scale_of = scale_of
        self.scale_calls = scale_calls
        self.measurer = measure  # policy="predictive": also measure the reduced, unscaled grads
        self.params = params  # the parameters this model's hooks reduce
        self.ids = frozenset(id(p) for p in params)
        # Weakly: the hooks outlive the model (on its parameters, in the scaler) and must not
        # keep its process group alive after `del model; dist.destroy_process_group()`.
        self._group = None if group is None else weakref.ref(group)
        self.group_ranks = None if group is None else frozenset(dist.get_process_group_ranks(group))
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.ddp = ddp
        self.found: dict[torch.device, torch.Tensor] = {}
        # policy="predictive": [scaled max, underflowing elements, elements] per device, kept and
        # dropped with `found`.
        self.measured: dict[torch.device, torch.Tensor] = {}
        self.in_backward = False
        self.scale_calls_seen = 0
        # Backward passes through the hooks so far: a flag read for a step belongs to one of them,
        # and a later backward (the GAN pattern: backward, step, backward, step) makes a new one.
        self.generation = 0
        # DDP: backward passes outside the reduction (no_sync(), the bare module) that added to
        # grads the hook had unscaled; they change the grads as a new generation would.
        self.accumulations = 0
        # After each backward with hooks: the grads as the hook left them and their versions, in
        # `params` order (None: a param without grad; see end_backward), and id(param) -> (the
        # grad, its version), built from them only when a step needs it (`records()`).
        self._seen: list[weakref.ref[torch.Tensor]] | None = None
        # The same grads, held from the backward to update() (or the model's next forward or
        # backward, whichever comes first; `release()`): step() compares them with the params'
        # grads by identity, at C speed, with no id() per grad (see untouched()).
        self._held: list[torch.Tensor] | None = None
        self._versions: list[Any] = []
        # What step() reads versions of, with them: the grads, or DDP's buckets where every grad
        # is a view of one (see `_watched_of`); held and dropped with `_held`.
        self._watched: list[torch.Tensor] = []
        self._watched_versions: list[Any] = []
        self._records: dict[int, tuple[weakref.ref[torch.Tensor], Any]] | None = {}
        # DDP: ids of params whose grads hold this hook's unscaled output; rescaled before a
        # backward adds to them.
        self.unscaled: set[int] = set()
        self.rescaled: set[int] = set()

    @property
    def group(self) -> Any:
        """DDP's process group (None for FSDP2); RuntimeError once it is gone."""
        if self._group is None:
            return None
        group = self._group()
        if group is None:
            raise RuntimeError(
                "attach(): the attached DDP model's process group was destroyed; attach() the "
                "model built over the new group instead"
            )
        return group

    def covers(self, scaler_group: Any) -> bool:
        """Whether this DDP model's group holds every rank of the scaler's group."""
        if self.group_ranks is None:
            return _dist.group_covers(None, scaler_group)
        inner = _dist.group_ranks(scaler_group)
        return set(range(dist.get_world_size()) if inner is None else inner) <= self.group_ranks

    def flag(self, device: torch.device) -> torch.Tensor:
        if device not in self.found:
            self.found[device] = torch.zeros((), dtype=torch.float32, device=device)
        return self.found[device]

    def begin_backward(self) -> None:
        """First hook call of a backward pass: refuse an unscaled loss, drop a stale flag."""
        if self.in_backward:
            return
        calls = self.scale_calls()
        if calls == self.scale_calls_seen:
            raise RuntimeError(
                "attach(): a backward pass through the attached model ran without "
                "scaler.scale(loss) since the previous one; its hook would divide unscaled "
                "gradients by the scale. Call scaler.scale(loss).backward(), or run unscaled "
                "backward passes through a model that is not attached"
            )
        self.scale_calls_seen = calls
        self.generation += 1
        self.release()  # a new backward: the grads held for the last one may be gone
        # DDP reduces the whole accumulated grad, so its new flag covers everything in it. FSDP2
        # reduces only this backward's part: an earlier flag stays unless its grads are gone.
        if self.ddp or all(p.grad is None for p in self.params):
            self.found = {}
            self.measured = {}
        self.in_backward = True
        engine = torch.autograd.Variable._execution_engine
        # Queued from a callback so that it runs after DDP's and FSDP2's own final callbacks,
        # which write the reduced values into the grads.
        engine.queue_callback(lambda: engine.queue_callback(self.end_backward))

    def end_backward(self) -> None:
        self.in_backward = False
        self.rescaled = set()
        # After DDP's finalize: the grad objects it left (a bucket view may replace the grad).
        # map() with C callables: no Python bytecode per parameter (about 0.1 us a grad).
        grads = list(map(_GRAD, self.params))
        if not any(map(_IS_NONE, grads)) and (self.ddp or _all_dtensors(grads)):
            # Every param has a grad: kept as lists, which step() compares at C speed.
            self._seen = list(map(weakref.ref, grads))
            self._held = grads
            self._versions = self._versions_of(grads)
            self._watched = self._watched_of(grads)
            self._watched_versions = (
                self._versions if self._watched is grads else self._versions_of(self._watched)
            )
            self._records = None
            if self.ddp:
                self.unscaled = set(self.ids)
            return
        self._seen = None
        self.release()
        self._records = {}
        for p, grad in zip(self.params, grads, strict=True):
            if grad is not None:
                self._records[id(p)] = (weakref.ref(grad), version_of(grad))
        if self.ddp:
            self.unscaled = set(self._records)

    def release(self) -> None:
        """Stop holding the grads of the last backward (they stay readable through `records()`).

        Held past update() or into the next iteration, grads the user dropped (zero_grad) would
        stay in memory through the next forward and backward; step() then takes
        :meth:`classify` instead of :meth:`untouched`.
        """
        self._held = None
        self._watched = []

    def _watched_of(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors whose versions move when any of ``grads`` is written in place.

        DDP with ``gradient_as_bucket_view=True``: every grad is a view of a bucket, and a view
        shares its base's version counter, so one version per bucket covers them all. Anything
        else (DDP's default separate grads, FSDP2's DTensors): the grads themselves.
        """
        if self.ddp:
            bases = list(map(_BASE, grads))
            if not any(map(_IS_NONE, bases)):
                return list(dict(zip(map(id, bases), bases)).values())  # each bucket once
        return grads

    def _versions_of(self, grads: list[torch.Tensor]) -> list[Any]:
        """:func:`version_of` each grad, at C speed (DDP: plain grads; FSDP2: DTensors)."""
        if self.ddp:
            return list(map(_VERSION, grads))
        return list(zip(map(_VERSION, grads), map(_LOCAL_VERSION, grads)))

    def records(self) -> dict[int, tuple[weakref.ref[torch.Tensor], Any]]:
        """id(param) -> (the grad, its version) as the hooks left them after the last backward."""
        if self._records is None:
            assert self._seen is not None  # noqa: S101 - one of the two is always kept
            self._records = {
                id(p): (ref, version)
                for p, ref, version in zip(self.params, self._seen, self._versions, strict=True)
            }
        return self._records

    def untouched(self) -> bool:
        """Whether every param's grad is the one the hook left, unwritten (a DDP fast path).

        C-level passes (read the grads, compare them with those held by identity, read the
        versions of the grads or, for bucket views, of the buckets): no Python code per grad,
        and no id() per grad. A False sends the step to :meth:`classify`, which tells the cases
        apart.
        """
        held = self._held
        if held is None:
            return False
        return (
            all(map(operator.is_, map(_GRAD, self.params), held))
            and self._versions_of(self._watched) == self._watched_versions
        )

    def rescale_before_accumulation(self, param: torch.nn.Parameter) -> None:
        """DDP: turn this hook's unscaled output back into scaled grads before a backward adds.

        Without no_sync(), a later backward adds scaled grads to the unscaled ones and DDP then
        reduces the sum; multiplying back first keeps every grad in the bucket scaled, as in the
        plain path (exactly so for a power-of-two scale).
        """
        # By id, not by grad object: DDP may move the grads into new bucket views (its bucket
        # rebuild after the first iteration) and they still hold the hook's output. A grad set to
        # None since has nothing to rescale; a zeroed one rescales to zeros.
        known = id(param) in self.unscaled
        self.unscaled.discard(id(param))
        grad = param.grad
        if not known or grad is None:
            return
        self.accumulations += 1
        with torch.no_grad():
            grad.mul_(copy_to(self.scale_of(), grad.device))
        self.rescaled.add(id(param))

    def measure(self, tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
        """Add reduced, unscaled grads to this iteration's measurement (policy="predictive")."""
        if self.measurer is None:
            return
        device = tensors[0].device
        self.measured[device] = measure_reduced(
            self.measured.get(device), tensors, scale, self.measurer.sampling
        )

    def classify(self, grads_of: Iterable[torch.nn.Parameter]) -> tuple[set[int], set[int]]:
        """Split ``grads_of`` (parameters with grads) into (covered now, sent back to the pass)."""
        covered: set[int] = set()
        back: set[int] = set()
        written: list[torch.nn.Parameter] = []
        records = self.records()
        for param in grads_of:
            key = id(param)
            if key not in self.ids:
                continue
            grad = param.grad
            record = records.get(key)
            if grad is None:
                continue
            if record is None or record[0]() is not grad:
                back.add(key)  # a grad a backward without hooks created: still scaled
            elif record[1] == version_of(grad):
                covered.add(key)
            elif key in self.rescaled:
                back.add(key)  # rescaled, then added to by a backward without hooks: scaled
            else:
                written.append(param)
        if written:
            raise AttachRefusal(
                f"attach(): the grads of {len(written)} parameter(s) (shapes "
                f"{[tuple(p.shape) for p in written[:3]]}) were written after the attached "
                "model's gradient reduction had unscaled and checked them, so the scaler cannot "
                "tell what they hold. Change grads only after scaler.unscale_(optimizer) (as for "
                "clipping), or do not attach() this model"
            )
        return covered, back


def unscale_allreduce_hook(
    state: HookState,
    bucket: dist.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: all-reduce the bucket, then average, unscale and check it in one pass."""
    state.begin_backward()
    buffer = bucket.buffer()
    scale = copy_to(state.scale_of(), buffer.device)
    low_precision = buffer.dtype in (torch.float16, torch.bfloat16)
    if low_precision:
        buffer.div_(state.world_size)
        inv = scale.double().reciprocal().float()
    else:
        inv = (scale.double() * state.world_size).reciprocal().float()
    found = state.flag(buffer.device)
    work = dist.all_reduce(buffer, group=state.group, async_op=True)

    def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
        reduced = fut.value()[0]
        torch._amp_foreach_non_finite_check_and_unscale_([reduced], found, inv)
        state.measure([reduced], scale)  # policy="predictive": the reduced, unscaled grads
        # NCCL runs this callback on its own stream: `inv`, `found` and `scale` were made on the
        # caller's, so the allocator must not reuse them before this stream's kernels read them.
        _used_on_current_stream(inv, found, scale)
        return reduced

    return work.get_future().then(finish)


def unscale_reduced_shard(state: HookState, reduce_output: torch.Tensor) -> None:
    """FSDP2 all-reduce hook: unscale and check this rank's reduce-scatter output in place."""
    state.begin_backward()
    scale = copy_to(state.scale_of(), reduce_output.device)
    inv = scale.double().reciprocal().float()
    found = state.flag(reduce_output.device)
    torch._amp_foreach_non_finite_check_and_unscale_([reduce_output], found, inv)
    state.measure([reduce_output], scale)  # policy="predictive": the reduced, unscaled shard
    _used_on_current_stream(inv, found, scale)  # FSDP2 calls this on its reduce stream


def _used_on_current_stream(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(tensor.device))


_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")
_BASE = operator.attrgetter("_base")  # a view's base (None for a tensor that is not a view)
_LOCAL_VERSION = operator.attrgetter("_local_tensor._version")  # a DTensor's local shard's


def version_of(grad: torch.Tensor) -> Any:
    """What moves when ``grad`` is written: its version, and a DTensor's local shard's too.

    An in-place op on a DTensor moves the wrapper's version and leaves its shard's as it was; a
    write to the shard itself moves only the shard's.
    """
    local = local_tensor(grad)
    return grad._version if local is grad else (grad._version, local._version)


def _all_dtensors(grads: list[torch.Tensor]) -> bool:
    return DTensor is not None and all(map(isinstance, grads, itertools.repeat(DTensor)))


_IS_NONE = functools.partial(operator.is_, None)


def _ddp_params(model: Any) -> list[torch.nn.Parameter]:
    ignored = model.parameters_to_ignore
    return [p for n, p in model.module.named_parameters() if n not in ignored and p.requires_grad]


def _fsdp2_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    from torch.distributed.fsdp import FSDPModule

    params: list[torch.nn.Parameter] = []
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            group = unit._get_fsdp_state()._fsdp_param_group  # type: ignore[attr-defined]
            if group is not None:
                params += [fp.sharded_param for fp in group.fsdp_params]
    return [p for p in params if p.requires_grad]


#: The report when no hook ran.
NO_HOOKS = HookReport(None, frozenset(), unscaled=False)


class ReductionHooks:
    """The models a scaler is attached to, and the flags their hooks recorded.

    A step reads the flags of the backward passes that made its grads: those of the models that
    hold its parameters, as they are when it is checked. A backward after an earlier step of the
    same iteration (backward, step, backward, step) makes new flags, read by the later step.
    """

    def __init__(self) -> None:
        self.states: list[HookState] = []
        # The last combined flag and measurement, with the (state, backward pass) it covers: one
        # model's several optimizers combine its flags once.
        self._combined: tuple[Any, torch.Tensor, torch.Tensor | None] | None = None
        # Per optimizer: its parameters' place among the attached models, rebuilt when its
        # param_groups or the attached models change (`epoch` counts those).
        self._sets: weakref.WeakKeyDictionary[torch.optim.Optimizer, ParamSet[HookState]] = (
            weakref.WeakKeyDictionary()
        )
        self.epoch = 0

    def __getstate__(self) -> dict[str, Any]:
        # A pickled scaler carries fresh hooks; the kept parameter sets are rebuilt on use.
        state = self.__dict__.copy()
        del state["_sets"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._sets = weakref.WeakKeyDictionary()

    def attach(
        self,
        model: torch.nn.Module,
        scale_of: Callable[[], torch.Tensor],
        scale_calls: Callable[[], int],
        measure: GradMeasure | None = None,
    ) -> None:
        """Register the hook that fits ``model`` (DDP or FSDP2); TypeError for anything else."""
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            params = _ddp_params(model)
            state = HookState(
                scale_of, scale_calls, params, model.process_group, ddp=True, measure=measure
            )
            model.register_comm_hook(state, unscale_allreduce_hook)
            for param in params:
                param.register_hook(_rescale_hook(state, param))
        elif isinstance(model, FSDPModule):
            params = _fsdp2_params(model)
            state = HookState(scale_of, scale_calls, params, None, ddp=False, measure=measure)
            for unit in model.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_all_reduce_hook(functools.partial(unscale_reduced_shard, state))
        else:
            raise TypeError(
                "attach() takes a DistributedDataParallel model or an FSDP2 (fully_shard) model, "
                f"got {type(model).__name__}; other models need no attach()"
            )
        # The next forward starts an iteration: the last backward's grads are no longer held.
        model.register_forward_pre_hook(functools.partial(_release_before_forward, state))
        self.states.append(state)
        self.epoch += 1
        # The model gone, its parameters are no longer the scaler's to vouch for (nor to keep).
        weakref.finalize(model, _forget, weakref.ref(self), weakref.ref(state)).atexit = False

    def _set_of(self, optimizer: torch.optim.Optimizer) -> ParamSet[HookState]:
        """``optimizer``'s :class:`ParamSet`, rebuilt only when its param_groups changed."""
        cached = self._sets.get(optimizer)
        if cached is None or not cached.matches(optimizer, self.epoch):
            cached = self._sets[optimizer] = param_set(self.states, optimizer, self.epoch)
        return cached

    def _relevant(self, optimizer: torch.optim.Optimizer) -> list[HookState]:
        """The attached models that hold some of ``optimizer``'s parameters."""
        return self._set_of(optimizer).relevant

    def reduced(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether a model holding ``optimizer``'s parameters reduced grads since update()."""
        return bool(self.states) and any(s.found for s in self._relevant(optimizer))

    def backwards(self, optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
        """The backward passes so far through the models holding ``optimizer``'s parameters, and
        those outside the reduction that added to grads their hooks had unscaled."""
        if not self.states:
            return ()
        return tuple(n for s in self._relevant(optimizer) for n in (s.generation, s.accumulations))

    def _flags(
        self, states: list[HookState], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The flag (and measurement) of ``states``' current grads on ``device``."""
        key = (device, tuple((s, s.generation) for s in states))
        cached = self._combined
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        flags = [f for s in states for f in s.found.values()]
        _used_on_current_stream(*flags)  # made on a reduce stream, read on this one
        if len(flags) > 1:
            flag = torch.stack([copy_to(f, device) for f in flags]).amax()
        else:  # one bucket: no stack and reduction of a single flag
            flag = copy_to(flags[0], device)
        measured = [m for s in states for m in s.measured.values()]
        _used_on_current_stream(*measured)
        combined = _combine([copy_to(m, device) for m in measured]) if measured else None
        self._combined = (key, flag, combined)
        return flag, combined

    def report(
        self, optimizer: torch.optim.Optimizer, scaler_group: Any, device: torch.device
    ) -> HookReport:
        """What the hooks checked of ``optimizer``'s grads, for the scaler's ``_check``.

        Per model, not per parameter: where every grad of a DDP model is the one its hook left,
        unwritten (one C-level pass, :meth:`HookState.untouched`), no Python code runs per
        parameter; anything else goes through :meth:`HookState.classify`, as before.
        """
        if not self.states:  # nothing attached: the common case, answered at once
            return NO_HOOKS
        pset = self._set_of(optimizer)
        relevant = pset.relevant
        ran = [s for s in relevant if s.found]
        if not ran:
            return NO_HOOKS
        flag, measured = self._flags(ran, device)
        backwards = tuple(n for s in relevant for n in (s.generation, s.accumulations))
        # Every grad of the models holding the optimizer's parameters untouched: so are its own.
        if all(s.untouched() for s in relevant):
            return HookReport(
                flag,
                pset.covered,
                unscaled=True,
                measured=measured,
                backwards=backwards,
                complete=pset.all_attached,
            )
        params = [p for g in optimizer.param_groups for p in g["params"]]
        with_grads = [p for p in params if p.grad is not None]
        covered: set[int] = set()
        back: set[int] = set()
        for state in relevant:
            here, there = state.classify(with_grads)
            covered |= here
            back |= there
        # Decided from what every rank shares (parameter sets, groups), never from local grads.
        fully_ddp = pset.all_attached and all(s.ddp and s.covers(scaler_group) for s in relevant)
        if fully_ddp and back:
            raise AttachRefusal(
                f"attach(): the grads of {len(back)} parameter(s) on this rank did not come "
                "through the attached DDP model's reduction (a backward outside the model, only "
                "under no_sync() before step(), or a grad replaced since), and with every "
                "parameter in the DDP model's reduction the scaler cannot tell whether they are "
                "scaled; the step is skipped on every rank. Run the last backward of each step "
                "through the DDP model, or do not attach() it"
            )
        return HookReport(
            flag,
            frozenset(covered),
            unscaled=True,
            measured=measured,
            backwards=backwards,
            complete=len(covered) == len(with_grads) == len(params),
        )

    def reset(self) -> None:
        """Forget this iteration's flags and measurements (update() calls it)."""
        self._combined = None
        for state in self.states:
            state.found = {}
            state.measured = {}
            state.release()


def _forget(hooks: weakref.ref[ReductionHooks], state: weakref.ref[HookState]) -> None:
    owner, gone = hooks(), state()
    if owner is not None and gone is not None and gone in owner.states:
        owner.states.remove(gone)
        owner._combined = None
        owner.epoch += 1


def _release_before_forward(state: HookState, module: torch.nn.Module, args: Any) -> None:
    state.release()


def _combine(measured: list[torch.Tensor]) -> torch.Tensor:
    """Several ``[max, small, elements]`` accumulators as one: the max, and the sums."""
    if len(measured) == 1:
        return measured[0]
    stacked = torch.stack(measured)
    return torch.cat([stacked[:, :1].amax(0), stacked[:, 1:].sum(0)])


def _rescale_hook(state: HookState, param: torch.nn.Parameter) -> Callable[[torch.Tensor], None]:
    ref = weakref.ref(param)

    def hook(grad: torch.Tensor) -> None:
        p = ref()
        if p is not None and id(p) in state.unscaled:
            state.rescale_before_accumulation(p)

    return hook

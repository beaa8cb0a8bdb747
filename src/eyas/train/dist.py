"""Process-group setup for `eyas train` under torchrun (or alone): rank, world, device.

Launched plainly, world = 1 and nothing is initialised. Under torchrun (WORLD_SIZE > 1) the
backend is NCCL on CUDA and gloo on CPU. Parallelism is applied from outside the model
(`wrap_model`): DDP by default, FSDP2 (`fully_shard`) with --fsdp.

Teardown must free the process group before the interpreter exits: a gloo group that outlives
destroy_process_group() keeps its worker and socket-loop threads running into interpreter shutdown,
and there they race the exit (now and then a rank aborts with "terminate called without an active
exception" after all its work is done). The holder found was a module imported after the group
exists that binds `group.WORLD` as a default argument (torch.distributed.nn.functional, which
transformers pulls in through torch.distributed.fsdp when it loads a config): `init_group` imports
it first, and `teardown` checks that the group is gone (a warning names the risk when it is not).
After an error, `abort` tears the group down without waiting on other ranks (NCCL: an abort, not a
destroy; see there) and never raises.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from eyas.errors import EyasError


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


# Modules whose functions take `group=group.WORLD` as a default: imported before the group exists they
# bind None (the default group at call time); imported after, the group object itself, for good.
_WORLD_DEFAULT_MODULES = ("torch.distributed.nn.functional",)


def init_group(backend: str, **kwargs) -> None:
    """torch.distributed.init_process_group(backend, **kwargs) unless a group exists, after importing
    the modules that would otherwise keep the group alive past destroy_process_group()."""
    for name in _WORLD_DEFAULT_MODULES:
        importlib.import_module(name)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=backend, **kwargs)


def setup(device: str) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    from eyas.dtypes import resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda":  # under torchrun each rank takes its LOCAL_RANK's GPU
        dev = torch.device("cuda", local if world > 1 or dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        init_group(backend, device_id=dev if dev.type == "cuda" else None)
    return Dist(rank, world, local, dev)


def teardown(d: Dist | None) -> None:
    """Destroy the process group (d None: whatever group exists) and make sure it is freed now, with
    its backend's threads joined, not at interpreter exit. Collectives must be over on every rank
    (after an error, when they may not be, use `abort`)."""
    if (d is not None and not d.enabled) or not torch.distributed.is_initialized():
        return
    _release(torch.distributed.destroy_process_group)


def abort(d: Dist | None) -> None:
    """Teardown on an error path (d None: whatever group exists): free the group without waiting on the
    other ranks, which may be blocked in a collective this rank will never join, or gone. Never raises:
    it runs while an exception propagates, and a failure here is logged as a warning instead of
    replacing that exception.

    NCCL: destroy_process_group() shuts the communicators down, which can block while peers (or this
    rank's own queued kernels) are stuck in a collective. ncclCommAbort does not wait, so the group is
    aborted instead: torch's `distributed_c10d._abort_process_group()` where it exists (private, NCCL
    only; it aborts every group inside one NCCL group call and clears torch's registry like destroy
    does), else `ProcessGroup.abort()` followed by destroy (which then finds no live communicator to
    shut down), else plain destroy (older torch, whose ProcessGroupNCCL destructor aborts its
    communicators). Both calls are feature-detected, never assumed from the version. (Not run on GPUs
    here: the tests check which call is made, on a gloo group that reports NCCL.)

    gloo: a plain destroy. ProcessGroupGloo has no abort (torch's Backend.abort() is a no-op for it, and
    _abort_process_group ends in the same destructor). Destroy returns at once unless this rank itself
    left work queued (e.g. a DDP bucket all-reduce launched before the error): the destructor waits for
    that until the peers join it, drop their connections, or the group's timeout passes; it never
    waits on a collective a peer is blocked in. Such a peer is released by this rank closing its
    connections ("Connection closed by peer" there, at once), and a rank whose collective failed that
    way has nothing left queued."""
    try:
        if (d is not None and not d.enabled) or not torch.distributed.is_initialized():
            return
        backend = str(torch.distributed.get_backend()).lower()  # "nccl", "gloo", or "cpu:gloo,cuda:nccl"
        _release(_abort_nccl if "nccl" in backend else torch.distributed.destroy_process_group)
    except BaseException as exc:  # noqa: BLE001 (a second Ctrl-C included: the error being raised goes first)
        from eyas.common import log

        log(
            f"eyas: warning: tearing the process group down after the error failed ({type(exc).__name__}: {exc}); "
            "the error that stopped the run follows"
        )


def _abort_nccl() -> None:
    from torch.distributed import distributed_c10d as c10d

    abort_all = getattr(c10d, "_abort_process_group", None)
    if abort_all is not None:
        abort_all()
        return
    pg = torch.distributed.group.WORLD
    if pg is not None and hasattr(pg, "abort"):
        pg.abort()
    del pg
    torch.distributed.destroy_process_group()


def _release(end_group) -> None:
    """end_group() (destroy or abort the default group), then check that the group object is freed."""
    pg = torch.distributed.group.WORLD
    ref = weakref.ref(pg) if pg is not None else None
    del pg
    end_group()
    if ref is None or ref() is None:
        return
    gc.collect()  # a reference cycle holding it
    if ref() is not None:
        _drop_dtensor_caches()
        gc.collect()
    if ref() is not None:
        from eyas.common import log

        log(
            f"eyas: warning: the process group is still referenced after destroy_process_group ({sys.getrefcount(ref()) - 1} "
            "references, e.g. a module imported after init_group that binds group.WORLD as a default argument); its "
            "threads may outlive it and abort the process at exit"
        )


# DTensor's caches that FSDP2 fills with sharding specs, each holding the device mesh and through it
# the group; private, so each is looked up and skipped when this torch lacks it
_DTENSOR_CACHES = (
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
    ("torch.distributed.tensor._sharding_prop", "ShardingPropagator._propagate_tensor_meta_cached.cache_clear"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
)


def _drop_dtensor_caches() -> None:
    """Clear DTensor's sharding caches (after an FSDP2 run they keep the destroyed group alive)."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    for module, path in _DTENSOR_CACHES:
        try:
            obj: Any = importlib.import_module(module)
            for name in path.split("."):
                obj = getattr(obj, name)
            obj()
        except Exception:  # noqa: BLE001 (best effort: _release warns when the group stays)
            pass


def all_reduce_sum(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.enabled:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return t


def _bf16_all_reduce(state, bucket):
    """DDP comm hook: the bucket's mean all-reduced in bf16, written back into the fp32 bucket (NCCL and gloo)."""
    buf = bucket.buffer()
    half = buf.div(torch.distributed.get_world_size()).to(torch.bfloat16)
    fut = torch.distributed.all_reduce(half, async_op=True).get_future()

    def unpack(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(unpack)


def wrap_model(
    module: torch.nn.Module, d: Dist, *, fsdp: bool, bf16: bool, grad_reduce: str = "fp32"
) -> torch.nn.Module:
    """DDP (world > 1), FSDP2 (--fsdp: parameters sharded, bf16 compute, fp32 reduce) or as is.

    DDP keeps the gradients as views of its all-reduce buckets (no copy into and out of the buckets
    each step). grad_reduce="bf16" all-reduces them in bf16: half the bytes on the wire, each rank's
    gradient divided by the world size before it is rounded to bf16; the sum lands back in fp32."""
    if fsdp:
        if not d.enabled:
            raise EyasError(
                "--fsdp needs several processes: launch with `torchrun --nproc_per_node N -m eyas train ...`"
            )
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else torch.float32, reduce_dtype=torch.float32)
        # one unit: only modules whose forward() runs can be their own FSDP unit, and the mid layer
        # (project_qkv/finish) and lm_head (read by the fused chunked loss) are driven from outside
        fully_shard(module, mp_policy=mp)
        return module
    if d.enabled:
        import inspect

        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [d.device.index] if d.device.type == "cuda" else None
        # no buffer broadcast before each forward (every rank builds the same buffers); torch's new name for it
        # where it has one: the old one warns of its deprecation
        sync = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(DDP).parameters
            else {"broadcast_buffers": False}
        )
        ddp = DDP(module, device_ids=ids, gradient_as_bucket_view=True, **sync)
        if grad_reduce == "bf16":
            ddp.register_comm_hook(None, _bf16_all_reduce)
        return ddp
    return module

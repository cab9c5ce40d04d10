"""SGLang's weight-update routes: from tensor, the weight-update group (init, update
from distributed, destroy), the update session (begin, end) and the version label."""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from aiosync.engines.sglang.contract_server._base import _Routes
from aiosync.engines.sglang.contract_server._state import _RankLoadError
from aiosync.engines.sglang.contract_server._wire import (
    _NO_SESSION,
    _SESSION_OPEN,
    _count,
    _error,
    _HTTPError,
    _is_int,
    _outside_session,
    _selector,
)
from aiosync.errors import TransportError
from aiosync.transports._verify import transit_fault
from aiosync.transports.collective._custom_group import CustomGroup, join_custom_group
from aiosync.transports.http import (
    FLATTENED_BUCKET,
    decode_flattened_bucket,
)


class _WeightRoutes(_Routes):
    """SGLang's weight-update routes."""

    def _update_weights_from_tensor(self, data: dict[str, Any]) -> Any:
        state = self.server.state
        entries = data.get("serialized_named_tensors")
        load_format = data.get("load_format")
        if load_format != FLATTENED_BUCKET:
            raise _HTTPError(
                400, {"success": False, "message": f"unsupported load_format {load_format!r}"}
            )
        if not isinstance(entries, list) or len(entries) != state.tp_size:
            raise _HTTPError(
                400,
                {
                    "success": False,
                    "message": f"serialized_named_tensors needs {state.tp_size} entries "
                    f"(one per TP rank), got {_count(entries)}",
                },
            )
        selector = _selector(data)
        self._require_weights()
        self._require_session("update_weights_from_tensor")
        try:
            # Rank r decodes entry r and loads it into its own model, as SGLang's
            # TP workers do (each deserializes only its own rank's entry).
            per_rank = [decode_flattened_bucket(e) for e in entries]
        except TransportError as exc:
            raise _HTTPError(400, {"success": False, "message": str(exc)}) from exc
        self._times["decoded"] = time.monotonic()
        # The test fault lands in what TP rank 0 received (its own private mapping),
        # before the load copies it into the model: what SGLang's read-back reads.
        _fault_in_transit(per_rank[0], state.take_update_index())
        try:
            with state.model_lock:
                try:
                    state.load_selected(per_rank, selector)
                except _RankLoadError as failed:
                    rank, error = failed.rank, failed.error
                    message = f"TP rank {rank}: {error}" if rank else str(error)
                    raise _HTTPError(400, {"success": False, "message": message}) from error
        finally:
            # Drop every view so the sender's shared segments can be released.
            del per_rank
        self._times["loaded"] = time.monotonic()
        return self._after_update(data, "Success")

    def _require_weights(self) -> None:
        """400 while the weights are released (nothing to load them into)."""
        if "weights" in self.server.state.released:
            raise _HTTPError(
                400, {"success": False, "message": "weights are released; resume them first"}
            )

    def _require_session(self, route: str) -> None:
        """400 outside a weight-update session, on a server that has them (SGLang 0.5.23's
        ``SchedulerWeightUpdaterManager.update_weights_from_tensor`` and
        ``..._from_distributed``, each naming itself)."""
        state = self.server.state
        with state.lock:
            outside = state.weight_update_session and not state.session_open
        if outside:
            raise _HTTPError(400, {"success": False, "message": _outside_session(route)})

    def _after_update(self, data: dict[str, Any], message: str) -> dict[str, Any]:
        """What follows a successful load on every rank, the same for each update route:
        the scheduler learns the weights changed, the cache is flushed (``flush_cache``,
        default true) and ``weight_version`` recorded (pending until the session's end
        when one is open). Returns the answer, ``{"success": true, "message": message}``
        (``" Weight version updated to {v}."`` appended when a version came).

        Raises:
            _HTTPError: 500 when the flush is refused (requests still run): SGLang
                asserts there and its scheduler dies.
        """
        state = self.server.state
        state.scheduler.weights_changed()
        if data.get("flush_cache", True):
            with state.lock:
                if not state.scheduler.flush():
                    raise _error("Cache flush failed after updating weights", 500)
                state.cache.clear()
        version = data.get("weight_version")
        if version is not None:
            with state.lock:
                if state.session_open:
                    state.pending_version = str(version)
                else:
                    state.weight_version = str(version)
            message += f" Weight version updated to {version}."
        return {"success": True, "message": message}

    def _init_weights_update_group(self, data: dict[str, Any]) -> Any:
        """SGLang's ``InitWeightsUpdateGroupReqInput``: ``master_address`` (str),
        ``master_port``, ``rank_offset``, ``world_size`` (int), ``group_name`` (default
        ``"weight_update_group"``), ``backend`` (default ``"nccl"``).

        Every TP rank ``r`` joins group ``group_name`` as rank ``rank_offset + r`` of
        ``world_size``, all at once (the backend forms only once every rank, the
        trainer's rank 0 included, joined), each over its own client of the trainer's
        ``TCPStore`` at ``master_address:master_port``, as SGLang's TP workers do
        (``init_custom_process_group``, ``tcp://`` rendezvous). Blocks until formed, at
        most :attr:`ServerState.weights_update_timeout_s`.

        Answers ``{"success": true, "message": "Succeeded to initialize custom process
        group."}``; 400 ``{"success": false, "message": "Failed to initialize custom
        process group: {reason}."}`` for backend ``"nccl"`` (no CUDA here), a name
        already formed (torch's text), a rank outside ``world_size`` or a formation that
        failed or timed out (then no rank keeps a member); 422 for a malformed body.
        """
        state = self.server.state
        address, port = data.get("master_address"), data.get("master_port")
        offset, world = data.get("rank_offset"), data.get("world_size")
        name = data.get("group_name", _DEFAULT_GROUP)
        backend = data.get("backend", "nccl")
        if not (
            isinstance(address, str)
            and isinstance(port, int)
            and isinstance(offset, int)
            and isinstance(world, int)
            and not any(isinstance(v, bool) for v in (port, offset, world))
            and isinstance(name, str)
            and isinstance(backend, str)
        ):
            raise _HTTPError(
                422,
                {
                    "detail": "master_address (str), master_port, rank_offset and world_size "
                    "(int) are required; group_name and backend are strings"
                },
            )
        if not name:
            # SGLang asserts this in every TP worker.
            raise _HTTPError(400, {"success": False, "message": "Group name cannot be empty"})
        if backend == "nccl":
            raise _init_failure(
                "backend 'nccl' needs CUDA, and this test server runs on CPU only; "
                "use backend='gloo'"
            )
        if backend != "gloo":
            raise _init_failure(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        outside = [r for r in range(offset, offset + state.tp_size) if not 0 <= r < world]
        if outside:
            # Refused before any rank joins: the others would wait out the timeout.
            raise _init_failure(f"rank {outside[0]} is outside a group of {world} ranks")
        timeout_s = state.weights_update_timeout_s

        def join(tp_rank: int) -> CustomGroup:
            # One store client per TP rank, as SGLang's tcp:// rendezvous makes in each
            # TP worker process.
            store = dist.TCPStore(
                address,
                port,
                None,
                False,
                datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
            return join_custom_group(
                store,
                group_name=name,
                rank=offset + tp_rank,
                world_size=world,
                backend=backend,
                timeout_s=timeout_s,
            )

        with state.group_lock:
            with state.lock:
                taken = name in state.weight_groups
            if taken:
                # What torch's _new_process_group_helper raises in each TP worker.
                raise _init_failure(
                    "The specified group name has already been created, "
                    "please use a different group name"
                )
            results = _on_every_rank(state.tp_size, join)
            members = [m for m in results if isinstance(m, CustomGroup)]
            if len(members) < len(results):
                for member in members:
                    member.close()
                rank, exc = next(
                    (r, e) for r, e in enumerate(results) if isinstance(e, BaseException)
                )
                raise _init_failure(_on_rank(rank, exc))
            with state.lock:
                state.weight_groups[name] = members
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def _update_weights_from_distributed(self, data: dict[str, Any]) -> Any:
        """SGLang's ``UpdateWeightsFromDistributedReqInput``: ``names``, ``dtypes`` (torch
        attribute names: ``"bfloat16"``), ``shapes`` (one each per tensor), ``group_name``
        (default ``"weight_update_group"``), ``flush_cache`` (default true),
        ``abort_all_requests`` (default false), ``weight_version``, ``load_format``.

        Every TP rank receives the tensors from rank 0 over its own member of the group,
        all ranks at once: with ``load_format="flattened_bucket"`` ONE broadcast of a
        uint8 tensor, the tensors' bytes concatenated in ``names`` order, no padding
        (SGLang's ``FlattenedTensorBucket``); otherwise one broadcast per tensor, in
        ``names`` order. Each rank then loads them into its own model.

        Answers ``{"success": true, "message": "Succeeded to update parameter online."}``
        (``" Weight version updated to {v}."`` appended when ``weight_version`` came);
        400 ``{"success": false, ...}`` outside a session, for an unknown group, released
        weights, or a failed receive or load (SGLang's "Failed to update parameter
        online: ..." text; a failed broadcast leaves the group broken); 422 for a
        malformed body; 500 when the flush after the load is refused.
        """
        state = self.server.state
        names, dtypes, shapes = data.get("names"), data.get("dtypes"), data.get("shapes")
        name = data.get("group_name", _DEFAULT_GROUP)
        if not (
            isinstance(names, list)
            and all(isinstance(n, str) for n in names)
            and isinstance(dtypes, list)
            and all(isinstance(d, str) for d in dtypes)
            and isinstance(shapes, list)
            and all(
                isinstance(shape, list) and all(_is_int(n) and n >= 0 for n in shape)
                for shape in shapes
            )
            and isinstance(name, str)
        ):
            raise _HTTPError(
                422,
                {
                    "detail": "names and dtypes must be lists of strings, shapes a list of "
                    "lists of sizes, group_name a string"
                },
            )
        if not len(names) == len(dtypes) == len(shapes):
            # SGLang zips them and drops the extra entries silently; a bug to surface here.
            raise _HTTPError(
                422,
                {
                    "detail": "names, dtypes and shapes need one entry each per tensor, got "
                    f"{len(names)}, {len(dtypes)}, {len(shapes)}"
                },
            )
        bucketed = data.get("load_format") == FLATTENED_BUCKET
        selector = _selector(data)
        if data.get("abort_all_requests", False):
            # SGLang's TokenizerManager aborts before it hands the update on.
            state.scheduler.abort_all()
        self._require_session("update_weights_from_distributed")
        with state.group_lock:
            with state.lock:
                members = state.weight_groups.get(name)
                known = list(state.weight_groups)
            if members is None:
                raise _HTTPError(
                    400,
                    {
                        "success": False,
                        "message": f"Group {name} not in {known}. "
                        "Please call `init_weights_update_group` first.",
                    },
                )
            self._require_weights()
            try:
                specs = [
                    (n, _torch_dtype(d), tuple(shape))
                    for n, d, shape in zip(names, dtypes, shapes, strict=True)
                ]
            except ValueError as exc:
                raise _update_failure(str(exc)) from exc
            group = members
            index = state.take_update_index()

            def receive(tp_rank: int) -> list[tuple[str, torch.Tensor]]:
                return _receive_tensors(group[tp_rank], specs, bucketed)

            results = _on_every_rank(state.tp_size, receive)
            self._times["received"] = time.monotonic()
            per_rank: list[list[tuple[str, torch.Tensor]]] = []
            for rank, result in enumerate(results):
                if isinstance(result, BaseException):
                    raise _update_failure(_on_rank(rank, result))
                per_rank.append(result)
            # The test fault lands in what TP rank 0 received, before its load.
            _fault_in_transit(per_rank[0], index)
            with state.model_lock:
                try:
                    state.load_selected(per_rank, selector)
                except _RankLoadError as failed:
                    raise _update_failure(_on_rank(failed.rank, failed.error)) from failed.error
            self._times["loaded"] = time.monotonic()
        return self._after_update(data, "Succeeded to update parameter online.")

    def _destroy_weights_update_group(self, data: dict[str, Any]) -> Any:
        """SGLang's ``DestroyWeightsUpdateGroupReqInput``: ``group_name`` (default
        ``"weight_update_group"``). Closes every TP rank's member and forgets the group.

        Answers ``{"success": true, "message": "Succeeded to destroy custom process
        group."}``; 400 ``{"success": false, "message": "The group to be destroyed does
        not exist."}`` for a name not formed.
        """
        state = self.server.state
        name = data.get("group_name", _DEFAULT_GROUP)
        if not isinstance(name, str):
            raise _HTTPError(422, {"detail": "group_name must be a string"})
        with state.group_lock:
            with state.lock:
                members = state.weight_groups.pop(name, None)
            if members is None:
                raise _HTTPError(
                    400,
                    {"success": False, "message": "The group to be destroyed does not exist."},
                )
            for member in members:
                member.close()
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def _begin_weight_update(self, data: dict[str, Any]) -> Any:
        """SGLang 0.5.23's ``BeginWeightUpdateReqInput`` (``selector``: ``"target" | "draft" |
        "all"``, its only field; another value is SGLang's validation error, 400): opens the
        session; a second ``begin`` is refused (400), as SGLang's ``begin_weight_update``."""
        selector = _selector(data)
        state = self.server.state
        with state.lock:
            if state.session_open:
                raise _HTTPError(400, {"success": False, "message": _SESSION_OPEN})
            state.session_open = True
            state.session_selector = selector
            state.pending_version = None
            state.update_index = 0
        return {"success": True, "message": "Success"}

    def _end_weight_update(self, data: dict[str, Any]) -> Any:
        """SGLang's ``EndWeightUpdateReqInput``: closes the session (the loader's
        post-processing is a no-op here), recording the version its updates carried."""
        state = self.server.state
        with state.lock:
            if not state.session_open:
                raise _HTTPError(400, {"success": False, "message": _NO_SESSION})
            state.session_open = False
            if state.pending_version is not None:
                state.weight_version, state.pending_version = state.pending_version, None
        return {"success": True, "message": "Success"}

    def _update_weight_version(self, data: dict[str, Any]) -> Any:
        """SGLang's ``UpdateWeightVersionReqInput``: ``new_version`` (str), ``abort_all_requests``
        (default True). Only the label changes, never the weights; ``abort_all_requests``
        ends the running requests before their next token (``finish_reason`` abort)."""
        version = data.get("new_version")
        if not isinstance(version, str):
            raise _error(f"new_version must be a string, got {version!r}")
        abort = data.get("abort_all_requests", True)
        if not isinstance(abort, bool):
            raise _error(f"abort_all_requests must be a bool, got {abort!r}")
        if abort:
            self.server.state.scheduler.abort_all()
        with self.server.state.lock:
            self.server.state.weight_version = version
            self.server.state.update_index = 0
        return {
            "success": True,
            "message": f"Weight version updated to {version}",
            "new_version": version,
        }


#: SGLang's default ``group_name`` of the three weight-update group routes (io_struct).
_DEFAULT_GROUP = "weight_update_group"
_T = TypeVar("_T")


def _reason(exc: BaseException) -> str:
    """An exception's first line (torch's store errors run over many lines)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _on_rank(rank: int, exc: BaseException) -> str:
    """``exc``'s reason, naming the TP rank when it is not rank 0 (as the tensor route)."""
    return f"TP rank {rank}: {_reason(exc)}" if rank else _reason(exc)


def _init_failure(reason: str) -> _HTTPError:
    # SGLang's init_weights_update_group wraps every formation error so.
    return _HTTPError(
        400,
        {"success": False, "message": f"Failed to initialize custom process group: {reason}."},
    )


def _update_failure(reason: str) -> _HTTPError:
    # SGLang's update_weights_from_distributed wraps every receive or load error so.
    return _HTTPError(
        400,
        {
            "success": False,
            "message": f"Failed to update parameter online: {reason}. The full weights of the "
            "ModelRunner are partially updated. Please discard the whole weights.",
        },
    )


def _torch_dtype(name: str) -> torch.dtype:
    """``getattr(torch, name)`` as SGLang resolves ``dtypes`` entries; ValueError when
    that is no dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype")
    return dtype


def _on_every_rank(count: int, work: Callable[[int], _T]) -> list[_T | BaseException]:
    """``work(r)`` for every TP rank ``r < count`` at once, each in its own thread: the
    ranks take part in one collective together (SGLang's TP workers are processes),
    so one at a time would wait for the others forever. Returns each rank's result or
    exception, rank order; every thread has ended by then."""
    if count == 1:
        try:
            return [work(0)]
        except Exception as exc:
            return [exc]
    with ThreadPoolExecutor(max_workers=count, thread_name_prefix="aiosync-sglang-tp") as pool:
        futures = [pool.submit(work, rank) for rank in range(count)]
    out: list[_T | BaseException] = []
    for future in futures:
        error = future.exception()
        out.append(future.result() if error is None else error)
    return out


def _receive_tensors(
    member: CustomGroup,
    specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
    bucketed: bool,
) -> list[tuple[str, torch.Tensor]]:
    """One TP rank's receive of ``/update_weights_from_distributed``.

    Args:
        member: this rank's member of the group (rank 0, the trainer, sends).
        specs: ``(name, dtype, shape)`` per tensor, ``names`` order.
        bucketed: ONE broadcast of a uint8 tensor of ``sum(numel * element_size)``
            bytes, each tensor's bytes in ``specs`` order with no padding (SGLang's
            ``FlattenedTensorBucket``); False: one broadcast per tensor, in order.

    Returns:
        ``(name, tensor)`` per spec, of its dtype and shape: views of the received
        bucket where its offset is aligned for its dtype, else copies.

    Raises:
        TransportError, SyncTimeoutError: a broadcast failed (the member is broken).
    """
    if not bucketed:
        tensors = [(name, torch.empty(shape, dtype=dtype)) for name, dtype, shape in specs]
        # SGLang issues every broadcast async and then waits for all: on one
        # connection the same order, received one after the other here.
        for name, tensor in tensors:
            member.broadcast(tensor, what=f"receiving {name!r}")
        return tensors
    sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in specs]
    flat = torch.empty(sum(sizes), dtype=torch.uint8)
    member.broadcast(flat, what=f"receiving a bucket of {len(specs)} tensors, {flat.numel()} bytes")
    out: list[tuple[str, torch.Tensor]] = []
    start = 0
    for (name, dtype, shape), size in zip(specs, sizes, strict=True):
        piece = flat[start : start + size]
        if start % dtype.itemsize == 0:
            # A view of the bucket, as SGLang's FlattenedTensorBucket.reconstruct_tensors.
            out.append((name, piece.view(dtype).view(shape)))
        else:
            # A dtype view needs an aligned offset: a copy (mixed-dtype buckets only).
            tensor = torch.empty(shape, dtype=dtype)
            tensor.view(-1).view(torch.uint8).copy_(piece)
            out.append((name, tensor))
        start += size
    return out


def _fault_in_transit(tensors: Sequence[tuple[str, torch.Tensor]], bucket: int) -> None:
    """Apply the test fault armed for ``bucket`` (:func:`transit_fault`, a no-op unless a
    test armed one) to the bytes one TP rank received, before its load.

    The received tensors are views of one buffer, back to back (a flattened bucket):
    the fault is applied to those bytes in place. Otherwise (one broadcast per tensor)
    to a copy of their bytes in order, copied back.
    """
    views = [tensor for _, tensor in tensors]
    if not views:
        return
    span = _span(views)
    if span is not None:
        transit_fault(span, bucket)
        return
    raw = torch.cat([v.reshape(-1).view(torch.uint8) for v in views])
    transit_fault(raw, bucket)
    start = 0
    for view in views:
        size = view.numel() * view.element_size()
        view.reshape(-1).view(torch.uint8).copy_(raw[start : start + size])
        start += size


def _span(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A ``uint8`` view of the bytes ``views`` cover when they lie back to back, in order,
    contiguous, in one storage; else None."""
    storage = views[0].untyped_storage()
    start = end = views[0].storage_offset() * views[0].element_size()
    for view in views:
        offset = view.storage_offset() * view.element_size()
        if (
            view.untyped_storage().data_ptr() != storage.data_ptr()
            or not view.is_contiguous()
            or offset != end
        ):
            return None
        end = offset + view.numel() * view.element_size()
    span = torch.empty(0, dtype=torch.uint8, device=views[0].device)
    return span.set_(storage, start, (end - start,), (1,))

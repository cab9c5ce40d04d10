"""The HTTP synchronizer's checks of the servers' weights: read-back and checksums.

The read-back (``verify=`` at each sync, and :meth:`ServerChecks.verify_engine`)
reads tensors through SGLang's ``/get_weights_by_name`` and compares them with the
trainer's (:mod:`._readback` says which tensors a server can return); with
``record_checksums`` the servers' ``/weights_checker`` checksums recorded at a commit
are compared with theirs now. ``docs/sglang.md`` and ``docs/vllm-server.md`` say which
check catches what.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

import anyio
import torch

from aiosync._fanout import each_named, named
from aiosync.capabilities import ConfigReporting
from aiosync.errors import RefitVerificationError, SyncError, TransportError
from aiosync.sources import ConfigSource

from .._verify import Verify, verify_label
from ._readback import Expected, Unreadable, first_difference, qkv_readable, readable
from ._servers import ServerFanout
from ._wire import FlatBucket
from .server import SGLangServer, SGLangWeightChecker, SGLangWeightReader

__all__ = ["ServerChecks"]

# The synchronizer's logger, as before the split: users select it by name.
_log = logging.getLogger(__name__.rpartition(".")[0] + ".synchronizer")

#: ``"sample"`` read-back requests in flight per server.
_READS_IN_FLIGHT = 8


class ServerChecks(ServerFanout):
    """Reads the servers' weights back and compares their checksums (see the module).

    The synchronizer sets the attributes below: what :meth:`open` learnt of each
    server, the checksums recorded at the last commit, the gaps already warned of.
    """

    verify: Verify
    live_unverified: tuple[str, ...]
    _dp_sizes: list[int]
    _served_dtypes: list[torch.dtype | None]
    _read_qkv: bool
    _warned: set[tuple[str, str]]
    _checksums: dict[str, dict[tuple[str, str], str]]
    _checksum_version: int
    _plan: tuple[FlatBucket, ...]

    async def _qkv_read_back(self) -> bool:
        """Whether the read-back may include q/k/v_proj (:func:`._readback.qkv_readable`
        of the trainer's HF config, else of the first server's that reports one)."""
        if isinstance(self.policy, ConfigSource):
            config = await anyio.to_thread.run_sync(self.policy.hf_config)
            if config is not None:
                return qkv_readable(config)
        for server in self.servers:
            if isinstance(server, ConfigReporting):
                config = await server.expected_config()
                if config is not None:
                    return qkv_readable(config)
        return False

    async def verify_engine(self) -> dict[str, int]:
        """Check the servers' live weights against the trainer's, moving no weights.

        Two checks, under the sync lock and the source lock (a running sync ends first):

        * the READ-BACK: every tensor SGLang's ``/get_weights_by_name`` returns as the
          checkpoint holds it (:func:`._readback.readable`), read whole from every
          server and compared with what the source yields now, exactly as
          ``verify=True``; what it cannot return (q/k/v_proj of a model whose
          ``head_dim`` is not ``hidden_size // num_attention_heads``, 0-d tensors, a
          tensor the server answers 400 for: every tensor of a real Qwen3 server) is
          named in :attr:`live_unverified` with why, and logged;
        * with ``record_checksums=True``: every server's ``/weights_checker`` checksum
          of each tensor of each TP rank, against those recorded at the last commit: a
          tensor changed since (any tensor, fused ones included) is named. This says
          the weights did not change since the commit, not that the commit held the
          trainer's tensors: SGLang's checksum is of its own, fused, sharded and
          post-processed tensors (a Triton hash on GPU), which a trainer cannot
          recompute.

        Returns:
            ``{"workers": servers, "tensors": tensors read back and compared (summed
            over servers), "unverified": source tensors not compared with the trainer's
            (:attr:`live_unverified`), "checksummed": server tensors whose checksum
            matched the recorded one (summed over TP ranks and servers), "version":
            weight_version}``.

        Raises:
            RefitVerificationError: a server holds a tensor other than the trainer's, or
                one changed since the commit (the server, the tensor and, for the
                checksums, the TP rank named). The synchronizer is then stale
                (:attr:`is_stale`): the next sync rewrites every tensor.
            SyncError: nothing could be compared (no server reads back or checksums).
            TransportError, SyncTimeoutError: a request failed.
        """
        self._check_open()
        async with self._lock, self._source_lock:
            version = self._weight_version
            mismatch: RefitVerificationError | None = None
            checksummed, unchanged = 0, False
            tally = [0]
            unverified: tuple[str, ...] = ()
            try:
                checksummed, unchanged = await self._check_checksums()
                verdict = (
                    f"(verify_engine(): the live weights against the trainer's version "
                    f"{self._policy_version}, labelled {version})"
                )
                unverified = await self._read_back(True, (), verdict=verdict, tally=tally)
            except RefitVerificationError as exc:
                mismatch = exc
        if mismatch is not None:
            # The servers do not hold weight_version: stale until a sync lands.
            self._live_weights_wrong()
            raise mismatch
        if unchanged:
            since = (
                f"; unchanged since the commit of version {self._checksum_version} "
                "(/weights_checker checksums), never compared with the trainer's"
            )
            unverified = tuple(entry + since for entry in unverified)
        self.live_unverified = unverified
        if tally[0] == 0 and checksummed == 0:
            raise SyncError(
                "verify_engine() compared nothing: no server reads these tensors back "
                "(/get_weights_by_name) and no checksums were recorded at the last commit "
                "(record_checksums=True, a server with /weights_checker)"
            )
        return {
            "workers": len(self.servers),
            "tensors": tally[0],
            "unverified": len(unverified),
            "checksummed": checksummed,
            "version": version,
        }

    async def _server_checksums(
        self, index: int, server: SGLangServer
    ) -> dict[tuple[str, str], str] | None:
        """Server ``index``'s ``/weights_checker`` checksums, ``{(rank, name): hex}``
        (rank: ``"TP rank r"``, with the DP rank when there are several); None: it
        has no checker (warned once).

        Raises:
            TransportError: the server refused or answered without ``ranks``.
        """
        if not isinstance(server, SGLangWeightChecker):
            self._warn_once(
                index, "no weights_checker", f"{type(server).__name__} has no check_weights"
            )
            return None
        answer = await server.check_weights("checksum")
        if answer is None:
            self._warn_once(
                index, "no weights_checker", "no /weights_checker (404): no checksums recorded"
            )
            return None
        ranks = answer.get("ranks")
        if not answer.get("success") or not isinstance(ranks, list):
            raise TransportError(
                f"{self._label(index)}: /weights_checker checksum failed: {answer.get('message')}"
            )
        sums: dict[tuple[str, str], str] = {}
        for position, info in enumerate(ranks):
            places = info.get("parallelism_info") or [{}]
            place = places[0] if isinstance(places, list) and places else {}
            where = f"TP rank {place.get('tp_rank', position)}"
            if int(place.get("dp_size", 1) or 1) > 1:
                where += f", DP rank {place.get('dp_rank')}"
            for name, digest in (info.get("checksums") or {}).items():
                sums[(where, str(name))] = str(digest)
        return sums

    async def _check_checksums(self) -> tuple[int, bool]:
        """The checksums recorded at the last commit against the servers' now: returns
        how many matched and whether every server in the sync had a record.

        Raises:
            RefitVerificationError: a tensor's checksum differs or it is gone (named).
        """
        if not self._checksums:
            return 0, False
        servers = self.servers
        recorded = [self._checksums.get(server.base_url) for server in servers]

        async def now(index: int, server: SGLangServer) -> dict[tuple[str, str], str] | None:
            if recorded[index] is None:
                return None
            return await self._server_checksums(index, server)

        current = await self._each_indexed(now)
        matched = 0
        for index, (then, held) in enumerate(zip(recorded, current, strict=True)):
            if then is None:
                continue
            for (where, name), digest in then.items():
                found = None if held is None else held.get((where, name))
                if found != digest:
                    what = "is gone" if found is None else f"now {found}"
                    raise RefitVerificationError(
                        f"{self._label(index)}: {name} ({where}) changed since the commit of "
                        f"version {self._checksum_version} (/weights_checker checksum "
                        f"{digest} then, {what}; verify_engine())"
                    )
                matched += 1
        return matched, all(r is not None for r in recorded)

    async def _read_back(
        self,
        verify: Verify,
        kept: Sequence[Expected],
        *,
        verdict: str | None = None,
        tally: list[int] | None = None,
    ) -> tuple[str, ...]:
        """``verify``'s check: what each server holds, read back through
        ``/get_weights_by_name``, against what the trainer sent.

        ``"sample"``: the ``kept`` tensors' first rows. ``True``: every
        :func:`._readback.readable` tensor whole (``truncate_size=numel``), re-read
        from the source one at a time (this runs inside the sync, under the source
        lock: the same version). Servers are read side by side, one request at a
        time each for ``True`` (whole tensors), a few at a time for ``"sample"``.
        ``verdict`` ends a mismatch's message (default: the sync's); ``tally[0]`` counts
        the tensors compared (per server).

        Returns:
            ``verify=True``: ``"name: why"`` of every source tensor not compared on
            some server (not :func:`._readback.readable`, or a server could not read
            it back), in the source's order, for the ``COMMITTED`` event (also logged);
            ``"sample"`` claims only its sample: empty.

        Raises:
            RefitVerificationError: a server holds something else than was sent
                (the server, the tensor, its bucket and first differing element named).
            TransportError, SyncTimeoutError: a read-back request failed.
        """
        readers: list[tuple[int, SGLangWeightReader]] = []
        for index, server in enumerate(self.servers):
            if isinstance(server, SGLangWeightReader):
                readers.append((index, server))
            else:
                self._warn_once(
                    index,
                    "no get_weights_by_name",
                    f"{type(server).__name__} cannot read weights back "
                    "(no get_weights_by_name: SGLangWeightReader), so verify does not check it",
                )
        buckets = {slot.name: bucket.index for bucket in self._plan for slot in bucket.slots}
        if not readers:
            if verify is not True:
                return ()
            return tuple(
                f"{name}: no server can read weights back" for name in self._manifest or {}
            )
        unread: list[dict[str, str]] = [{} for _ in self.servers]

        async def check(position: int, reader: tuple[int, SGLangWeightReader]) -> None:
            # A few requests in flight per server: each is a small answer, and one at
            # a time their round trips alone cost half a refit of a small model.
            index, server = reader
            limiter = anyio.CapacityLimiter(_READS_IN_FLIGHT)
            failures: list[Exception | None] = [None] * len(kept)

            async def one(i: int, expected: Expected) -> None:
                async with limiter:
                    try:
                        await self._check_tensor(
                            index, server, expected, verify, unread[index], verdict
                        )
                    except Exception as exc:
                        failures[i] = exc

            async with anyio.create_task_group() as tg:
                for i, expected in enumerate(kept):
                    tg.start_soon(one, i, expected)
            # The first failure in the plan's order, whatever order the answers came in.
            first = next((f for f in failures if f is not None), None)
            if first is not None:
                raise first

        async def on_readers(
            call: Callable[[int, tuple[int, SGLangWeightReader]], Awaitable[None]],
        ) -> None:
            try:
                await each_named(readers, call, lambda p: self._label(readers[p][0]))
            except RefitVerificationError as exc:
                if len(readers) > 1:
                    raise  # each_named named the server
                raise named(exc, self._label(readers[0][0])) from exc

        # verify=True: what was not compared, by name (the source's order), and why.
        skipped: dict[str, str] = {}
        if verify == "sample":
            await on_readers(check)
        else:
            # One tensor of the source at a time, read from every server.
            async for expected in self._whole_tensors(buckets, skipped):

                async def one(
                    position: int,
                    reader: tuple[int, SGLangWeightReader],
                    expected: Expected = expected,
                ) -> None:
                    index, server = reader
                    await self._check_tensor(
                        index, server, expected, verify, unread[index], verdict
                    )
                    if tally is not None and expected.name not in unread[index]:
                        tally[0] += 1

                await on_readers(one)
        for index, names in enumerate(unread):
            if names:
                name, reason = next(iter(names.items()))
                self._warn_once(
                    index,
                    "unreadable",
                    f"{len(names)} tensor(s) could not be compared through "
                    f"/get_weights_by_name and were not checked (first: {name!r}: {reason})",
                )
        if verify is not True:
            return ()
        for index, names in enumerate(unread):
            where = f" on {self._label(index)}" if len(self.servers) > 1 else ""
            for name, reason in names.items():
                skipped.setdefault(name, f"{reason}{where}")
        for index, server in enumerate(self.servers):
            if not isinstance(server, SGLangWeightReader):
                for name in self._manifest or {}:
                    skipped.setdefault(name, f"{self._label(index)} cannot read weights back")
        order = list(self._manifest or skipped)
        unverified = tuple(
            f"{name}: {skipped[name]}" for name in sorted(skipped, key=_position(order))
        )
        if unverified:
            _log.warning(
                "%s did not compare %d tensor(s) (named in %s): %s",
                "verify=True" if verdict is None else "verify_engine()",
                len(unverified),
                "the COMMITTED event's unverified" if verdict is None else "live_unverified",
                "; ".join(unverified),
            )
        return unverified

    async def _whole_tensors(
        self, buckets: Mapping[str, int], skipped: dict[str, str]
    ) -> AsyncIterator[Expected]:
        """Every :func:`._readback.readable` tensor of the source, whole, on the host;
        the others go into ``skipped`` (``{name: why}``)."""
        weights = iter(self.policy.iter_weights())
        while True:
            item = await anyio.to_thread.run_sync(next, weights, None)
            if item is None:
                return
            name, tensor = item
            if not readable(name, tuple(tensor.shape), self._read_qkv):
                skipped[name] = _unreadable_reason(name, tuple(tensor.shape))
                continue
            values = await anyio.to_thread.run_sync(_on_host, tensor)
            yield Expected(name, buckets.get(name, -1), values)

    async def _check_tensor(
        self,
        index: int,
        server: SGLangWeightReader,
        expected: Expected,
        verify: Verify,
        unread: dict[str, str],
        verdict: str | None = None,
    ) -> None:
        """Read ``expected``'s tensor back from server ``index`` (each DP rank) and compare.

        Raises:
            RefitVerificationError: it differs (the caller names the server).
        """
        truncate = expected.rows if verify == "sample" else expected.values.numel()
        answer = await server.get_weights_by_name(expected.name, truncate_size=truncate)
        if answer is None:
            unread.setdefault(expected.name, "the server cannot read it (400 or 404)")
            return
        dp = self._dp_sizes[index] if index < len(self._dp_sizes) else 1
        answers = answer if dp > 1 else [answer]
        served = self._served_dtypes[index] if index < len(self._served_dtypes) else None
        for rank, held in enumerate(answers):
            try:
                difference = await anyio.to_thread.run_sync(
                    first_difference, expected.values, held, served
                )
            except Unreadable as exc:
                unread.setdefault(expected.name, str(exc))
                continue
            if difference is None:
                continue
            dp_rank = f" (DP rank {rank})" if dp > 1 else ""
            raise RefitVerificationError(
                f"{expected.name!r} (bucket {expected.bucket}) read back through "
                f"/get_weights_by_name{dp_rank} is not what the trainer sent: {difference} "
                + (verdict or f"(verify={verify_label(verify)!r}; the version is not labelled)")
            )

    def _warn_once(self, index: int, kind: str, message: str) -> None:
        """Log a read-back gap of server ``index``: a warning the first time per server
        and ``kind``, then at debug level (it repeats every sync)."""
        url = self.servers[index].base_url
        level = logging.DEBUG if (url, kind) in self._warned else logging.WARNING
        self._warned.add((url, kind))
        _log.log(level, "%s: verify: %s", self._label(index), message)


def _position(order: Sequence[str]) -> Callable[[str], int]:
    """A sort key: a name's index in ``order`` (names outside it last)."""
    index = {name: i for i, name in enumerate(order)}
    return lambda name: index.get(name, len(index))


def _unreadable_reason(name: str, shape: tuple[int, ...]) -> str:
    """Why :func:`._readback.readable` leaves ``name`` out of the read-back."""
    if not shape or 0 in shape:
        return "a 0-d or empty tensor (SGLang's read-back slices the first dimension)"
    return (
        "SGLang's /get_weights_by_name cuts q/k/v_proj out of the fused qkv_proj with "
        "hidden_size // num_attention_heads as the head size, not this model's head_dim, "
        "so its answer is not this tensor"
    )


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the host (itself when it is there already)."""
    return tensor.detach().cpu()

"""vLLM's own weight checksums, recorded at a commit and compared later.

vLLM's workers hash every parameter of their model (``Worker.compute_weight_checksums``,
``vllm/model_executor/model_loader/weight_checksum.py``: SHA-256 of each parameter's
bytes in its dtype, copied to host memory); the server publishes the same through
``POST /weight_checker``. Both engines of this package record them when a version
commits (``record_checksums=True``) and name what changed since when asked
(:class:`~aiosync.capabilities.ChecksumVerifying`). What is compared here is the same
for both; only where the checksums come from differs.

Keys are ``"dp{d}:pp{p}:pcp{c}:tp{t}:{name}"``: the worker's data-, pipeline-,
context- and tensor-parallel ranks, then vLLM's own parameter name (fused, sharded,
post-processed: ``model.layers.0.self_attn.qkv_proj.weight``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from aiosync.errors import RefitVerificationError, TransportError

__all__ = ["RecordedChecksums", "describe_change", "merge_worker_checksums"]

# A checksum key: the worker's ranks, then vLLM's parameter name.
_CHECKSUM_KEY = re.compile(r"dp(\d+):pp(\d+):pcp(\d+):tp(\d+):(.+)")
# At most this many changed parameters are named in one error (then how many more).
_NAMED = 5


def describe_change(key: str, then: str | None, now: str | None) -> str:
    """One changed key as ``name (dp 0, pp 0, pcp 0, tp 1): what`` (``new``, ``gone``,
    or both digests' first 12 hex digits)."""
    place = key
    match = _CHECKSUM_KEY.fullmatch(key)
    if match is not None:
        dp, pp, pcp, tp, name = match.groups()
        place = f"{name} (dp {dp}, pp {pp}, pcp {pcp}, tp {tp})"
    if then is None:
        return f"{place}: new"
    if now is None:
        return f"{place}: gone"
    return f"{place}: {then[:12]}... then, {now[:12]}... now"


def merge_worker_checksums(replies: Iterable[object], source: str) -> dict[str, str]:
    """One ``{key: sha256 hex}`` of every worker's ``compute_weight_checksums()`` reply.

    Args:
        replies: one dict per worker, as vLLM's ``collective_rpc`` returns them.
        source: what answered, for the error (``"compute_weight_checksums"``).

    Raises:
        TransportError: a reply that is not ``{str: str}``, or a key two workers
            answered (two workers claiming the same ranks: the merge would hide one).
    """
    merged: dict[str, str] = {}
    for reply in replies:
        if not isinstance(reply, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in reply.items()
        ):
            raise TransportError(f"{source} answered {str(reply)[:200]}, not {{str: str}}")
        twice = merged.keys() & reply.keys()
        if twice:
            raise TransportError(f"{source}: two workers answered {sorted(twice)[:3]}")
        merged.update(reply)
    return merged


@dataclass(frozen=True)
class RecordedChecksums:
    """The checksums of every worker's parameters when ``version`` committed.

    Attributes:
        version: the synchronizer's version that committed.
        sums: ``{key: sha256 hex}`` (the module docs' keys).
    """

    version: int
    sums: Mapping[str, str]

    def compare(self, now: Mapping[str, str], where: str, source: str) -> int:
        """Compare ``now`` with the recorded checksums.

        Args:
            now: the same engine's checksums now.
            where: the engine, as the error names it (``"the vLLM server at URL"``).
            source: where the checksums come from (``"/weight_checker checksums"``).

        Returns:
            How many checksums matched (every recorded one).

        Raises:
            RefitVerificationError: a key's checksum differs, is gone or is new: how
                many, and the first five (sorted) named with their worker's ranks.
        """
        then = self.sums
        changed = sorted(k for k in then.keys() | now.keys() if then.get(k) != now.get(k))
        if changed:
            named = "; ".join(describe_change(k, then.get(k), now.get(k)) for k in changed[:_NAMED])
            more = f" (and {len(changed) - _NAMED} more)" if len(changed) > _NAMED else ""
            raise RefitVerificationError(
                f"{where}: {len(changed)} parameter(s) changed since the commit of version "
                f"{self.version} ({source}): {named}{more}"
            )
        return len(then)

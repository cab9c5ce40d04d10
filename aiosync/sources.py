"""The trainer's side of a refit: the source every transport reads, and its optional checks.

A :class:`RefitSource` yields the trainer's weights as the model's HF state dict;
:class:`GathersInto`, :class:`Preflight`, :class:`ConfigSource` and
:class:`DraftNaming` are what a source may also do, each a runtime-checkable
Protocol. See ``docs/refit.md``; draft (MTP, EAGLE) tensors: ``docs/draft.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .capabilities import DRAFT_REFITS, DraftHolding, DraftRefit, engines_of
from .errors import RefitMismatchError, UnsupportedOptionError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ConfigSource",
    "DraftNaming",
    "GathersInto",
    "Preflight",
    "RefitManifest",
    "RefitSource",
    "apply_draft_option",
    "draft_under",
    "with_draft",
    "without_draft",
]

#: ``{hf_name: (shape, dtype)}`` in the order the source yields the tensors.
RefitManifest = dict[str, tuple[tuple[int, ...], "torch.dtype"]]


@runtime_checkable
class RefitSource(Protocol):
    """The trainer's side of every transport: its weights as the HF state dict.

    Names and shapes are those of the model's HF safetensors checkpoint (what
    ``save_pretrained`` writes and what the engine's ``load_weights`` takes),
    not the trainer's in-memory layout. Implementations: ``aiosync.refit.DTensorRefitSource``
    (torch, DTensor/FSDP2) and ``aiosync.refit.NNXRefitSource`` (JAX/flax NNX).
    Subclass this protocol explicitly to inherit the no-op offload hooks.
    """

    def prepare_refit_info(self) -> RefitManifest:
        """Return ``{hf_name: (shape, dtype)}``, ordered, identical on every rank."""
        ...

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield full, unsharded tensors in exactly the manifest's order, shape and dtype.

        On a sharded trainer every rank must iterate (gathers are collectives);
        only the source rank's tensors are sent.
        """
        ...

    def offload_before_refit(self) -> None:
        """Colocated only: free device memory (optimizer state) before the refit."""
        return None

    def offload_after_refit(self) -> None:
        """Colocated only: undo :meth:`offload_before_refit` after the refit, even on failure."""
        return None


@runtime_checkable
class GathersInto(Protocol):
    """A refit source that gathers a sharded tensor straight into memory the transport
    offers (``DTensorRefitSource`` does): the IPC sender offers its bucket's slot, so
    the gather is the trainer's only copy of those bytes."""

    def iter_weights_into(
        self, destination: Callable[[str], torch.Tensor | None]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`RefitSource.iter_weights`, except that a gathered tensor may be written
        into ``destination(hf_name)``: a contiguous tensor of the manifest's shape and
        dtype (called in the consumer's thread just before the gather), or None, when
        the source allocates as ``iter_weights`` does. A yielded tensor that is that
        destination holds the tensor's bytes already. Every rank gathers alike whatever
        its destination answers: the collectives stay matched."""
        ...


@runtime_checkable
class Preflight(Protocol):
    """A refit source that can tell, moving nothing, that a sync of it would be wrong
    (``DTensorRefitSource``: a tie the manifest relies on was broken, case C37).

    ``sync_weights`` calls :meth:`preflight` before it pauses the engine or moves a
    byte, so a refused sync leaves every engine exactly as it was. A sharded trainer's
    ranks run the same check at the start of their streams instead, where their
    votes keep them agreed."""

    def preflight(self) -> None:
        """Raise if a sync of this source must not start.

        Raises:
            RefitMismatchError: the source no longer matches its manifest.
        """
        ...


@runtime_checkable
class ConfigSource(Protocol):
    """A refit source that knows its model's HF config (``DTensorRefitSource`` does):
    the transports compare it with each engine's at init."""

    def hf_config(self) -> Any | None:
        """The trainer's HF config (a ``PretrainedConfig`` or its dict); None: unknown."""
        ...


@runtime_checkable
class DraftNaming(Protocol):
    """A refit source that says which of its tensors are a speculative-decoding draft
    model's (an MTP module, an EAGLE head): :func:`with_draft` and :func:`draft_under`
    give one. ``SyncOptions(draft="frozen")`` leaves exactly these out."""

    def draft_names(self) -> frozenset[str]:
        """The manifest's names that are the draft's (a subset of its keys)."""
        ...


class _Wrapped(RefitSource):
    """A source around other sources: their offload hooks, preflight and config pass through."""

    # The names prepare_refit_info() singled out (drafted, or left out); None: not yet read.
    _names: frozenset[str] | None = None

    def __init__(self, *inner: RefitSource) -> None:
        self._inner = inner

    def _prepared_names(self) -> frozenset[str]:
        """:attr:`_names`, reading the manifest first if it was not read yet."""
        if self._names is None:
            self.prepare_refit_info()
        assert self._names is not None
        return self._names

    def offload_before_refit(self) -> None:
        for source in self._inner:
            hook = getattr(source, "offload_before_refit", None)
            if hook is not None:
                hook()

    def offload_after_refit(self) -> None:
        # Every inner source is restored, even when one of them fails.
        errors: list[BaseException] = []
        for source in self._inner:
            hook = getattr(source, "offload_after_refit", None)
            try:
                if hook is not None:
                    hook()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def preflight(self) -> None:
        """Each inner source's own :class:`Preflight`, in order."""
        for source in self._inner:
            if isinstance(source, Preflight):
                source.preflight()

    def hf_config(self) -> Any | None:
        """The first (target) source's HF config (:class:`ConfigSource`); None: unknown."""
        first = self._inner[0]
        return first.hf_config() if isinstance(first, ConfigSource) else None


class _WithDraft(_Wrapped):
    """:func:`with_draft`'s source."""

    def __init__(self, target: RefitSource, draft: RefitSource, prefix: str) -> None:
        super().__init__(target, draft)
        self.target = target
        self.draft = draft
        self.prefix = prefix

    def prepare_refit_info(self) -> RefitManifest:
        manifest = dict(self.target.prepare_refit_info())
        drafted = {f"{self.prefix}{n}": spec for n, spec in self.draft.prepare_refit_info().items()}
        clash = [name for name in drafted if name in manifest]
        if clash:
            raise RefitMismatchError(
                f"with_draft(prefix={self.prefix!r}): the draft's {clash[0]!r} is also a "
                f"target tensor ({len(clash)} such names); choose a prefix no target name has"
            )
        self._names = frozenset(drafted)
        manifest.update(drafted)
        return manifest

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.target.iter_weights()
        for name, tensor in self.draft.iter_weights():
            yield f"{self.prefix}{name}", tensor

    def draft_names(self) -> frozenset[str]:
        return self._prepared_names()


def with_draft(target: RefitSource, draft: RefitSource, *, prefix: str) -> RefitSource:
    """One source of a target model and its draft model (an EAGLE head trained as a
    model of its own): the target's tensors, then the draft's under ``prefix``.

    The manifest is the target's followed by the draft's, each draft name
    ``prefix + name`` (the engine's :attr:`~aiosync.capabilities.DraftHolding.draft_prefix`
    names them so), shapes and dtypes as the draft source gives them; the result is a
    :class:`DraftNaming` (those names are the draft's). Offload hooks, :class:`Preflight`
    and the target's :class:`ConfigSource` pass through.

    Args:
        target: the policy's source (its names are the target checkpoint's).
        draft: the draft model's source (its names are its own checkpoint's).
        prefix: what the engine puts before the draft's names (``"mtp."``,
            ``"draft."``); not empty.

    Raises:
        ValueError: an empty ``prefix``, or a source that is not a RefitSource
            (TypeError), here; RefitMismatchError from ``prepare_refit_info()``
            when a prefixed draft name is also a target name.
    """
    _check_source("target", target)
    _check_source("draft", draft)
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"prefix must be a non-empty string, got {prefix!r}")
    return _WithDraft(target, draft, prefix)


class _Prefixed(_Wrapped):
    """A source around one source, with the name prefixes that single out its draft."""

    def __init__(self, source: RefitSource, prefixes: tuple[str, ...]) -> None:
        super().__init__(source)
        self.source = source
        self.prefixes = prefixes


class _DraftUnder(_Prefixed):
    """:func:`draft_under`'s source."""

    def prepare_refit_info(self) -> RefitManifest:
        manifest = self.source.prepare_refit_info()
        self._names = frozenset(n for n in manifest if n.startswith(self.prefixes))
        return manifest

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.source.iter_weights()

    def draft_names(self) -> frozenset[str]:
        return self._prepared_names()


def draft_under(source: RefitSource, prefix: str | Iterable[str] = "mtp.") -> RefitSource:
    """``source`` as it is, its tensors under ``prefix`` named as the draft's: a
    checkpoint that holds its MTP layers beside the target's (Qwen3-Next's ``mtp.*``:
    ``mtp.fc``, ``mtp.norm``, ``mtp.pre_fc_norm_{embedding,hidden}``, ``mtp.layers.0.*``).

    Returns a :class:`DraftNaming` source with the same manifest, order and tensors.

    Raises:
        ValueError: an empty prefix; TypeError: ``source`` is not a RefitSource.
    """
    _check_source("source", source)
    prefixes = (prefix,) if isinstance(prefix, str) else tuple(prefix)
    if not prefixes or not all(isinstance(p, str) and p for p in prefixes):
        raise ValueError(f"prefix must be non-empty strings, got {prefix!r}")
    return _DraftUnder(source, prefixes)


class _WithoutDraft(_Prefixed):
    """:func:`without_draft`'s source."""

    def _draft(self, manifest: RefitManifest) -> frozenset[str]:
        named = self.source.draft_names() if isinstance(self.source, DraftNaming) else frozenset()
        under = {n for n in manifest if self.prefixes and n.startswith(self.prefixes)}
        return frozenset(named | under)

    def prepare_refit_info(self) -> RefitManifest:
        manifest = self.source.prepare_refit_info()
        self._names = left_out = self._draft(manifest)
        return {n: spec for n, spec in manifest.items() if n not in left_out}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        left_out = self._prepared_names()
        # The inner source still runs whole: on a sharded trainer its gathers are
        # collectives every rank must take, whatever is sent of them.
        for name, tensor in self.source.iter_weights():
            if name not in left_out:
                yield name, tensor

    @property
    def left_out(self) -> frozenset[str]:
        """The draft names left out (after ``prepare_refit_info()``; empty before)."""
        return self._names or frozenset()

    def draft_names(self) -> frozenset[str]:
        """None of its tensors is the draft's."""
        return frozenset()


def without_draft(source: RefitSource, prefixes: Iterable[str] = ()) -> RefitSource:
    """``source`` without its draft tensors: those it names (:class:`DraftNaming`) and
    those under ``prefixes``. What ``SyncOptions(draft="frozen")`` sends."""
    _check_source("source", source)
    return _WithoutDraft(source, tuple(p for p in prefixes if p))


def apply_draft_option(
    policy: RefitSource, generation: Any, draft: DraftRefit | None
) -> RefitSource:
    """Apply ``SyncOptions(draft=...)``: tell each engine what later syncs load and
    return the source they send. Called by the factory before the transport is
    built; a synchronizer built directly takes the source this returns.

    * ``None``: nothing changes (the engines' defaults).
    * ``"with_target"``: every engine must be a :class:`~aiosync.capabilities.DraftHolding`
      holding a draft; each is told so, and ``policy`` is returned as it is (it must
      name the draft's tensors as the engine does; the transports compare manifests
      at init, before any byte moves).
    * ``"frozen"``: each draft-holding engine is told so; the source returned leaves
      out the draft's tensors (those ``policy`` names, :class:`DraftNaming`, and those
      under each engine's ``draft_prefix``). An engine that holds no draft, or does
      not say (a vLLM engine: its updates load the target model alone), is fine.

    Args:
        policy: the trainer's source.
        generation: the engine, a fleet or a list of engines; None on a trainer
            rank without one (only the source is changed there).
        draft: the option.

    Raises:
        ValueError: an unknown ``draft``.
        UnsupportedOptionError: ``"with_target"`` with an engine that holds no draft
            or cannot say (named).
    """
    if draft is None:
        return policy
    if draft not in DRAFT_REFITS:
        raise ValueError(
            f"draft must be one of {', '.join(map(repr, DRAFT_REFITS))}, got {draft!r}"
        )
    engines = () if generation is None else engines_of(generation)
    holding = [e for e in engines if isinstance(e, DraftHolding) and e.draft_prefix is not None]
    if draft == "with_target":
        lacking = [e for e in engines if e not in holding]
        if lacking:
            raise UnsupportedOptionError(
                f"draft='with_target': {type(lacking[0]).__name__} holds no draft model it "
                "can refit (see docs/draft.md); pass draft='frozen' or leave draft unset"
            )
    for engine in holding:
        engine.select_draft_refit(draft)
    if draft == "with_target":
        return policy
    prefixes = sorted({e.draft_prefix for e in holding if e.draft_prefix})
    return without_draft(policy, prefixes)


def _check_source(what: str, source: object) -> None:
    # Duck-typed as the transports read a source: the two methods every one has.
    if not all(callable(getattr(source, m, None)) for m in ("prepare_refit_info", "iter_weights")):
        raise TypeError(f"{what} must be a RefitSource, got {type(source).__name__}")

"""``generate()`` derived once from an engine's ``generate_with_meta`` (token ids only)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from aiosync.generation import SamplingParams

if TYPE_CHECKING:
    from aiosync.generation import Generation

__all__ = ["GenerateFromMeta"]


class GenerateFromMeta:
    """Mixin: ``generate(prompts, params=None, **keywords)`` is ``generate_with_meta``'s
    token ids, so an engine writes one generation method and one signature.

    ``generate_defaults``: the :class:`~aiosync.SamplingParams` a ``generate``
    call starts from when it passes no ``params`` (keywords override its fields);
    None: the caller gives ``max_new_tokens`` (or ``params``) as for
    ``generate_with_meta``.
    """

    generate_defaults: ClassVar[SamplingParams | None] = None

    if TYPE_CHECKING:

        async def generate_with_meta(
            self,
            prompts: Sequence[Sequence[int]],
            params: SamplingParams | None = None,
            **keywords: Any,
        ) -> list[Generation]: ...

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        **keywords: Any,
    ) -> list[list[int]]:
        """The new token ids of each prompt, in prompt order (see ``generate_with_meta``
        for the arguments, engine-specific keywords such as ``timeout_s`` and the errors).
        """
        if params is None:
            params = self.generate_defaults
        generations = await self.generate_with_meta(prompts, params, **keywords)
        return [list(g.token_ids) for g in generations]

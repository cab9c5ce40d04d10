"""Colocated SGLang: refit through the server's ``/update_weights_from_tensor``.

- :mod:`.synchronizer` — the trainer side, :class:`HTTPWeightSynchronizer`.
- :mod:`.server` — :class:`SGLangServer`, the server contract the synchronizer
  drives (``aiosync.SGLangHTTPBackend`` satisfies it), and the optional
  :class:`SGLangManifestSource` (the manifest checked at ``init_communicator()``)
  and :class:`SGLangWeightUpdateSession` (SGLang's begin/end weight-update session)
  and :class:`SGLangWeightReader` (``/get_weights_by_name``, the ``verify`` read-back)
  and :class:`SGLangWeightChecker` (``/weights_checker``, ``verify_engine()``'s checksums);
  :class:`SGLangDistributedServer`, a server that receives over a process group
  (:class:`aiosync.transports.collective.SGLangCollectiveWeightSynchronizer`).
- The engine side is SGLang itself; a server that imitates it decodes each
  payload with :func:`decode_flattened_bucket` (``load_format=FLATTENED_BUCKET``),
  as the SGLang-contract test server does. CPU payloads name a ``/dev/shm``
  file the synchronizer owns and unlinks once the server answered (or the post
  failed): no torch helper process, no process-wide setting.
  :func:`use_file_system_sharing` is only for code that exchanges torch's own
  CPU reductions (SGLang's ``FlattenedTensorBucket`` senders).
"""

from . import server
from ._wire import FLATTENED_BUCKET, decode_flattened_bucket, use_file_system_sharing
from .server import SGLangDistributedServer as SGLangDistributedServer
from .server import SGLangManifestSource as SGLangManifestSource
from .server import SGLangServer as SGLangServer
from .server import SGLangWeightChecker as SGLangWeightChecker
from .server import SGLangWeightReader as SGLangWeightReader
from .server import SGLangWeightUpdateSession as SGLangWeightUpdateSession
from .synchronizer import HTTPWeightSynchronizer

__all__ = [
    "FLATTENED_BUCKET",
    "HTTPWeightSynchronizer",
    "decode_flattened_bucket",
    "use_file_system_sharing",
    *server.__all__,
]

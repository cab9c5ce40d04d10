"""Thread-safety of the torch refit stream."""

from __future__ import annotations

import torch

from aiosync.refit import DTensorRefitSource


def test_iter_weights_leaves_grad_mode_on_in_the_consuming_thread():
    # A transport may advance the generator from a worker thread; grad mode is
    # thread-local, so a no_grad held across the yield would leak into it.
    import threading

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    source = DTensorRefitSource(model)
    stream = source.iter_weights()
    seen: list[bool] = []

    def consume() -> None:
        name, tensor = next(stream)
        seen.extend([name == "0.weight", tensor.requires_grad, torch.is_grad_enabled()])

    t = threading.Thread(target=consume)
    t.start()
    t.join()
    assert seen == [True, False, True]
    stream.close()

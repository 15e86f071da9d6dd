"""Per-layer recurrent state inside Hugging Face's own cache object.

``generate`` builds a ``DynamicCache`` by itself. The first time a linearized layer sees it, it
swaps that layer's slot for a ``StateLayer``: the layer's op states (recurrent state, window,
sinks' nothing, delta history), a count of tokens seen, and no growing key/value tensors. HF's
bookkeeping (``get_seq_length``, mask sizes, beam reordering, batch expansion) goes through the
methods below, so ``model.generate`` works unchanged. Kept softmax layers keep HF's own layers.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def _map_tensors(obj: Any, fn) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def iter_tensors(obj: Any):
    """Every tensor reachable from a state (for memory accounting)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from iter_tensors(v)


class StateLayer(CacheLayerMixin):
    """One linearized layer's slot in an HF cache: op states + tokens seen, constant size."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self):
        super().__init__()
        self.state: dict | None = None
        self.seen = 0

    def lazy_initialization(self, *args, **kwargs) -> None:  # nothing to pre-allocate
        pass

    def update(self, *args, **kwargs):
        raise RuntimeError("a linearized layer keeps no key/value cache; its state is set by the layer itself")

    def set_state(self, state: dict, new_tokens: int) -> None:
        self.state = state
        self.seen += new_tokens
        self.is_initialized = True

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def get_mask_sizes(self, query, *args, **kwargs) -> tuple[int, int]:
        # transformers 5.x passes either the query length or the cache positions
        q_len = query.shape[0] if isinstance(query, torch.Tensor) else int(query)
        return self.seen + q_len, 0

    def reset(self) -> None:
        self.state, self.seen, self.is_initialized = None, 0, False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.state = _map_tensors(self.state, lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.state = _map_tensors(self.state, lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.state = _map_tensors(self.state, lambda t: t[indices])

    def crop(self, max_length: int) -> None:
        raise ValueError("a linearized layer's recurrent state cannot be cropped (assisted decoding and "
                         "cache cropping need a key/value cache); generate without an assistant model")

    def offload(self):
        pass

    def prefetch(self):
        pass


def state_layer(cache: Cache, layer_idx: int) -> StateLayer:
    """This layer's ``StateLayer`` in ``cache``, installed on first use."""
    layers = cache.layers
    while len(layers) <= layer_idx:  # caches built without a config grow lazily
        layers.append(StateLayer())
    if not isinstance(layers[layer_idx], StateLayer):
        layers[layer_idx] = StateLayer()
    return layers[layer_idx]


def cache_bytes(cache: Cache) -> dict[str, int]:
    """Bytes held by a cache: ``linear`` (state layers) and ``softmax`` (HF key/value layers)."""
    out = {"linear": 0, "softmax": 0}
    for layer in cache.layers:
        if isinstance(layer, StateLayer):
            out["linear"] += sum(t.numel() * t.element_size() for t in iter_tensors(layer.state))
        else:  # keys, values and whatever else the layer holds (a sliding layer's window tensor)
            out["softmax"] += sum(t.numel() * t.element_size() for t in iter_tensors(vars(layer)))
    return out

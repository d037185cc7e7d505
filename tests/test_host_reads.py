"""How often the diffusion engine reads the device per forward: on a GPU each read (`.tolist()`,
`int(t)`, `bool(t)`, `nonzero`, a boolean-mask index) waits for every queued kernel, so the step
loop keeps them few (docs/engines-diffusion.md, "On a GPU"). Counted on the CPU with a
TorchFunctionMode, which sees the same calls."""

from __future__ import annotations

import collections
import traceback

import torch
from torch.overrides import TorchFunctionMode

from nowait.engines.base import GenerationRequest, SamplingParams
from nowait.engines.config import DiffusionEngineConfig
from nowait.engines.diffusion.cache import forward_spans
from nowait.engines.factory import ModelCache, build_engine
from nowait.extraction.corpus import documents
from nowait.model.kv_cache import KVCache
from nowait.tokenizer import document_prompt

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
         torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero}


class HostReads(TorchFunctionMode):
    """Counts the calls that copy a tensor's values to the host, by the function of nowait that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        reads = func in READS
        if func is torch.Tensor.__getitem__ and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            reads = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
        if reads:
            ours = [f for f in traceback.extract_stack()[:-1] if "/nowait/" in f.filename]
            self.sites[f"{ours[-1].filename.rsplit('/nowait/', 1)[-1]}:{ours[-1].name}" if ours else "?"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.sites.values())


def test_a_span_forward_at_known_positions_reads_only_the_cache_length():
    loaded = ModelCache().load("diffusion")
    model = loaded.model
    cache = KVCache(model.config, 1, 64)
    forward_spans(model, [torch.arange(3, 19)], [0], 0, cache, write=True)  # a cached prompt of 16
    cache.lengths[0] = 16
    with HostReads() as reads:
        forward_spans(model, [torch.arange(5, 13)], [16], 0, cache, write=False,
                      outputs=torch.tensor([[0, 3]]))
    # The one-row path still reads the cache's length once (`_cache_mask`); the rotary table's
    # size comes from the host's starts (`positions_end`), not from the positions tensor.
    assert reads.sites == {"model/transformer.py:_cache_mask": 1}, reads.sites


def test_the_fast_default_reads_the_device_about_six_times_a_forward():
    built = build_engine(DiffusionEngineConfig(kind="diffusion"), ModelCache())
    engine, codec, model = built.engine, built.codec, built.target.model
    docs = documents("test", 3)
    request = lambda doc: GenerationRequest(codec.encode(document_prompt(doc)), SamplingParams(max_tokens=256))  # noqa: E731
    engine.generate([request(docs[0])])  # first use: allocations and lazy tables outside the count
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    with HostReads() as reads:
        for doc in docs[1:]:
            engine.generate([request(doc)])
    per_forward = reads.total / len(forwards)
    # 12 before issue 24's folds, 7 after them, 6 with the rotary table's size from the host.
    assert per_forward <= 6.5, (per_forward, reads.sites.most_common(8))

"""The runner: per-sequence tensors and the execution of one ``StepBatch``.

Per sequence: its own KV cache (prompt + committed blocks), canvas, self-conditioning logits,
stability history, step count and random generator, freed when it leaves. Nothing is
preallocated per ``max_batch``. Per step: ONE batched encoder pass (prefills and commits, each
row with its own mask into its own cache), then ONE batched decoder forward over every row
being denoised: a left-padded K/V view of the rows' caches (built once per block and sliced as
rows leave), per-row positions, self-conditioning zeros + mask for rows on their first step,
and row-wise attention (``attention.py``). Each step's random draws are made in a second
thread while the forward runs (they depend only on each row's generator).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from diffusion_plugin.attention import ROWS
from diffusion_plugin.batch import RowOutput, StepBatch, StepOutput
from diffusion_plugin.request import Sequence


@dataclass
class _Row:
    seq: Sequence
    cache: object
    generator: torch.Generator
    pending: torch.Tensor  # tokens to encode before the next block (prompt, then the last block)
    cur_len: int = 0  # tokens in the cache
    canvas: torch.Tensor | None = None
    sc_logits: torch.Tensor | None = None
    history: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    version: int = 0  # bumped when the cache changes
    images: object | None = None  # this sequence's own image features, until its prompt pass


class _LayerView:
    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values


class _CacheView:
    """What the decoder reads: ``layers[i].keys/values`` (left-padded), never written."""

    is_compileable = False

    def __init__(self, layers: list[_LayerView]):
        self.layers = layers


class Runner:
    def __init__(self, adapter):
        self.adapter = adapter
        self.rows: dict[str, _Row] = {}
        self._view_key: tuple | None = None
        self._view: tuple[_CacheView, dict[int, list[int]]] | None = None
        # Random draws do not depend on the forward: a second thread makes them meanwhile.
        self._noise_pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-noise")

    def admit(self, seq: Sequence) -> None:
        gen = torch.Generator(device=self.adapter.device).manual_seed(seq.params.seed)
        pending = torch.tensor([seq.prompt_ids], dtype=torch.long, device=self.adapter.device)
        self.rows[seq.seq_id] = _Row(seq=seq, cache=self.adapter.new_cache(), generator=gen, pending=pending,
                                     images=seq.images)

    def free(self, seq_id: str) -> None:
        self.rows.pop(seq_id, None)  # a cached K/V view still holding it is sliced, not reused whole

    def reset(self) -> None:
        """After a failed batch: drop every sequence's state."""
        self.rows.clear()
        self._view_key, self._view = None, None

    @torch.no_grad()
    def execute(self, batch: StepBatch, seqs: dict[str, Sequence]) -> StepOutput:
        t0 = time.perf_counter()
        for seq_id in batch.free:
            self.free(seq_id)
        for seq_id in batch.admit:
            self.admit(seqs[seq_id])
        forward_s = 0.0
        C = self.adapter.canvas_length
        # 1. One batched encoder pass (prefills and commits) writes each sequence's cache,
        #    then each draws its new canvas.
        encoding = [self.rows[s] for s in batch.encode]
        if encoding:
            t = time.perf_counter()
            images = [r.images for r in encoding]
            self.adapter.encode([r.cache for r in encoding], [r.pending for r in encoding],
                                [r.cur_len for r in encoding], images if any(i is not None for i in images) else None)
            forward_s += time.perf_counter() - t
        for row in encoding:
            row.images = row.seq.images = None  # in the cache now: the features are freed
            row.cur_len += row.pending.shape[1]
            row.version += 1
            row.canvas = self.adapter.init_canvas(row.generator)
            row.sc_logits, row.history = None, None
        out = StepOutput()
        if batch.denoise:
            rows = [self.rows[s] for s in batch.denoise]
            view, lengths = self._kv_view(rows)
            canvas = torch.cat([r.canvas for r in rows])
            positions = torch.stack([torch.arange(r.cur_len, r.cur_len + C, dtype=torch.int32) for r in rows])
            sc_logits, sc_mask = self._self_conditioning(rows)
            noise = self._noise_pool.submit(self.adapter.draw_noise, [r.generator for r in rows])
            t = time.perf_counter()
            token = ROWS.set(lengths)
            try:
                logits = self.adapter.decode(canvas, view, positions, sc_logits, sc_mask)
                forward_s += time.perf_counter() - t
            finally:
                ROWS.reset(token)
                draws = noise.result()  # always joined: a row's generator is never used twice at once
            params = [r.seq.params for r in rows]
            steps_left = [r.seq.params.max_denoising_steps - r.seq.step for r in rows]
            processed, new_canvas, argmax, entropy = self.adapter.sample(logits, canvas, params, steps_left, draws)
            mean_entropy = entropy.mean(-1)
            for b, row in enumerate(rows):
                p = row.seq.params
                row.canvas = new_canvas[b:b + 1]
                row.argmax = argmax[b:b + 1]
                row.sc_logits = processed[b:b + 1]
                stable, row.history = self.adapter.is_stable(row.history, row.argmax, p.stability_threshold)
                confident = bool(mean_entropy[b] < p.confidence_threshold)
                done = (stable and confident) or steps_left[b] <= 1
                tokens = row.argmax[0].tolist()
                if done:
                    row.pending = row.argmax  # the commit pass encodes the argmax canvas
                out.rows.append(RowOutput(seq_id=row.seq.seq_id, block_done=done,
                                          committed=tokens if done else None,
                                          preview=tokens if p.previews else None))
        out.forward_s = forward_s
        out.step_s = time.perf_counter() - t0
        return out

    def _self_conditioning(self, rows: list[_Row]):
        if all(r.sc_logits is None for r in rows):
            return None, None
        if all(r.sc_logits is not None for r in rows):
            return torch.cat([r.sc_logits for r in rows]), None
        shape = next(r.sc_logits for r in rows if r.sc_logits is not None).shape
        logits = torch.cat([r.sc_logits if r.sc_logits is not None else torch.zeros(shape) for r in rows])
        mask = torch.tensor([r.sc_logits is not None for r in rows])
        return logits, mask

    def _kv_view(self, rows: list[_Row]):
        """Left-padded K/V per layer for these rows, plus each row's valid key count per layer."""
        key = (tuple(r.seq.seq_id for r in rows), tuple(r.version for r in rows))
        if self._view_key == key:
            return self._view
        if self._view_key is not None and self._can_slice(key):
            view, lengths = self._slice(key)
        else:
            view, lengths = self._build(rows)
        self._view_key, self._view = key, (view, lengths)
        return view, lengths

    def _can_slice(self, key) -> bool:
        old = dict(zip(*self._view_key, strict=True))
        return all(old.get(s) == v for s, v in zip(*key, strict=True))

    def _slice(self, key):
        old_ids = list(self._view_key[0])
        index = torch.tensor([old_ids.index(s) for s in key[0]])
        view, lengths = self._view
        layers = [_LayerView(layer.keys.index_select(0, index), layer.values.index_select(0, index))
                  for layer in view.layers]
        C = self.adapter.canvas_length
        new_lengths = {i: [lengths[i][j] for j in index.tolist()] for i in lengths}
        # Keys padded for rows that left stay masked; trim the left padding no row needs.
        for i, layer in enumerate(layers):
            need = max(new_lengths[i]) - C
            if need < layer.keys.shape[2]:
                layers[i] = _LayerView(layer.keys[:, :, layer.keys.shape[2] - need:],
                                       layer.values[:, :, layer.values.shape[2] - need:])
        return _CacheView(layers), new_lengths

    def _build(self, rows: list[_Row]):
        C = self.adapter.canvas_length
        layers, lengths = [], {}
        num_layers = len(rows[0].cache.layers)
        for i in range(num_layers):
            ks = [r.cache.layers[i].keys for r in rows]
            vs = [r.cache.layers[i].values for r in rows]
            longest = max(k.shape[2] for k in ks)
            layers.append(_LayerView(_left_pad(ks, longest), _left_pad(vs, longest)))
            lengths[i] = [k.shape[2] + C for k in ks]
        return _CacheView(layers), lengths


def _left_pad(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    out = tensors[0].new_zeros((len(tensors), tensors[0].shape[1], length, tensors[0].shape[3]))
    for b, t in enumerate(tensors):
        out[b, :, length - t.shape[2]:] = t[0]
    return out

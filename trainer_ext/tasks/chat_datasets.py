"""The causal-LM recipe's datasets: each split's file read, checked and tokenized once per machine into the tokenized
data cache (data/cache.py) and memory-mapped by every rank (samples, or packed rows), or, with --streaming, the
training file read, tokenized and packed on the fly (nothing written; any size)."""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..data.cache import Entry, file_fingerprint, local_entry, on_each_machine
from ..data.packing import PackedRows, best_fit_decreasing, packed_row
from ..data.tokens import TokenTable, TokenWriter
from .chat_data import ChatFile, Encoder

BATCH_ROWS = 512  # rows tokenized together when the cache is built
STREAM_PACKING_ROWS = 1000  # rows packed together in a stream (TRL packs an iterable dataset's batches of 1000 too)


@dataclass
class Split:
    """One split ready to train or evaluate on: the dataset, and what its tokenization found."""

    dataset: object
    samples: int  # tokenized samples (before packing)
    manifest: dict


def tokenizer_fingerprint(tokenizer) -> str:
    """Everything of a tokenizer that decides the ids and labels it gives (not its padding)."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    if tokenizer.is_fast:
        digest.update(tokenizer.backend_tokenizer.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps([sorted(tokenizer.all_special_ids), tokenizer.eos_token_id,
                              getattr(tokenizer, "split_special_tokens", False)]).encode())
    return digest.hexdigest()


def cached_split(split: str, source: ChatFile, encoder: Encoder, root: Path, training_args, data_args,
                 limit: int | None, packing: bool) -> Split:
    """The split's samples from the cache (built first when it is not there), on every rank."""
    def prepare() -> Entry:
        key = {"file": file_fingerprint(source.path), "format": source.format, "columns": source.columns.mapping,
               "tokenizer": tokenizer_fingerprint(encoder.tokenizer),
               "template": encoder.template and hashlib.sha256(encoder.template.encode()).hexdigest(),
               "max_seq_length": encoder.max_length, "completion_only": encoder.completion_only,
               "packing": packing, "limit": limit}
        progress = not training_args.disable_tqdm
        entry = local_entry(root, key, lambda folder: build(
            folder, split, source, encoder, limit, packing, data_args.preprocessing_num_workers, progress),
            overwrite=data_args.overwrite_cache, say=lambda line: print(f"trainer_ext: {line}", flush=True))
        manifest = entry.manifest
        if entry.reused:
            print(f"trainer_ext: {split}: the tokenized data of {source.path} ({manifest['samples']:,} samples) comes "
                  f"from the cache {entry.folder} (--overwrite_cache tokenizes again)", flush=True)
        else:
            seconds = max(manifest["tokenize_seconds"], 1e-3)
            rows = f"{manifest['rows']:,} row{'s' if manifest['rows'] != 1 else ''}"
            print(f"trainer_ext: {split}: {rows} of {source.path} read and tokenized in "
                  f"{seconds:.1f} s ({manifest['rows'] / seconds:,.0f} rows/s)"
                  + (f", packed in {manifest['pack_seconds']:.1f} s" if packing else "")
                  + f"; written to the cache {entry.folder}", flush=True)
        return entry

    entry = on_each_machine(training_args, prepare, f"tokenizes {source.path} (or finds it in the cache)")
    samples = TokenTable(entry.folder / "samples.arrow")
    if packing:
        order, starts = (np.load(entry.folder / f"{name}.npy", mmap_mode="r") for name in ("order", "starts"))
        return Split(PackedRows(samples, order, starts), len(samples), entry.manifest)
    return Split(samples.dataset(), len(samples), entry.manifest)


def build(folder: Path, split: str, source: ChatFile, encoder: Encoder, limit, packing: bool, workers,
          progress: bool) -> dict:
    """Every row read and checked, the first `limit` tokenized into folder/samples.arrow, and with `packing` the
    rows' layout (order.npy, starts.npy: row r holds samples order[starts[r]:starts[r + 1]]); returns the counts."""
    from tqdm.auto import tqdm

    started = time.time()
    writer = TokenWriter(folder / "samples.arrow")
    counts = {"rows": 0, "truncated": 0, "lost": 0}
    bars = {"disable": not progress, "delay": 2, "leave": False}  # a bar only for what takes a while
    with tqdm(total=source.size, unit="B", unit_scale=True, desc=f"read and tokenize {split}", **bars) as bar:
        for rows, encoded in encoded_batches(row_batches(source, limit, bar), encoder, workers):
            writer.write(encoded.input_ids, encoded.labels, encoded.lengths)
            counts["rows"] += len(rows)
            counts["truncated"] += encoded.truncated
            counts["lost"] += encoded.lost
    writer.close()
    counts.update(samples=writer.samples, tokens=writer.tokens, tokenize_seconds=round(time.time() - started, 2),
                  source=source.path, format=source.format)
    if packing:
        started = time.time()
        lengths = TokenTable(folder / "samples.arrow").lengths()
        with tqdm(total=len(lengths), unit=" samples", desc=f"pack {split}", **bars) as bar:
            order, starts = best_fit_decreasing(lengths, encoder.max_length, lambda done: bar.update(done - bar.n))
        np.save(folder / "order.npy", order)
        np.save(folder / "starts.npy", starts)
        counts.update(packed_rows=len(starts) - 1, pack_seconds=round(time.time() - started, 2))
    return counts


def row_batches(source: ChatFile, limit: int | None, bar=None):
    """The file's first `limit` rows in batches; the rows after them are read and checked too (the whole file is
    the user's to fix before training), not tokenized."""
    batch, taken, position, size = [], 0, 0, BATCH_ROWS
    for r in source.rows():
        if limit is None or taken < limit:
            batch.append(r)
            taken += 1
        if bar is not None and r.end - position > 1 << 20:
            bar.update(r.end - position)
            position = r.end
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
    if bar is not None:
        bar.update(source.size - position)


_WORKER_ENCODER = None


def _encode_in_worker(rows):
    return _WORKER_ENCODER(rows)


def _set_worker_encoder(encoder):
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder


def encoded_batches(batches, encoder: Encoder, workers: int | None):
    """(rows, encoded) per batch, in order: here, or with --preprocessing_num_workers N in N processes (at most 2N
    batches in flight, so memory stays flat however large the file). Here, a thread reads, checks and renders the next
    batch (Python) while the tokenizer, which releases the GIL, works on this one."""
    if not workers or workers < 2:
        from concurrent.futures import ThreadPoolExecutor

        batches = iter(batches)

        def rendered():
            rows = next(batches, None)
            return None if rows is None else (rows, encoder.render(rows))

        with ThreadPoolExecutor(1) as ahead:
            pending = ahead.submit(rendered)
            while (done := pending.result()) is not None:
                pending = ahead.submit(rendered)
                yield done[0], encoder(*done)
        return
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(workers, _set_worker_encoder, (encoder,)) as pool:
        pending = deque()
        for rows in batches:
            pending.append((rows, pool.apply_async(_encode_in_worker, (rows,))))
            if len(pending) >= 2 * workers:
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()


class ChatStream(torch.utils.data.IterableDataset):
    """--streaming: training samples (or packed rows) read, tokenized and packed on the fly, in the file's order, pass
    after pass. `state_dict()` says where the next item comes from (the batch of rows it is in and how many of that
    batch's items came before it), so data/stream.py resumes it exactly."""

    def __init__(self, source: ChatFile, encoder: Encoder, packing: bool, limit: int | None = None):
        self.source, self.encoder, self.packing, self.limit = source, encoder, packing, limit
        self._position = self._start = {"offset": 0, "line": 0, "rows": 0, "done": 0}

    def state_dict(self) -> dict:
        return dict(self._position)

    def load_state_dict(self, state: dict) -> None:
        self._start = dict(state)

    def __iter__(self):
        start, self._start = self._start, {"offset": 0, "line": 0, "rows": 0, "done": 0}
        offset, line, taken, skip = start["offset"], start["line"], start["rows"], start["done"]
        size = STREAM_PACKING_ROWS if self.packing else BATCH_ROWS
        batch = []
        for r in self.source.rows(offset, line):
            if self.limit is not None and taken + len(batch) >= self.limit:
                break
            batch.append(r)
            if len(batch) == size:
                yield from self._items(batch, offset, line, taken, skip)
                offset, line, taken, skip, batch = batch[-1].end, batch[-1].line + 1, taken + len(batch), 0, []
        if batch:
            yield from self._items(batch, offset, line, taken, skip)

    def _items(self, rows, offset: int, line: int, taken: int, skip: int):
        encoded = self.encoder(rows)
        bounds = np.concatenate([[0], np.cumsum(encoded.lengths)])
        samples = [{"input_ids": encoded.input_ids[b:e], "labels": encoded.labels[b:e]}
                   for b, e in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
        if self.packing and samples:
            order, starts = best_fit_decreasing(encoded.lengths, self.encoder.max_length)
            samples = [packed_row([samples[i] for i in order[b:e]]) for b, e in zip(starts[:-1], starts[1:])]
        else:
            samples = [{key: value.tolist() for key, value in sample.items()} for sample in samples]
        for done, item in enumerate(samples[skip:], skip + 1):
            self._position = {"offset": offset, "line": line, "rows": taken, "done": done}
            yield item

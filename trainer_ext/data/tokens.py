"""Token sequences on disk: an Arrow file of `input_ids` and `labels` (int32 lists) written batch by batch from flat
arrays, and read back memory-mapped, as a datasets.Dataset (what the Trainer reads) and as numpy views (lengths and
single samples for packing, without copying or reading the rest)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

COLUMNS = ("input_ids", "labels")


def schema():
    import datasets

    sequence = datasets.List(datasets.Value("int32"))
    return datasets.Features({name: sequence for name in COLUMNS}).arrow_schema  # datasets reads its features back


class TokenWriter:
    """Writes samples to `path` as one Arrow stream (the format datasets memory-maps), a record batch per write."""

    def __init__(self, path: Path):
        import pyarrow as pa

        self.path, self.samples, self.tokens = Path(path), 0, 0
        self._schema = schema()
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_stream(self._sink, self._schema)

    def write(self, input_ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray) -> None:
        """Samples given flat: sample i is the next lengths[i] tokens of input_ids and labels."""
        import pyarrow as pa

        if not len(lengths):
            return
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        columns = [pa.ListArray.from_arrays(offsets, pa.array(np.asarray(values, dtype=np.int32)))
                   for values in (input_ids, labels)]
        self._writer.write_batch(pa.record_batch(columns, schema=self._schema))
        self.samples += len(lengths)
        self.tokens += int(np.sum(lengths))

    def close(self) -> None:
        self._writer.close()
        self._sink.close()


class TokenTable:
    """A memory-mapped Arrow file of samples: `lengths()` from the list offsets alone, `sample(i)` as numpy views of
    the mapped pages (only what is read becomes resident), `dataset()` as datasets.Dataset over the same file."""

    def __init__(self, path: Path):
        import pyarrow as pa

        self.path = Path(path)
        self._table = pa.ipc.open_stream(pa.memory_map(str(self.path))).read_all()  # its buffers keep the map open
        self._chunks = [{name: chunk for name, chunk in zip(self._table.column_names, chunks)}
                        for chunks in zip(*(self._table.column(name).chunks for name in COLUMNS))]
        sizes = [len(chunk["input_ids"]) for chunk in self._chunks]
        self._first = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # first sample of each chunk
        self._views = [{name: (chunk[name].offsets.to_numpy(), chunk[name].values.to_numpy()) for name in COLUMNS}
                       for chunk in self._chunks]

    def __len__(self) -> int:
        return int(self._first[-1])

    def lengths(self) -> np.ndarray:
        return np.concatenate([np.diff(view["input_ids"][0]) for view in self._views] or [np.zeros(0, np.int64)])

    def sample(self, index: int) -> dict:
        chunk = int(np.searchsorted(self._first, index, side="right")) - 1
        at = index - int(self._first[chunk])
        out = {}
        for name, (offsets, values) in self._views[chunk].items():
            out[name] = values[offsets[at]:offsets[at + 1]]
        return out

    def dataset(self):
        import datasets

        return datasets.Dataset.from_file(str(self.path))

"""Token shards read by byte range from every backend: memory, a local folder, S3 (moto), GCS (emulator).

train/data.py memory-maps local token files and reads remote ones with one ranged GET per window
(``fs.cat_ranges``). These tests write real token files to each backend, read windows that
straddle the boundary between two files, and check the bytes against numpy, the byte ranges asked
of the store, and that a batch stream over the bucket hands out exactly the batches it hands out
over the same tokens on local disk.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from atoll.train.data import BatchStream, DataError, open_tokens, write_tokens
from conftest import Backend

A = (np.arange(1000, dtype=np.int64) * 7919) % 50_000
B = (np.arange(700, dtype=np.int64) * 104_729) % 50_000
JOINED = np.concatenate([A, B])
WINDOWS = [0, 990, 995, 1000, 1690]  # the second and third straddle the end of a.bin
LENGTH = 10


def write_shards(backend: Backend, url: str) -> None:
    if backend.name == "local":
        Path(url).mkdir(parents=True)
    for name, tokens in (("a.bin", A), ("b.bin", B)):
        write_tokens(f"{url}/{name}", tokens, dtype="uint16", vocab_size=50_000,
                     storage_options=backend.storage_options)


class RangeSpy:
    """Records every read a filesystem is asked for while the data is read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fs) -> None:
        self.ranges: list[tuple[str, int, int]] = []
        self.whole: list[str] = []
        real = fs.cat_ranges

        def cat_ranges(paths, starts, ends, *args, **kwargs):
            self.ranges += list(zip(paths, starts, ends, strict=True))
            return real(paths, starts, ends, *args, **kwargs)

        real_cat_file = fs.cat_file

        def cat_file(path, start=None, end=None, **kwargs):  # what sync filesystems' cat_ranges calls
            if start is None or end is None:
                self.whole.append(f"cat_file({path})")
            return real_cat_file(path, start=start, end=end, **kwargs)

        def refuse(name):
            def whole(path, *args, **kwargs):
                self.whole.append(f"{name}({path})")
                raise AssertionError(f"{name} of a whole token file")
            return whole

        monkeypatch.setattr(fs, "cat_ranges", cat_ranges)
        monkeypatch.setattr(fs, "cat_file", cat_file)
        for name in ("cat", "open", "get", "get_file"):
            monkeypatch.setattr(fs, name, refuse(name))


def test_windows_are_read_by_byte_range(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    url = backend.new_url()
    write_shards(backend, url)
    data = open_tokens(f"{url}/*.bin", storage_options=backend.storage_options)  # a glob, sorted
    assert [f.url.rsplit("/", 1)[-1] for f in data.files] == ["a.bin", "b.bin"]
    assert len(data) == len(JOINED) and data.vocab_size == 50_000
    if backend.name == "local":  # memory-mapped: no reads through fsspec at all
        got = data.read_windows(WINDOWS, LENGTH)
    else:
        spies = {id(f.fs): RangeSpy(monkeypatch, f.fs) for f in data.files}
        got = data.read_windows(WINDOWS, LENGTH)
        asked = sorted((p.rsplit("/", 1)[-1], s, e) for spy in spies.values() for p, s, e in spy.ranges)
        # Window 990 is 10 tokens of a.bin; 995 is 5 of a.bin and 5 of b.bin; 2 bytes per token.
        assert asked == sorted([("a.bin", 0, 20), ("a.bin", 1980, 2000), ("a.bin", 1990, 2000),
                                ("b.bin", 0, 10), ("b.bin", 0, 20), ("b.bin", 1380, 1400)])
        assert not any(spy.whole for spy in spies.values())
    want = np.stack([JOINED[s : s + LENGTH] for s in WINDOWS])
    assert got.dtype == np.int64 and np.array_equal(got, want)


def test_a_batch_stream_over_the_bucket_equals_one_over_local_disk(backend: Backend, tmp_path) -> None:
    url = backend.new_url()
    write_shards(backend, url)
    remote = open_tokens([f"{url}/a.bin", f"{url}/b.bin"], storage_options=backend.storage_options)
    local_dir = tmp_path / "local-copy"
    local_dir.mkdir()
    write_tokens(str(local_dir / "all.bin"), JOINED, dtype="uint16", vocab_size=50_000)
    local = open_tokens(str(local_dir / "all.bin"))
    for learner in range(2):
        streams = [BatchStream(d, context_tokens=16, learner_index=learner, num_learners=2, seed=3)
                   for d in (remote, local)]
        for _ in range(4):
            (xr, yr), (xl, yl) = (s.next_batch(5) for s in streams)
            assert torch.equal(xr, xl) and torch.equal(yr, yl)
        assert streams[0].state_dict() == streams[1].state_dict()


def test_a_token_file_truncated_after_opening_is_a_clear_error(backend: Backend) -> None:
    url = backend.new_url()
    write_shards(backend, url)
    data = open_tokens(f"{url}/b.bin", storage_options=backend.storage_options)
    # The object is replaced by a shorter one behind the reader's back (an upload that was redone).
    write_tokens(f"{url}/b.bin", B[:695], dtype="uint16", sidecar=False, storage_options=backend.storage_options)
    data.files[0].fs.invalidate_cache()
    if backend.name == "local":  # memory-mapped on first read: the size is checked before mapping
        with pytest.raises(DataError, match=r"b\.bin: the file shrank to 1390 bytes after it was opened with 700"):
            data.read_windows([690], 10)
        return
    with pytest.raises(DataError, match=r"b\.bin: short read \(10 of 20 bytes\); is the file truncated\?"):
        data.read_windows([690], 10)
